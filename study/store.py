"""The study's run directories: WORK/PART/RUN_ID/ with ``run.json`` (written first: what the run
is), ``attempts.json`` (when each fairseq-train of it started) and ``result.json`` (written last,
atomically: the run is finished). A directory without ``result.json`` is an interrupted run: it is
resumed when it was started with the same flags and holds an intact ``checkpoint_last.pt``
(:func:`resumable_attempts`), from its newest validation checkpoint (:func:`resume_checkpoint`),
else started again from scratch."""
import fcntl
import json
import os
import re
import shutil
import subprocess
import time

from fairseq_agg.files import atomic_output
from study.harness.fairseq_commands import REPO

RUN_JSON = "run.json"
RESULT_JSON = "result.json"
ATTEMPTS_JSON = "attempts.json"  # [{"started": time, "ended": time or None}], one per fairseq-train of the run
LAST_CHECKPOINT = "checkpoint_last.pt"
INVOCATIONS_JSON = "invocations.json"  # WORK/PART/: every invocation that trained runs of the part
LOCK_FILE = ".study.lock"  # WORK/: held by the one invocation that writes there
_held_locks = []  # the open lock files of this process (closing one would release its lock)


def write_json_atomic(path, obj):
    """Writes ``obj`` to ``path`` through a temporary file, flushed and renamed (the package's
    atomic writer), so that a killed process never leaves a half-written file under the final
    name, and a full disk is one line naming the file."""
    with atomic_output(path, "w", flag="--work-dir") as f:
        json.dump(obj, f, indent=1, allow_nan=True)


