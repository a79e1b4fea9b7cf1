"""``fairseq-agg average-checkpoints`` writes what fairseq-train writes: the stock tools load the
average with torch's default safe loading (weights_only=True), without
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD. Its mistakes (an output that is an input, an input given twice,
unusable inputs or outputs) are one line and change no file; a failed write leaves no trace."""
import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf

import fairseq_runs as fr

# the environment variables that would switch torch's safe loading off (or force it)
UNSAFE_LOAD_VARS = ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_WEIGHTS_ONLY_LOAD")


@pytest.fixture(autouse=True)
def default_safe_loading(monkeypatch):
    for var in UNSAFE_LOAD_VARS:
        monkeypatch.delenv(var, raising=False)


def _train_and_average(data, base_args, save_dir, extra):
    """Four updates with a checkpoint every two (checkpoint_1_2.pt, checkpoint_1_4.pt), averaged."""
    fr.run_cli("fairseq-train", [data, "--user-dir", fr.USER_DIR, *base_args, *extra, "--max-update", "4",
                                 "--save-interval-updates", "2", "--save-dir", save_dir])
    avg = os.path.join(save_dir, "avg.pt")
    proc = fr.run_cli("fairseq-agg", ["average-checkpoints", "--inputs", save_dir, "--num-update-checkpoints", "2",
                                      "--output", avg])
    assert "averaged 2 checkpoints" in proc.stdout
    assert not [name for name in os.listdir(save_dir) if name.endswith(".tmp")]
    return avg


@pytest.fixture(scope="module")
def lm_average(lm_data_bin, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("avg_lm"))
    return save, _train_and_average(lm_data_bin, fr.TINY_LM_ARGS, save, ["--criterion", "cross_entropy_agg"])


@pytest.fixture(scope="module")
def mt_average(mt_data_bin, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("avg_mt"))
    return save, _train_and_average(
        mt_data_bin, fr.TINY_MT_ARGS, save, ["--criterion", "cross_entropy_agg", "--label-smoothing", "0.1"])


def _safe_load_in_fresh_process(path, allow_namespace=False):
    """torch.load(weights_only=True) in a process that imports neither fairseq nor this plugin."""
    code = "import sys, torch\n"
    if allow_namespace:  # what registering the plugin does, i.e. in every tool run with --user-dir
        code += "import argparse; torch.serialization.add_safe_globals([argparse.Namespace])\n"
    code += "state = torch.load(sys.argv[1], map_location='cpu', weights_only=True)\nprint(type(state['cfg']).__name__)\n"
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_safe_loading_refuses_an_omegaconf_cfg(tmp_path):
    """What the averaged file used to be: fairseq's loaded cfg saved as is (the check below can fail)."""
    path = str(tmp_path / "omegaconf_cfg.pt")
    torch.save({"cfg": OmegaConf.create({"model": {"_name": "transformer_lm"}}), "model": {}}, path)
    with pytest.raises(pickle.UnpicklingError, match="DictConfig"):
        torch.load(path, weights_only=True)


def test_lm_average_loads_safely_like_the_checkpoints_it_averages(lm_average):
    save, avg = lm_average
    # fairseq-train's own checkpoint and the average: the same layout, loadable by plain torch
    assert _safe_load_in_fresh_process(os.path.join(save, "checkpoint_1_4.pt")) == "dict"
    assert _safe_load_in_fresh_process(avg) == "dict"
    # and it is the element-wise mean of the two checkpoints
    s1 = checkpoint_utils.load_checkpoint_to_cpu(os.path.join(save, "checkpoint_1_2.pt"))["model"]
    s2 = checkpoint_utils.load_checkpoint_to_cpu(os.path.join(save, "checkpoint_1_4.pt"))["model"]
    averaged = torch.load(avg, map_location="cpu", weights_only=True)
    assert "last_optimizer_state" not in averaged
    key = "decoder.layers.0.fc1.weight"
    assert not torch.equal(s1[key], s2[key])
    for k, v in s2.items():
        if v.is_floating_point():
            torch.testing.assert_close(averaged["model"][k], ((s1[k].double() + v.double()) / 2).to(v.dtype),
                                       rtol=0, atol=1e-7)


