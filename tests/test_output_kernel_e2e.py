"""``--output-kernel`` in real fairseq-train runs: AGG with label smoothing trains the same on the
compiled chunk body (the default on this CPU), the eager one and PyTorch's F.linear_cross_entropy
(AGG by algebra), and the log says once which path runs."""
import pytest
import torch

from fairseq_runs import TINY_LM_ARGS, USER_DIR, read_json_log, run_cli

UPDATES = 6


def train(data, save_dir, kernel):
    args = [data, "--user-dir", USER_DIR] + TINY_LM_ARGS + [
        "--criterion", "cross_entropy_agg", "--agg-alpha", "0.5", "--agg-window", "3", "--label-smoothing", "0.1",
        "--max-update", UPDATES, "--save-dir", save_dir, "--log-format", "json", "--no-save",
        "--output-kernel", kernel,
    ]
    proc = run_cli("fairseq-train", args)
    log = proc.stdout + proc.stderr
    records = [r for r in read_json_log(log) if "num_updates" in r and "loss" in r]
    return log, records


@pytest.fixture(scope="module")
def runs(lm_data_bin, tmp_path_factory):
    kernels = ["auto", "eager"] + (["torch"] if hasattr(torch.nn.functional, "linear_cross_entropy") else [])
    return {k: train(lm_data_bin, str(tmp_path_factory.mktemp(f"kernel_{k}")), k) for k in kernels}


def test_the_log_names_the_path_once(runs):
    default_log, _ = runs["auto"]  # the default, named: the tests' runs are eager unless they name one
    lines = [line for line in default_log.splitlines() if "output layer:" in line]
    assert len(lines) == 1 and "cross_entropy_agg: output layer: compiled chunk body (torch.compile" in lines[0]
    assert "output layer: eager chunk body (as asked)" in runs["eager"][0]
    if "torch" in runs:
        assert "output layer: PyTorch's F.linear_cross_entropy (AGG's gates by algebra)" in runs["torch"][0]


def test_every_kernel_trains_the_same(runs):
    reference = runs["eager"][1]
    assert [int(r["num_updates"]) for r in reference] == list(range(1, UPDATES + 1))
    assert any(float(r["agg_rare"]) > 0 for r in reference)  # the gates act in these updates
    for kernel, (_, records) in runs.items():
        assert len(records) == UPDATES
        for got, want in zip(records, reference):  # fp32; the log rounds to 3 decimals
            for key in ("loss", "nll_loss", "agg_rare", "agg_g1"):
                assert float(got[key]) == pytest.approx(float(want[key]), abs=2e-3), (kernel, key)