def lock_work_dir(work_dir):
    """Takes WORK's lock for the rest of this process; returns None, or what the file says of the
    invocation that holds it. Two invocations on one work directory would train the same run
    directory (each starts an unfinished one from a clean directory) and rewrite the same reports.
    An flock is released by the OS when its process ends, killed or not: no stale lock is left."""
    os.makedirs(work_dir, exist_ok=True)
    fd = os.open(os.path.join(work_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "pid unknown"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}\n".encode())
    _held_locks.append(fd)
    return None


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def run_dir(work_dir, part, run_id):
    return os.path.join(work_dir, part, run_id)


def finished(directory):
    """(run.json, result.json) of a finished run, else None."""
    if not os.path.isfile(os.path.join(directory, RESULT_JSON)):
        return None
    return read_json(os.path.join(directory, RUN_JSON)), read_json(os.path.join(directory, RESULT_JSON))


def start_clean(directory):
    """An empty run directory (whatever an interrupted attempt left is removed)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)


def read_invocations(part_dir):
    """The records of WORK/PART/invocations.json, oldest first ([] when none)."""
    path = os.path.join(part_dir, INVOCATIONS_JSON)
    return read_json(path) if os.path.isfile(path) else []


def record_invocation(part_dir, seconds, runs_trained):
    """Appends one invocation that trained runs (its wall time, how many runs it trained, the
    checkout) to WORK/PART/invocations.json, so that the part's measured time survives every later
    ``--report`` and resumed invocation."""
    records = read_invocations(part_dir)
    records.append({"finished": time.time(), "seconds": seconds, "runs_trained": runs_trained,
                    "git": git_state()})
    write_json_atomic(os.path.join(part_dir, INVOCATIONS_JSON), records)


# fairseq-train flags that make a killed run resumable and change nothing it computes: fairseq's
# resume restores the model, the optimizer, the schedule, the position in the data, each update's
# seed and the criterion's counts (tests/test_study.py checks that a resumed run ends as an
# uninterrupted one). They are left out of a run's identity, with the number of values each takes.
RESUME_FLAGS = {"--save-interval-updates": 1, "--keep-interval-updates": 1, "--no-save-optimizer-state": 0}
# Which checkpoints are kept changes nothing a run computes either: with --epoch-checkpoints the
# demos' --no-epoch-checkpoints is dropped, and a run's identity is the same with or without it.
KEY_NEUTRAL_FLAGS = {**RESUME_FLAGS, "--no-epoch-checkpoints": 0}


def without_resume_flags(flags, dropped=RESUME_FLAGS):
    out, i = [], 0
    while i < len(flags):
        if flags[i] in dropped:
            i += 1 + dropped[flags[i]]
            continue
        out.append(flags[i])
        i += 1
    return out


def resumable_command(cmd, updates, epoch_checkpoints=False):
    """fairseq-train's command ``cmd`` made resumable: a checkpoint with the optimizer's state at
    each validation (``--validate-interval-updates``, else every tenth of ``updates``), of which
    only the newest is kept beside checkpoint_last.pt; with ``epoch_checkpoints`` also fairseq's
    checkpoint of every epoch's end (``--no-epoch-checkpoints`` dropped)."""
    every = cmd[cmd.index("--validate-interval-updates") + 1] if "--validate-interval-updates" in cmd \
        else str(max(1, updates // 10))
    kept = without_resume_flags(cmd)
    if epoch_checkpoints:
        kept = [x for x in kept if x != "--no-epoch-checkpoints"]
    return [*kept, "--save-interval-updates", every, "--keep-interval-updates", "1"]


# The plugin's directory (fairseq-train's --user-dir, the one ``fairseq-agg`` prints) is where the
# checkout keeps it, not what a run computes: a key holds this token in its place, so that a work
# directory still resumes after the plugin's directory has moved.
USER_DIR_TOKEN = "USER_DIR"


def with_neutral_user_dir(flags):
    """``flags`` with the value of every ``--user-dir`` replaced by :data:`USER_DIR_TOKEN`."""
    return [USER_DIR_TOKEN if i and flags[i - 1] == "--user-dir" else x for i, x in enumerate(flags)]


def run_key(cmd, data_bin, directory, data_flags, evaluation):
    """What makes two runs the same run: fairseq-train's flags (with the data, run and plugin
    directories as placeholders, so that a moved work directory or plugin still matches; the
    resume flags left out), the data flags and the evaluation settings."""
    flags = [{data_bin: "DATA", directory: "RUN_DIR"}.get(x, x) for x in without_resume_flags(cmd[1:], KEY_NEUTRAL_FLAGS)]
    return {"train_flags": with_neutral_user_dir(flags), "data": data_flags, "evaluation": evaluation}


def stored_key(run_json):
    """The key a run's ``run.json`` holds, as :func:`run_key` makes it now (the runs of the study's
    first days kept ``--no-save-optimizer-state`` in theirs; the keys written before
    :data:`USER_DIR_TOKEN` hold the plugin's directory itself)."""
    key = run_json.get("key")
    if not isinstance(key, dict) or not isinstance(key.get("train_flags"), list):
        return key
    return {**key, "train_flags": with_neutral_user_dir(without_resume_flags(key["train_flags"], KEY_NEUTRAL_FLAGS))}


def resumable_attempts(directory, key, readable):
    """The attempts (``attempts.json``) of an unfinished run in ``directory`` that can be resumed:
    same key, an attempts record, and a ``checkpoint_last.pt`` that ``readable(path)`` accepts.
    The last attempt's end is taken as its log's last write. None: start the run from scratch."""
    run_json, attempts = os.path.join(directory, RUN_JSON), os.path.join(directory, ATTEMPTS_JSON)
    checkpoint = os.path.join(directory, LAST_CHECKPOINT)
    if os.path.exists(os.path.join(directory, RESULT_JSON)) or not all(map(os.path.isfile, (run_json, attempts))):
        return None
    try:
        same = stored_key(read_json(run_json)) == key
        records = read_json(attempts)
    except (OSError, ValueError):
        return None
    if not same or not records or not os.path.isfile(checkpoint) or not readable(checkpoint):
        return None
    log = os.path.join(directory, "train.log")
    if records[-1].get("ended") is None:
        records[-1]["ended"] = os.path.getmtime(log) if os.path.isfile(log) else records[-1]["started"]
    return records


INTERVAL_CHECKPOINT = re.compile(r"checkpoint_\d+_(\d+)\.pt")


def resume_checkpoint(directory, readable):
    """The checkpoint to resume an unfinished run from: the newest intact one of those saved at a
    validation (checkpoint_E_U.pt), else checkpoint_last.pt. checkpoint_last.pt may be newer, but
    when it was saved at the end of an epoch, fairseq resumes from it with another order of the next
    epoch's batches than the uninterrupted run's (docs/usage.md, "Guarantees"), so at most one
    validation interval is trained again to keep the run exact."""
    saved = []
    for name in os.listdir(directory):
        match = INTERVAL_CHECKPOINT.fullmatch(name)
        if match and readable(os.path.join(directory, name)):
            saved.append((int(match.group(1)), name))
    return os.path.join(directory, max(saved)[1] if saved else LAST_CHECKPOINT)


def remove_interval_checkpoints(directory):
    """Removes the resume checkpoints of a finished run (checkpoint_E_U.pt; the last and the best stay)."""
    for name in os.listdir(directory):
        if INTERVAL_CHECKPOINT.fullmatch(name):
            os.remove(os.path.join(directory, name))


def git_state():
    """{"commit", "dirty"} of the checkout, or None outside a git checkout (read-only git calls)."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
        return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None
