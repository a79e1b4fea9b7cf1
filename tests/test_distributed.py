"""Two real fairseq-train processes (gloo, CPU, launched by hand): identical AGG windows, bit-equal
parameters on both ranks; --agg-local-counts gives each rank its own window."""
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from fairseq_runs import TINY_LM_ARGS, USER_DIR

# fairseq writes checkpoints on rank 0 only: each rank dumps its own trainer state when
# fairseq_cli.train.cli_main returns (the real training loop, unchanged).
RANK_STATE_DUMPER = textwrap.dedent('''
    import atexit, sys
    import torch
    from fairseq.trainer import Trainer
    from fairseq_cli import train

    out = sys.argv.pop(1)
    trainers = []
    original_init = Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        trainers.append(self)

    Trainer.__init__ = init

    def dump():
        trainer = trainers[0]
        torch.save({"model": {k: v.detach().cpu() for k, v in trainer.get_model().state_dict().items()},
                    "criterion": {k: v.detach().cpu() for k, v in trainer.get_criterion().state_dict().items()},
                    "num_updates": trainer.get_num_updates()}, out)

    atexit.register(dump)
    sys.argv[0] = "fairseq-train"
    train.cli_main()
''')


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_two_ranks(data, tmp_path, extra, arch="transformer_lm"):
    script = tmp_path / "dump_rank_state.py"
    script.write_text(RANK_STATE_DUMPER)
    port = free_port()
    common = [data, "--user-dir", USER_DIR, "--max-update", "3", "--no-epoch-checkpoints", "--no-save",
              "--distributed-world-size", "2", "--distributed-init-method", f"tcp://127.0.0.1:{port}",
              "--distributed-no-spawn", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
    common += with_arch(arch) + extra
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / f"rank{r}.pt")]
                              + [str(a) for a in common] + ["--distributed-rank", str(r), "--save-dir",
                                                            str(tmp_path / f"ckpt{r}")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    assert re.findall(r"fairseq_cli.train[ |:]+model: (\w+)", outputs[0]) == [MODEL_CLASSES[arch]]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def window_entries(state):
    return {k: v for k, v in state["criterion"].items() if k.rsplit(".", 1)[-1] in ("ring", "counts", "current", "meta")}


def with_arch(arch):
    args = list(TINY_LM_ARGS)
    args[args.index("--arch") + 1] = arch
    return args


MODEL_CLASSES = {"transformer_lm": "TransformerLanguageModel", "transformer_lm_mlra_gpt": "TransformerLanguageModelMLRA"}


@pytest.mark.parametrize("extra,arch", [
    (["--criterion", "cross_entropy_agg", "--agg-window", "2", "--agg-alpha", "0.5"], "transformer_lm"),
    (["--criterion", "augmented_loss", "--aug-alpha", "0.1"], "transformer_lm"),
    (["--criterion", "cross_entropy_agg", "--agg-window", "2"], "transformer_lm_mlra_gpt"),
], ids=["agg", "augmented_loss", "agg_mlra"])
def test_two_ranks_stay_identical(lm_data_bin, tmp_path, extra, arch):
    rank0, rank1 = train_two_ranks(lm_data_bin, tmp_path, extra, arch)
    assert rank0["num_updates"] == rank1["num_updates"] == 3
    assert rank0["model"].keys() == rank1["model"].keys()
    for key in rank0["model"]:
        assert torch.equal(rank0["model"][key], rank1["model"][key]), key
    windows = [window_entries(rank0), window_entries(rank1)]
    if "cross_entropy_agg" in extra:
        assert windows[0] and windows[0].keys() == windows[1].keys()
        for key in windows[0]:
            assert torch.equal(windows[0][key], windows[1][key]), key


def test_local_counts_differ_between_ranks(lm_data_bin, tmp_path):
    rank0, rank1 = train_two_ranks(lm_data_bin, tmp_path, ["--criterion", "cross_entropy_agg", "--agg-window", "2",
                                                           "--agg-local-counts"])
    counts = [next(v for k, v in window_entries(s).items() if k.endswith("counts")) for s in (rank0, rank1)]
    assert not torch.equal(counts[0], counts[1])
