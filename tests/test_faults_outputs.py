"""Faults lose nothing (#35): the outputs of ``fairseq-agg average-checkpoints`` and
``fairseq-agg-analyze`` under kills, a full disk and outputs that are no regular file, as real
subprocesses.

A killed run leaves the previous output (or none) and a temporary named after its pid, which the
next run of the command removes; a killed ``analyze --out DIR`` leaves DIR the previous complete
report or the new one, never a mix, and the user's other files in DIR stay; a full disk (a
file-size limit in the child process) is one line and keeps the previous output byte for byte; an
output that is a device, FIFO or socket is refused before any work, and inputs that are no regular
file are refused for what they are. Every case checks the exit status, the last stderr line, that
no input changed and what the output's directory holds afterwards."""
import errno
import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import time

import pytest

import fairseq_runs as fr
from fairseq_agg.analysis.analyze import REPORT_FILES
from fairseq_agg.errors import UsageError
from fairseq_agg.files import atomic_output

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trained(lm_data_bin, tmp_path_factory):
    """A tiny LM trained for four updates: checkpoint_1_2.pt, checkpoint_1_4.pt, checkpoint_last.pt."""
    save = tmp_path_factory.mktemp("faults_outputs")
    fr.run_cli("fairseq-train", [lm_data_bin, *fr.TINY_LM_ARGS, "--max-update", "4", "--save-interval-updates", "2",
                                 "--no-epoch-checkpoints", "--save-dir", save])
    return save


@pytest.fixture
def ckpts(trained, tmp_path):
    """The two update checkpoints, copied into a directory of their own."""
    directory = tmp_path / "ckpts"
    directory.mkdir()
    for name in ("checkpoint_1_2.pt", "checkpoint_1_4.pt"):
        shutil.copy(trained / name, directory / name)
    return directory


# ----------------------------------------------------------------------------------------------
# helpers


def _command(name, args):
    return [fr.fairseq_bin(name)] + [str(a) for a in args]


def _run(name, args, preexec_fn=None, cwd=None):
    return subprocess.run(_command(name, args), capture_output=True, text=True, timeout=600,
                          preexec_fn=preexec_fn, cwd=cwd)


