"""Two real fairseq-train processes (gloo, CPU, launched by hand): identical AGG windows, bit-equal
parameters on both ranks; --agg-local-counts gives each rank its own window. Two processes started
as torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; fairseq initialises
env://) count and update as one process that sees the same samples."""
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from fairseq_runs import TINY_LM_ARGS, USER_DIR, run_cli
from synthetic_text import markov_sentences, write_lines

# fairseq writes checkpoints on rank 0 only: each rank dumps its own trainer state when
# fairseq_cli.train.cli_main returns (the real training loop, unchanged), with the parameters it
# started from.
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
        self.initial_model = {k: v.detach().cpu().clone() for k, v in self.get_model().state_dict().items()}
        trainers.append(self)

    Trainer.__init__ = init

    def dump():
        trainer = trainers[0]
        torch.save({"model": {k: v.detach().cpu() for k, v in trainer.get_model().state_dict().items()},
                    "initial_model": trainer.initial_model,
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


# ---------------------------------------------------------------- launched as torchrun launches

# fairseq-fixed takes env:// from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, but sets the device
# to RANK % torch.cuda.device_count(), which divides by zero on a CPU. Under --cpu the device id is
# never used, so the ranks' processes give that one computation a count of 1; everything else
# (reading the variables, env://, no spawning, init_process_group) is fairseq's own path.
CPU_ENV_LAUNCH = textwrap.dedent("""
    import torch
    from fairseq.distributed import utils as distributed_utils

    launch_init = distributed_utils._infer_torch_distributed_launch_init

    def cpu_launch_init(cfg):
        cuda_device_count = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            launch_init(cfg)
        finally:
            torch.cuda.device_count = cuda_device_count

    distributed_utils._infer_torch_distributed_launch_init = cpu_launch_init
""")


@pytest.fixture(scope="module")
def eight_blocks(tmp_path_factory):
    """A data-bin of exactly 8 training samples of 64 tokens (8 lines of 63 words + eos each, with
    --sample-break-mode none), so that batches of 2 samples are never short and every update sees 4."""
    root = tmp_path_factory.mktemp("eight_blocks")
    words = " ".join(markov_sentences(200, n_words=60, seed=3)).split()
    write_lines(str(root / "train.txt"), [" ".join(words[i * 63:(i + 1) * 63]) for i in range(8)])
    write_lines(str(root / "valid.txt"), [" ".join(words[600:663])])
    run_cli("fairseq-preprocess", ["--only-source", "--trainpref", root / "train.txt", "--validpref",
                                   root / "valid.txt", "--destdir", root / "bin", "--workers", "1"])
    return str(root / "bin")


# plain SGD at a fixed rate: an update is -lr x the gradient, nothing else (no momentum, no decay)
EXACT_STEP_LM = ["--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "1",
                 "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2",
                 "--share-decoder-input-output-embed", "--tokens-per-sample", "64", "--sample-break-mode", "none",
                 "--max-tokens", "4096", "--required-batch-size-multiple", "1", "--optimizer", "sgd", "--lr", "0.5",
                 "--lr-scheduler", "fixed", "--dropout", "0", "--seed", "1", "--cpu", "--num-workers", "0",
                 "--no-save", "--disable-validation", "--max-update", "4", "--log-interval", "1", "--no-progress-bar"]
# (fairseq-train makes its --save-dir, ./checkpoints, even with --no-save: the runs start in tmp_path)


def train_env_ranks(data, tmp_path, extra):
    """Two ranks started as torchrun starts them: no --distributed-init-method, no --distributed-rank."""
    script = tmp_path / "env_rank_state.py"
    script.write_text(CPU_ENV_LAUNCH + RANK_STATE_DUMPER)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"env_rank{rank}.pt"), data, "--user-dir", USER_DIR]
            + EXACT_STEP_LM + extra + ["--distributed-world-size", "2", "--distributed-backend", "gloo",
                                       "--ddp-backend", "legacy_ddp"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    assert "distributed init (rank 0): env://" in outputs[0], outputs[0][-4000:]
    return [torch.load(tmp_path / f"env_rank{r}.pt", weights_only=False) for r in range(2)]


def train_one_process(data, tmp_path, name, extra):
    script = tmp_path / "rank_state.py"
    script.write_text(RANK_STATE_DUMPER)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / f"{name}.pt"), data, "--user-dir", USER_DIR]
                          + EXACT_STEP_LM + extra, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


def parameter_change(state):
    """Every floating parameter's change over the run, as one vector."""
    return torch.cat([(state["model"][k] - state["initial_model"][k]).reshape(-1) for k in state["model"]
                      if state["model"][k].is_floating_point()])


