"""``fairseq-agg average-checkpoints`` writes what fairseq-train writes: the stock tools load the
average with torch's default safe loading (weights_only=True), without
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD."""
import os
import pickle
import subprocess
import sys

import pytest
import torch
from fairseq import checkpoint_utils
from omegaconf import OmegaConf

from fairseq_agg.testing import fairseq_runs as fr

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
    assert not os.path.exists(avg + ".tmp")
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
    if allow_namespace:  # what fairseq_agg does on import, i.e. in every tool run with --user-dir
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