def _start(name, args):
    return subprocess.Popen(_command(name, args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _ok(name, args):
    proc = _run(name, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _file_size_limit(limit):
    """A full disk for the child: a write past ``limit`` bytes fails with EFBIG (SIGXFSZ, which
    would kill it instead, ignored)."""
    def limit_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limit_writes


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _checksums(*paths):
    """sha256 of every file among ``paths`` and in the directories among them."""
    files = []
    for path in map(str, paths):
        files += [os.path.join(path, name) for name in os.listdir(path)] if os.path.isdir(path) else [path]
    return {path: _sha256(path) for path in files if os.path.isfile(path)}


def _listing(directory):
    return sorted(os.listdir(directory))


def _refused(name, args, inputs, watched=None, preexec_fn=None, cwd=None):
    """Runs the command; checks exit status 2, one error line without a traceback, unchanged
    ``inputs`` and an unchanged listing of the directory ``watched``; returns the message."""
    before, listed = _checksums(*inputs), watched and _listing(watched)
    proc = _run(name, args, preexec_fn=preexec_fn, cwd=cwd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    prog = "fairseq-agg average-checkpoints" if name == "fairseq-agg" else name
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), proc.stderr[-3000:]
    assert _checksums(*inputs) == before
    assert watched is None or _listing(watched) == listed
    return last.split(": error: ", 1)[1]


def _timed_ok(name, args):
    """Runs the command, which must succeed; returns how many seconds it took."""
    began = time.monotonic()
    _ok(name, args)
    return time.monotonic() - began


def _kill(proc, when):
    """SIGKILLs ``proc`` once ``when`` holds: a number of seconds after it started, or a function of
    its pid, polled every millisecond; returns whether it was still running then."""
    began = time.monotonic()
    due = when if callable(when) else (lambda pid: time.monotonic() - began >= when)
    while proc.poll() is None and not due(proc.pid) and time.monotonic() - began < 300:
        time.sleep(0.001)
    running = proc.poll() is None
    if running:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    return running


def _dead_pid():
    """The pid of a process that has ended (what a killed run's temporaries are named with)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------------------------------------
# kills


def _average(ckpts, output, count):
    return ["average-checkpoints", "--inputs", ckpts, "--num-update-checkpoints", count, "--output", output]


def _average_temporaries(directory, pid=r"\d+"):
    """The temporaries of avg.pt in ``directory`` (of the process ``pid``)."""
    return [directory / name for name in os.listdir(directory)
            if re.fullmatch(rf"\.avg\.pt\.{pid}\.[a-z0-9_]+\.tmp", name)]


def _size(path):
    with contextlib.suppress(FileNotFoundError):
        return path.stat().st_size
    return 0


def test_a_killed_average_keeps_the_previous_output_and_the_next_run_removes_its_temporaries(ckpts, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "avg.pt"
    duration = _timed_ok("fairseq-agg", _average(ckpts, output, 1))  # the previous output: the newest checkpoint
    previous = output.read_bytes()
    inputs = _checksums(ckpts)
    # a temporary of a live process (this one) is not debris
    live = out_dir / f".avg.pt.{os.getpid()}.abcdefgh.tmp"
    live.write_bytes(b"being written")
    after_kills, debris = [], set()
    moments = [lambda pid: bool(_average_temporaries(out_dir, pid)),  # as soon as its temporary exists
               lambda pid: any(_size(path) for path in _average_temporaries(out_dir, pid)),  # while torch.save writes
               duration / 2]  # halfway through, by the previous run's time
    for moment in moments:
        proc = _start("fairseq-agg", _average(ckpts, output, 2))
        running = _kill(proc, moment)
        if moment is moments[0]:  # killed while its temporary existed: the debris a kill used to leave for good
            assert running and _average_temporaries(out_dir, proc.pid)
        after_kills.append(output.read_bytes())
        debris.update(_average_temporaries(out_dir))
    assert len(debris) >= 2  # the live one and at least the first killed run's
    assert _checksums(ckpts) == inputs

    proc = _ok("fairseq-agg", _average(ckpts, output, 2))
    assert "averaged 2 checkpoints" in proc.stdout
    assert _listing(out_dir) == sorted(["avg.pt", live.name])  # every killed run's temporary is gone
    new = output.read_bytes()
    assert new != previous
    # after every kill the output was the previous average or the complete new one, never a part
    assert all(content in (previous, new) for content in after_kills)
    assert _checksums(ckpts) == inputs


def _analyze(checkpoint, out, label, *extra):
    return [checkpoint, "--cpu", "--labels", label, "--out", out, *extra]


def _report_of(out):
    """The label of the one complete report in ``out``; fails on a mix of two runs or a missing file."""
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    label = report["checkpoints"][0]["label"]
    table = (out / "table.md").read_text(encoding="utf-8").split("\n\n")[0]  # the rows, before the legend
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == [f"| {label}"] * len(report["table"]["rows"])
    assert table.splitlines()[0].count(" | ") == len(report["table"]["columns"]) - 1
    assert sorted(report["figures"].values()) == ["projection.png", "spectrum.png"]
    for name in report["figures"].values():
        assert (out / name).read_bytes().startswith(PNG_MAGIC)
    return label


def _user_files(out):
    """Files of the user's in the report directory, which every run must carry over."""
    (out / "notes.txt").write_text("my notes\n")
    (out / "runs").mkdir()
    (out / "runs" / "seed1.log").write_text("log\n")
    return {"notes.txt": "my notes\n", "runs/seed1.log": "log\n"}


def _check_user_files(out, files):
    for name, text in files.items():
        assert (out / name).read_text() == text


def test_a_killed_analyze_leaves_the_previous_report_or_the_new_one(trained, tmp_path):
    checkpoint = trained / "checkpoint_last.pt"
    inputs = _checksums(checkpoint)
    parent = tmp_path / "reports"
    out = parent / "analysis"
    duration = _timed_ok("fairseq-agg-analyze", _analyze(checkpoint, out, "previous"))
    user_files = _user_files(out)
    previous = _checksums(out)

    def building(pid):
        return parent / f".analysis.new-{pid}.tmp"

    # as soon as it builds the new report beside the previous one; halfway through, by the previous run's time
    moments = [lambda pid: building(pid).is_dir(), duration / 2]
    for moment in moments:
        proc = _start("fairseq-agg-analyze", _analyze(checkpoint, out, "new"))
        running = _kill(proc, moment)
        if moment is moments[0]:  # killed while it built the new report: the previous one is untouched
            assert running and building(proc.pid).is_dir() and _report_of(out) == "previous"
        if out.is_dir():  # the previous report, every byte, or the complete new one
            if _report_of(out) == "previous":
                assert _checksums(out) == previous
            _check_user_files(out, user_files)
        else:  # killed between its two renames: the previous report waits beside it for the next run
            assert (parent / f".analysis.old-{proc.pid}.tmp").is_dir()
    assert _checksums(checkpoint) == inputs

    proc = _ok("fairseq-agg-analyze", _analyze(checkpoint, out, "new"))
    assert _listing(parent) == ["analysis"]  # no new or old directory of a killed run is left
    assert _listing(out) == sorted(list(REPORT_FILES) + ["notes.txt", "runs"])
    assert _report_of(out) == "new"
    _check_user_files(out, user_files)
    assert _checksums(checkpoint) == inputs


def test_a_swap_killed_between_its_renames_is_undone_by_the_next_run(trained, tmp_path):
    """What a run killed between renaming --out away and renaming its new report in leaves (the
    previous report as .NAME.old-PID.tmp, the new one holding the user's files as .NAME.new-PID.tmp,
    no --out), and what one killed after both renames leaves (the previous report as
    .NAME.old-PID.tmp beside the new one): the next run puts the previous report back, or removes
    it, and the user's files stay."""
    checkpoint = trained / "checkpoint_last.pt"
    inputs = _checksums(checkpoint)
    parent = tmp_path / "reports"
    out = parent / "analysis"
    _ok("fairseq-agg-analyze", _analyze(checkpoint, out, "previous", "--no-figures"))
    (out / "notes.txt").write_text("my notes\n")
    previous = _checksums(out)
    killed = _dead_pid()
    new, old = parent / f".analysis.new-{killed}.tmp", parent / f".analysis.old-{killed}.tmp"
    new.mkdir()
    (new / "report.json").write_text('{"version": 1, "checkpoints": [')
    (out / "notes.txt").rename(new / "notes.txt")
    out.rename(old)

    # a run that cannot write its report (a full disk) first undoes the killed swap
    message = _refused("fairseq-agg-analyze", _analyze(checkpoint, out, "new", "--no-figures"), [checkpoint],
                       preexec_fn=_file_size_limit(1000))
    assert message == f"file size limit exceeded writing {out}; the previous {out} is kept"
    assert _listing(parent) == ["analysis"] and _checksums(out) == previous  # the previous report, whole

    # killed after both renames: the old directory (with a file the user put there meanwhile) is left
    killed = _dead_pid()
    old = parent / f".analysis.old-{killed}.tmp"
    old.mkdir()
    for name in ("report.json", "table.md", "spectrum.png"):
        (old / name).write_text("an older report\n")
    (old / "late.txt").write_text("written during the swap\n")
    # and what a killed run of the version that wrote the report's files one by one left in it
    (out / ".spectrum.png.k2j3h4g5.png.tmp").write_bytes(PNG_MAGIC)
    _ok("fairseq-agg-analyze", _analyze(checkpoint, out, "new"))
    assert _listing(parent) == ["analysis"]
    assert _listing(out) == sorted(list(REPORT_FILES) + ["late.txt", "notes.txt"])
    assert _report_of(out) == "new"
    assert (out / "notes.txt").read_text() == "my notes\n" and (out / "late.txt").read_text() == "written during the swap\n"
    assert _checksums(checkpoint) == inputs


# ----------------------------------------------------------------------------------------------
# a full disk


def test_a_full_disk_is_one_line_and_keeps_the_previous_average(ckpts, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "avg.pt"
    _ok("fairseq-agg", _average(ckpts, output, 1))
    previous = _checksums(output)
    limit = _file_size_limit(output.stat().st_size // 2)  # the new average is as large as the previous one
    message = _refused("fairseq-agg", _average(ckpts, output, 2), [ckpts, output], out_dir, preexec_fn=limit)
    assert message == f"file size limit exceeded writing {output}; the previous {output} is kept"
    assert _listing(out_dir) == ["avg.pt"] and _checksums(output) == previous

    fresh = out_dir / "fresh.pt"
    message = _refused("fairseq-agg", _average(ckpts, fresh, 2), [ckpts, output], out_dir, preexec_fn=limit)
    assert message == f"file size limit exceeded writing {fresh}; {fresh} was not written"


def test_a_full_disk_is_one_line_and_writes_no_report(trained, tmp_path):
    checkpoint = trained / "checkpoint_last.pt"
    parent = tmp_path / "reports"
    parent.mkdir()
    out = parent / "analysis"
    message = _refused("fairseq-agg-analyze", _analyze(checkpoint, out, "new", "--no-figures"), [checkpoint], parent,
                       preexec_fn=_file_size_limit(1000))
    assert message == f"file size limit exceeded writing {out}; {out} was not written"
    assert _listing(parent) == []


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "no space left on device"),
                                          (errno.EDQUOT, "disk quota exceeded")])
def test_a_full_disk_or_quota_is_the_same_one_line(tmp_path, code, reason):
    """ENOSPC and EDQUOT, which a test cannot cause without a small file system of its own, in
    process: raised as torch.save raises a failed write to its file (a RuntimeError while handling
    the file's OSError), they take the path of the file-size limit above."""
    output = tmp_path / "avg.pt"
    output.write_bytes(b"previous")
    with pytest.raises(UsageError) as refused:
        with atomic_output(str(output)) as handle:
            handle.write(b"partial")
            try:
                raise OSError(code, os.strerror(code))
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc] file write failed")
    assert str(refused.value) == f"{reason} writing {output}; the previous {output} is kept"
    assert _listing(tmp_path) == ["avg.pt"] and output.read_bytes() == b"previous"


# ----------------------------------------------------------------------------------------------
# outputs that are no regular file


def test_an_average_output_that_is_no_regular_file_is_refused(ckpts, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    fifo = out_dir / "avg.pt"
    os.mkfifo(fifo)
    link = out_dir / "link.pt"
    link.symlink_to(fifo)
    for output, kind in [(fifo, "a FIFO"), (link, "a symbolic link to a FIFO")]:
        assert _refused("fairseq-agg", _average(ckpts, output, 2), [ckpts], out_dir) == \
            f"--output {output}: not a regular file ({kind}); name a regular file"
        assert stat.S_ISFIFO(os.stat(output).st_mode)
    if os.path.exists("/dev/full"):  # as root this used to replace the device node with a file
        assert _refused("fairseq-agg", _average(ckpts, "/dev/full", 2), [ckpts], "/dev") == \
            "--output /dev/full: not a regular file (a character device); name a regular file"
        assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_an_analyze_output_that_is_no_regular_file_is_refused(trained, tmp_path):
    checkpoint = trained / "checkpoint_last.pt"
    out = tmp_path / "analysis"
    out.mkdir()
    os.mkfifo(out / "table.md")
    assert _refused("fairseq-agg-analyze", _analyze(checkpoint, out, "new"), [checkpoint], out) == \
        f"--out {out / 'table.md'}: not a regular file (a FIFO); name a regular file"
    if os.path.exists("/dev/null"):
        assert _refused("fairseq-agg-analyze", _analyze(checkpoint, "/dev/null", "new"), [checkpoint], tmp_path) == \
            "--out /dev/null: not a directory (a character device); name a directory"
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    # the current directory cannot be replaced as a whole under the shell standing in it
    assert _refused("fairseq-agg-analyze", _analyze(checkpoint, ".", "new"), [checkpoint], out, cwd=out) == \
        "--out . is or holds the current directory, and replacing it as a whole would leave this shell " \
        "in a removed directory; name another directory"


# ----------------------------------------------------------------------------------------------
# inputs refused for what they are


def test_inputs_that_are_no_regular_file_are_refused_for_what_they_are(trained, ckpts, tmp_path):
    checkpoint = trained / "checkpoint_last.pt"
    fifo = tmp_path / "pairs.tsv"
    os.mkfifo(fifo)
    pairs_dir = tmp_path / "lists"
    pairs_dir.mkdir()
    link = tmp_path / "wordsim.tsv"
    link.symlink_to(pairs_dir)
    out = tmp_path / "analysis"
    for word_sim, kind in [(fifo, "a FIFO"), (link, "a symbolic link to a directory")]:
        assert _refused("fairseq-agg-analyze", _analyze(checkpoint, out, "new", "--word-sim", word_sim),
                        [checkpoint], tmp_path) == f"--word-sim {word_sim}: not a regular file ({kind})"
    # a checkpoint that is a FIFO: torch.load would have waited for a writer forever
    assert _refused("fairseq-agg-analyze", _analyze(fifo, out, "new"), [checkpoint], tmp_path) == \
        f"{fifo}: not a regular file (a FIFO); pass a checkpoint file"
    output = tmp_path / "avg.pt"
    assert _refused("fairseq-agg", ["average-checkpoints", "--inputs", ckpts, "--output", output], [ckpts], tmp_path) == \
        f"--inputs: {ckpts} is a directory; to average the last N checkpoints in it, add --num-epoch-checkpoints N " \
        "(checkpointEPOCH.pt) or --num-update-checkpoints N (checkpoint_EPOCH_UPDATE.pt)"
    assert _refused("fairseq-agg", ["average-checkpoints", "--inputs", ckpts / "checkpoint_1_4.pt", fifo,
                                    "--output", output], [ckpts], tmp_path) == \
        f"--inputs: {fifo}: not a regular file (a FIFO); name a checkpoint file"