def assert_same_run_on_both_ranks(rank0, rank1):
    assert rank0["num_updates"] == rank1["num_updates"] == 4
    for key in rank0["model"]:
        assert torch.equal(rank0["model"][key], rank1["model"][key]), key
    windows = [window_entries(rank0), window_entries(rank1)]
    assert windows[0] and windows[0].keys() == windows[1].keys()
    for key in windows[0]:
        assert torch.equal(windows[0][key], windows[1][key]), key


def assert_same_window(state, reference):
    """Bit-equal AGG windows: the ring holds one histogram per update, so equal rings mean that
    every update counted the same targets."""
    ours, theirs = window_entries(state), window_entries(reference)
    assert ours.keys() == theirs.keys() and any(k.endswith("ring") for k in ours)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


# Float32 summation order (2 ranks' gradients summed by gloo vs one batch summed by the matmuls)
# changes the parameter changes by a few float32 ulps: 4e-7 of their norm was measured; a 25x margin.
SUMMATION_ORDER = 1e-5

# per-update counting with alpha 0.9 on 256 target tokens per update: types seen less than 0.9
# times per update are rare, so the gates g1 = a_k < 1 and g2 act on a real share of the vocabulary
AGG_GATING = ["--criterion", "cross_entropy_agg", "--agg-threshold-mode", "per-update", "--agg-alpha", "0.9",
              "--agg-window", "4"]


def test_env_ranks_match_one_process_that_sees_the_same_samples(eight_blocks, tmp_path):
    """AGG, counts summed over ranks at every micro-batch: two env:// ranks with 2 samples each equal
    one process with the same 4 samples in one batch, gates included.

    Which samples an update sees: fairseq shuffles the epoch's batches, then rank r takes batches
    r, r + W, ...; --update-freq 2 takes batches 2u and 2u + 1. Both give update u the same two
    batches of 2. --batch-size 4 forms other batches from the same order, so the batches are not
    shuffled here (--curriculum: every epoch in the dataset's order), which makes update u's four
    samples the same in all three runs. Against --update-freq 2 the windows are bit-equal but the
    parameters are not meant to be: AGG gates each micro-batch with the counts of the update so far,
    so that run gates its first micro-batch with half the update's counts; one rank's micro-batch
    already holds both ranks' counts, as the one batch of 4 does."""
    ordered = ["--curriculum", "100"]
    rank0, rank1 = train_env_ranks(eight_blocks, tmp_path, AGG_GATING + ordered + ["--batch-size", "2"])
    assert_same_run_on_both_ranks(rank0, rank1)
    one_batch = train_one_process(eight_blocks, tmp_path, "batch4", AGG_GATING + ordered + ["--batch-size", "4"])
    accumulated = train_one_process(eight_blocks, tmp_path, "freq2", AGG_GATING + ordered + ["--batch-size", "2",
                                                                                            "--update-freq", "2"])
    assert_same_window(rank0, one_batch)
    assert_same_window(rank0, accumulated)
    for key in rank0["initial_model"]:  # the same start: fairseq seeds every rank alike
        assert torch.equal(rank0["initial_model"][key], one_batch["initial_model"][key]), key
    change, reference = parameter_change(rank0), parameter_change(one_batch)
    assert (change - reference).norm() <= SUMMATION_ORDER * reference.norm()
    # the comparison resolves gating: gates from half an update's counts move the parameters by far more
    assert (parameter_change(accumulated) - reference).norm() > 100 * SUMMATION_ORDER * reference.norm()


def test_env_ranks_shard_like_update_freq(eight_blocks, tmp_path):
    """With fairseq's shuffled batches (two epochs, two orders), two env:// ranks count exactly what
    one process with --update-freq 2 counts, update by update, and train to the same parameters.
    The gradient here does not depend on the counts of the update so far (rare-token freezing of
    the static bottom 20 % of the dictionary), so accumulation and data parallelism must agree."""
    freezing = ["--criterion", "cross_entropy_agg", "--agg-window", "4", "--agg-freeze-rare", "--agg-freeze-set",
                "group"]
    rank0, rank1 = train_env_ranks(eight_blocks, tmp_path, freezing + ["--batch-size", "2"])
    assert_same_run_on_both_ranks(rank0, rank1)
    accumulated = train_one_process(eight_blocks, tmp_path, "freq2", freezing + ["--batch-size", "2",
                                                                                "--update-freq", "2"])
    assert_same_window(rank0, accumulated)
    change, reference = parameter_change(rank0), parameter_change(accumulated)
    assert (change - reference).norm() <= SUMMATION_ORDER * reference.norm()