def test_fairseq_eval_lm_scores_the_average_without_the_plugin(lm_data_bin, lm_average):
    _, avg = lm_average
    # transformer_lm is a stock architecture: stock fairseq-eval-lm, no --user-dir
    proc = fr.run_cli("fairseq-eval-lm", [lm_data_bin, "--path", avg, "--task", "language_modeling",
                                          "--gen-subset", "test", "--tokens-per-sample", "64", "--max-tokens", "512",
                                          "--cpu", "--num-workers", "0"])
    assert "Perplexity:" in proc.stdout + proc.stderr


def test_fairseq_agg_analyze_reads_the_average(lm_data_bin, lm_average, tmp_path):
    _, avg = lm_average
    out = str(tmp_path / "analysis")
    fr.run_cli("fairseq-agg-analyze", [avg, "--data", lm_data_bin, "--no-ppl", "--no-figures", "--out", out])
    assert os.path.isfile(os.path.join(out, "report.json"))


def test_fairseq_generate_translates_with_the_average(mt_data_bin, mt_average):
    save, avg = mt_average
    # the MT config holds an argparse.Namespace (legacy model args), allowed by the plugin on import
    assert _safe_load_in_fresh_process(avg, allow_namespace=True) == "dict"
    proc = fr.run_cli("fairseq-generate", [mt_data_bin, "--path", avg, "--user-dir", fr.USER_DIR,
                                           "--task", "translation", "--source-lang", "en", "--target-lang", "de",
                                           "--gen-subset", "test", "--beam", "2", "--batch-size", "50",
                                           "--max-len-a", "1", "--max-len-b", "5",  # a 4-update model rambles
                                           "--required-batch-size-multiple", "1", "--cpu", "--num-workers", "0"])
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 100  # make_mt_data's test split


# ----------------------------------------------------------------------------------------------
# mistakes: one line, exit status 2, nothing written and no input changed


@pytest.fixture
def checkpoints(lm_average, tmp_path):
    """Copies of the two update checkpoints, under their fairseq-train names, in a fresh directory."""
    save, _ = lm_average
    ckpt_dir = tmp_path / "ckpts"
    ckpt_dir.mkdir()
    for name in ("checkpoint_1_2.pt", "checkpoint_1_4.pt"):
        shutil.copy(os.path.join(save, name), ckpt_dir / name)
    return ckpt_dir, ckpt_dir / "checkpoint_1_2.pt", ckpt_dir / "checkpoint_1_4.pt"


def _checksums(*paths):
    """sha256 of every file in the directories of ``paths``: what a refused command must not change."""
    sums = {}
    for directory in {os.path.dirname(os.path.abspath(str(p))) for p in paths}:
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    sums[path] = hashlib.sha256(f.read()).hexdigest()
    return sums


def _refused(args, *watched):
    """Runs ``fairseq-agg average-checkpoints ARGS``; checks that it is refused in one line without
    writing or changing a file beside any of ``watched``; returns the message."""
    before = _checksums(*watched)
    proc = fr.run_cli("fairseq-agg", ["average-checkpoints"] + [str(a) for a in args], expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fairseq-agg average-checkpoints: error: "), proc.stderr
    assert _checksums(*watched) == before
    return lines[0].split(": error: ", 1)[1]


def test_output_naming_an_input_is_refused(checkpoints, tmp_path):
    ckpt_dir, first, second = checkpoints
    assert _refused(["--inputs", first, second, "--output", second], first) == \
        f"--output {second} is one of the inputs; it would be overwritten"
    # the same checkpoint chosen by --num-update-checkpoints, and under another name
    assert "is one of the inputs" in _refused(
        ["--inputs", ckpt_dir, "--num-update-checkpoints", "2", "--output", first], first)
    link = tmp_path / "newest.pt"
    link.symlink_to(second)
    assert "is one of the inputs" in _refused(["--inputs", first, second, "--output", link], first, link)


def test_an_input_given_twice_is_refused(checkpoints, tmp_path):
    _, first, second = checkpoints
    assert _refused(["--inputs", first, second, first, "--output", tmp_path / "avg.pt"], first, tmp_path / "avg.pt") \
        == f"--inputs: {first} and {first} are the same checkpoint; give each one once"
    link = tmp_path / "again.pt"
    link.symlink_to(first)
    assert f"--inputs: {link} and {first} are the same checkpoint" in _refused(
        ["--inputs", first, link, "--output", tmp_path / "avg.pt"], first, link)


def test_unusable_inputs_are_refused(checkpoints, tmp_path):
    _, first, second = checkpoints
    out = tmp_path / "avg.pt"
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    assert _refused(["--inputs", second, truncated, "--output", out], first, out).startswith(
        f"--inputs: {truncated} is not a readable fairseq checkpoint (")
    junk = tmp_path / "notes.txt"
    junk.write_text("not a checkpoint\n")
    assert f"--inputs: {junk} is not a readable fairseq checkpoint (" in _refused(
        ["--inputs", second, junk, "--output", out], first, out)
    not_fairseq = tmp_path / "tensors.pt"  # a torch file, but not fairseq's
    torch.save({"weights": torch.zeros(2)}, not_fairseq)
    message = _refused(["--inputs", second, not_fairseq, "--output", out], first, out)
    assert message.startswith(f"--inputs: {not_fairseq} is not a") and "fairseq checkpoint" in message
    assert _refused(["--inputs", second, tmp_path / "missing.pt", "--output", out], first, out) == \
        f"--inputs: no such checkpoint file: {tmp_path / 'missing.pt'}"
    assert not out.exists()


def test_an_unreadable_input_is_refused(checkpoints, tmp_path):
    _, first, second = checkpoints
    locked = tmp_path / "locked.pt"
    shutil.copy(second, locked)
    locked.chmod(0)
    try:
        if os.access(locked, os.R_OK):
            pytest.skip("this process reads files without read permission (root)")
        assert _refused(["--inputs", first, locked, "--output", tmp_path / "avg.pt"], first, locked) == \
            f"--inputs: {locked} is not readable"
    finally:
        locked.chmod(0o644)


def _unwritable_directory(tmp_path):
    """A directory this process cannot create files in, or None."""
    locked = tmp_path / "read_only"
    locked.mkdir()
    locked.chmod(0o555)
    for directory in (str(locked), "/sys"):  # root ignores permissions; /sys is read-only for it
        try:
            with tempfile.TemporaryFile(dir=directory):
                pass
        except OSError:
            return directory
    return None


def test_unusable_outputs_are_refused_before_any_work(checkpoints, tmp_path):
    _, first, second = checkpoints
    inputs = ["--inputs", first, second]
    assert _refused(inputs + ["--output", ""], first) == "--output must name a file, got an empty path"
    assert _refused(inputs + ["--output", tmp_path], first) == f"--output {tmp_path} is a directory; name a file"
    missing = tmp_path / "no" / "avg.pt"
    assert _refused(inputs + ["--output", missing], first) == \
        f"--output {missing}: the directory {missing.parent} does not exist"
    unwritable = _unwritable_directory(tmp_path)
    if unwritable is None:
        pytest.skip("no directory this process cannot write to")
    out = os.path.join(unwritable, "avg.pt")
    message = _refused(inputs + ["--output", out], first)
    assert message.startswith(f"--output {out}: ") and ("not writable" in message or "cannot create" in message)
    assert not os.path.exists(out)


def test_a_failed_write_leaves_the_old_output_and_no_temporary_file(checkpoints, tmp_path, monkeypatch, capsys):
    import fairseq_agg_cli

    _, first, second = checkpoints
    out = tmp_path / "avg.pt"
    out.write_bytes(b"the previous average")

    def save_half_then_fail(obj, f):  # a full disk in the middle of the write
        f.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(SystemExit) as exc:
        fairseq_agg_cli.run_command("average-checkpoints", ["--inputs", str(first), str(second), "--output", str(out)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        f"fairseq-agg average-checkpoints: error: no space left on device writing {out}; the previous {out} is kept"
    assert out.read_bytes() == b"the previous average"
    assert sorted(os.listdir(tmp_path)) == ["avg.pt", "ckpts"]
