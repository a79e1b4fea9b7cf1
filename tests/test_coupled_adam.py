"""Coupled Adam (``--optimizer coupled_adam``, docs/coupled_adam.md).

* the torch optimizer: with nothing coupled it is fairseq's Adam bit for bit (fp32 and fp16
  parameters); a coupled matrix follows a hand-written reference of the formula over several
  steps; a matrix inside a flat parameter (fairseq's ``--fp16`` layout) is coupled like a
  separate one; other parameters get Adam's update;
* the fairseq optimizer: which tensors fairseq's Trainer hands over are the embedding matrices
  (tied, untied with each choice, MT with shared embeddings, the MLRA architectures, the fp16
  layouts), built in-process;
* real fairseq-train runs: LM with AGG (each update checked against the formula from the saved
  optimizer state, resume bit-equal, --reset-optimizer and a switch to adam), MT with
  --share-all-embeddings, AGG and the embedding statistics, two gloo processes bit-equal to one
  process on the same batches, and the start-up errors;
* the LM demo's ``coupled-adam`` method.
"""
import math
import os

import pytest
import torch
from fairseq.optim.adam import Adam as FairseqTorchAdam

from fairseq_agg.optim import CoupledAdam, CoupledBlock
import in_process
from fairseq_runs import TINY_LM_ARGS, TINY_MT_ARGS, USER_DIR, build_parts, read_json_log, run_cli

LR, BETAS, EPS, WD = 0.01, (0.9, 0.98), 1e-6, 0.1

# --- the torch optimizer ----------------------------------------------------------------------


def random_grads(params, steps, seed=0):
    """Per step, one gradient per parameter; the embedding-like first parameter gets rows of very
    different scale (frequent and rare tokens), which is where coupling matters."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]
        rows = grads[0].shape[0]
        grads[0] = grads[0] * torch.logspace(0, -3, rows).to(grads[0].dtype).unsqueeze(1)
        out.append(grads)
    return out


def run(optimizer_cls, params, grads, **kwargs):
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    coupled = [params[i] for i in kwargs.pop("coupled_indices", ())]
    if coupled:
        kwargs["coupled"] = coupled
    undecayed = [params[i] for i in kwargs.pop("undecayed_indices", ())]
    if undecayed:
        kwargs["undecayed"] = undecayed
    opt = optimizer_cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kwargs)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


def start_params(dtype=torch.float32, rows=12):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 6, generator=gen).to(dtype), torch.randn(5, 6, generator=gen).to(dtype),
            torch.randn(6, generator=gen).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_uncoupled_is_fairseqs_adam_bit_for_bit(dtype):
    params = start_params(dtype)
    grads = random_grads(params, 6)
    ours, opt = run(CoupledAdam, params, grads)
    theirs, ref = run(FairseqTorchAdam, params, grads)
    for a, b in zip(ours, theirs):
        assert a.dtype == dtype and torch.equal(a, b)
    for p, q in zip(ours, theirs):  # the state has fairseq adam's keys, values and fp32 dtype
        assert opt.state[p].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert opt.state[p]["step"] == ref.state[q]["step"] == 6
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
        assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_one_row_with_scale_one_is_adam():
    # the mean over a single row is the row itself
    params = start_params(rows=1)
    grads = random_grads(params, 5)
    ours, _ = run(CoupledAdam, params, grads, coupled_indices=[0])
    theirs, _ = run(FairseqTorchAdam, params, grads)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def reference_coupled_adam(w, grads, scale, steps):
    """The formula of docs/coupled_adam.md in float64, written out step by step."""
    w, m, v = w.double().clone(), torch.zeros_like(w, dtype=torch.float64), torch.zeros_like(w, dtype=torch.float64)
    b1, b2 = BETAS
    for t in range(1, steps + 1):
        g = grads[t - 1].double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        v_bar = scale * v_hat.mean(dim=0, keepdim=True)  # one value per dimension j
        w = w - LR * WD * w
        w = w - LR * m_hat / (v_bar.sqrt() + EPS / math.sqrt(1 - b2 ** t))
    return w


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_coupled_matrix_follows_the_formula_and_others_get_adams_update(scale):
    params = start_params()
    steps = 5
    grads = random_grads(params, steps)
    ours, _ = run(CoupledAdam, params, grads, coupled_indices=[0], coupling_scale=scale)
    expected = reference_coupled_adam(params[0], [g[0] for g in grads], scale, steps)
    torch.testing.assert_close(ours[0].double(), expected, rtol=0, atol=1e-6)
    adam, _ = run(FairseqTorchAdam, params, grads)
    assert (ours[0] - adam[0]).abs().max() > 1e-3  # coupling changed the embedding's steps ...
    assert torch.equal(ours[1], adam[1]) and torch.equal(ours[2], adam[2])  # ... and nothing else


def test_matrix_inside_a_flat_parameter_is_coupled_like_a_separate_one():
    params = start_params()
    grads = random_grads(params, 4)
    separate, _ = run(CoupledAdam, params, grads, coupled_indices=[0])
    flat = run_in_flat_parameter(params, grads, lambda matrix, bias: {"coupled": [matrix]})
    for i in range(3):
        assert torch.equal(flat[i], separate[i].detach()), i


def run_in_flat_parameter(params, grads, blocks):
    """``run`` with ``params`` in fairseq's --fp16 layout, one flat fp32 tensor, here
    [bias | matrix | weight]; ``blocks(matrix, bias)``, given those two as (flat, CoupledBlock),
    returns the optimizer's block arguments. The parameters afterwards, in ``params``' order."""
    order = [2, 0, 1]
    flat = torch.nn.Parameter(torch.cat([params[i].reshape(-1) for i in order]))
    matrix = (flat, CoupledBlock(params[2].numel(), *params[0].shape))
    bias = (flat, CoupledBlock(0, params[2].numel(), 1))
    opt = CoupledAdam([flat], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **blocks(matrix, bias))
    for step_grads in grads:
        flat.grad = torch.cat([step_grads[i].reshape(-1) for i in order])
        opt.step()
    pieces = dict(zip(order, torch.split(flat.detach(), [params[i].numel() for i in order])))
    return [pieces[i].view(params[i].shape) for i in range(len(params))]


def test_undecayed_tensors_are_left_as_torchs_parameter_groups_leave_them():
    """The authors' setting: the embedding and the 1-D parameter undecayed, the other matrix decayed;
    as a separate parameter and as a block of a flat one, bit-equal to torch's parameter groups."""
    params = start_params()
    grads = random_grads(params, 4)
    grouped = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = CoupledAdam([{"params": [grouped[1]]}, {"params": [grouped[0], grouped[2]], "weight_decay": 0.0}],
                      lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, coupled=[grouped[0]])
    for step_grads in grads:
        for p, g in zip(grouped, step_grads):
            p.grad = g.clone()
        opt.step()
    separate, _ = run(CoupledAdam, params, grads, coupled_indices=[0], undecayed_indices=[0, 2])
    decayed_everywhere, _ = run(CoupledAdam, params, grads, coupled_indices=[0])
    for i in range(3):
        assert torch.equal(separate[i], grouped[i]), i
    assert not torch.equal(separate[0], decayed_everywhere[0]) and torch.equal(separate[1], decayed_everywhere[1])
    flat = run_in_flat_parameter(params, grads, lambda matrix, bias: {"coupled": [matrix],
                                                                      "undecayed": [matrix, bias]})
    for i in range(3):
        assert torch.equal(flat[i], grouped[i].detach()), i


@pytest.mark.parametrize("case,message", [
    ("scale-zero", "coupling_scale"), ("scale-nan", "coupling_scale"), ("not-a-matrix", "2-D"),
    ("not-optimized", "optimized parameters"), ("beyond-the-parameter", "does not lie"),
    ("undecayed-not-optimized", "optimized parameters"), ("undecayed-beyond", "does not lie"),
])
def test_torch_optimizer_refuses_bad_arguments(case, message):
    params = [torch.nn.Parameter(t) for t in start_params()]
    kwargs = {
        "scale-zero": {"coupling_scale": 0.0},
        "scale-nan": {"coupling_scale": float("nan")},
        "not-a-matrix": {"coupled": [params[2]]},
        "not-optimized": {"coupled": [torch.nn.Parameter(torch.zeros(3, 3))]},
        "beyond-the-parameter": {"coupled": [(params[1], CoupledBlock(6, 5, 6))]},
        "undecayed-not-optimized": {"undecayed": [torch.nn.Parameter(torch.zeros(3))]},
        "undecayed-beyond": {"undecayed": [(params[2], CoupledBlock(4, 3, 1))]},
    }[case]
    with pytest.raises(ValueError, match=message):
        CoupledAdam(params, **kwargs)


# --- the fairseq optimizer, built by fairseq's Trainer in-process -------------------------------

UNTIE = "--share-decoder-input-output-embed"


def built_optimizer(data, base, extra):
    """(model, the torch CoupledAdam, fairseq's optimizer) as fairseq's Trainer builds them."""
    from fairseq.trainer import Trainer

    cfg, task, model, criterion = build_parts(data, base, ["--optimizer", "coupled_adam"] + extra, splits=())
    trainer = Trainer(cfg, task, model, criterion)
    return trainer.get_model(), trainer.optimizer.optimizer, trainer.optimizer


def coupled_names(model, opt):
    """The names of the model parameters that are coupled as a whole tensor."""
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names[id(p)] for p in opt.coupled_blocks)


def lm_args(tied=True, arch="transformer_lm"):
    args = [a for a in TINY_LM_ARGS if tied or a != UNTIE]
    args[args.index("--arch") + 1] = arch
    return args


def mt_args(arch="transformer"):
    args = list(TINY_MT_ARGS)
    args[args.index("--arch") + 1] = arch
    return args


@pytest.mark.parametrize("arch", ["transformer_lm", "transformer_lm_mlra_gpt"])
def test_tied_lm_couples_its_one_matrix(lm_data_bin, arch):
    model, opt, _ = built_optimizer(lm_data_bin, lm_args(arch=arch), [])
    assert coupled_names(model, opt) == ["decoder.embed_tokens.weight"]
    assert opt.coupled_blocks[model.decoder.embed_tokens.weight] == [
        CoupledBlock(0, *model.decoder.embed_tokens.weight.shape)]


@pytest.mark.parametrize("which,expected", [
    ("all", ["decoder.embed_tokens.weight", "decoder.output_projection.weight"]),
    ("input", ["decoder.embed_tokens.weight"]),
    ("output", ["decoder.output_projection.weight"]),
])
def test_untied_lm_couples_the_chosen_matrices(lm_data_bin, which, expected):
    model, opt, _ = built_optimizer(lm_data_bin, lm_args(tied=False), ["--coupled-adam-matrices", which])
    assert coupled_names(model, opt) == expected


@pytest.mark.parametrize("arch", ["transformer", "transformer_mlra"])
def test_mt_with_shared_embeddings_couples_the_one_matrix(mt_data_bin, arch):
    model, opt, _ = built_optimizer(mt_data_bin, mt_args(arch), ["--coupled-adam-matrices", "output"])
    assert model.encoder.embed_tokens.weight is model.decoder.output_projection.weight
    assert coupled_names(model, opt) == ["encoder.embed_tokens.weight"]


def test_fp16_layouts_couple_the_embedding_rows(lm_data_bin, monkeypatch):
    """Built on the CPU: the layouts fairseq's fp16 wrappers hand over, not fp16 arithmetic."""
    # --memory-efficient-fp16: the model's own fp16 tensor
    model, opt, wrapper = built_optimizer(lm_data_bin, lm_args(), ["--memory-efficient-fp16"])
    assert type(wrapper).__name__ == "MemoryEfficientFP16Optimizer"
    embedding = model.decoder.embed_tokens.weight
    assert embedding.dtype == torch.float16 and list(opt.coupled_blocks) == [embedding]
    # --fp16 --fp16-no-flatten-grads: its fp32 copy
    model, opt, wrapper = built_optimizer(lm_data_bin, lm_args(), ["--fp16", "--fp16-no-flatten-grads"])
    assert type(wrapper).__name__ == "FP16Optimizer"
    ((copy, blocks),) = opt.coupled_blocks.items()
    embedding = model.decoder.embed_tokens.weight
    assert copy is not embedding and copy.dtype == torch.float32 and torch.equal(copy, embedding.float())
    # --fp16: slices of fairseq's one flat fp32 tensor (which asks CUDA for its device only); untied,
    # so that the output projection lies at an offset
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    model, opt, wrapper = built_optimizer(lm_data_bin, lm_args(tied=False), ["--fp16"])
    ((flat, blocks),) = opt.coupled_blocks.items()
    assert flat.dim() == 1 and flat.numel() == sum(p.numel() for p in model.parameters())
    matrices = [model.decoder.embed_tokens.weight, model.decoder.output_projection.weight]
    assert [b.offset > 0 for b in blocks] == [False, True]
    for block, matrix in zip(blocks, matrices):
        assert torch.equal(block.view(flat), matrix.float())


def undecayed_names(model, opt):
    """The names of the model parameters whose blocks weight decay skips, by position: the
    optimizer's tensors are the model's trainable parameters in order (or their fp32 copies), or
    under --fp16 one flat tensor that concatenates them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    tensors = [t for group in opt.param_groups for t in group["params"]]
    found = []
    if len(tensors) == 1 < len(named):
        starts, offset = {}, 0
        for name, p in named:
            starts[(offset, p.numel())] = name
            offset += p.numel()
        found = [starts[(b.offset, b.rows * b.cols)] for b in opt.undecayed_blocks.get(tensors[0], ())]
    else:
        index = {id(t): i for i, t in enumerate(tensors)}
        for tensor, blocks in opt.undecayed_blocks.items():
            name, p = named[index[id(tensor)]]
            assert [(b.offset, b.rows * b.cols) for b in blocks] == [(0, p.numel())], name
            found.append(name)
    return sorted(found)


def test_authors_decay_setting_skips_the_coupled_matrix_and_the_1d_parameters(lm_data_bin, monkeypatch):
    model, opt, _ = built_optimizer(lm_data_bin, lm_args(), [])
    assert opt.undecayed_blocks == {}  # the default: --weight-decay reaches every parameter
    expected = sorted(["decoder.embed_tokens.weight"] + [n for n, p in model.named_parameters() if p.dim() == 1])
    assert len(expected) > 10
    for extra in ([], ["--fp16-no-flatten-grads", "--fp16"], ["--fp16"]):
        if extra == ["--fp16"]:  # one flat fp32 tensor (which asks CUDA for its device only)
            monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        model, opt, _ = built_optimizer(lm_data_bin, lm_args(), ["--coupled-adam-decay", "non-embedding-matrices"]
                                        + extra)
        assert undecayed_names(model, opt) == expected, extra
        assert all(p.dim() == 1 for p in opt.undecayed_blocks) == (extra == ["--fp16"])


def test_outside_fairseqs_trainer_it_is_a_usage_error(lm_data_bin):
    from fairseq_agg.errors import UsageError
    from fairseq_agg.optim.fairseq_coupled_adam import CoupledAdamConfig, FairseqCoupledAdam

    with pytest.raises(UsageError, match="Trainer"):
        FairseqCoupledAdam(CoupledAdamConfig(lr=[0.001]), [torch.nn.Parameter(torch.zeros(4, 3))])


# --- real fairseq-train runs ---------------------------------------------------------------------

def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


LM_COUPLED = ["--optimizer", "coupled_adam", "--weight-decay", "0.01", "--criterion", "cross_entropy_agg",
              "--agg-alpha", "0.03", "--required-batch-size-multiple", "1", "--log-format", "json"]


def lm_train(data, save_dir, max_update, extra=()):
    return run_cli("fairseq-train", [data, "--user-dir", USER_DIR] + TINY_LM_ARGS + LM_COUPLED + [
        "--max-update", max_update, "--save-dir", save_dir, "--save-interval-updates", "1",
        "--no-epoch-checkpoints"] + list(extra))


@pytest.fixture(scope="module")
def lm_runs(lm_data_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("coupled_lm")
    dirs = {name: str(root / name) for name in ("straight", "resumed", "reset", "authors_decay")}
    straight = lm_train(lm_data_bin, dirs["straight"], 4)
    # a weight decay large enough that its step (lr x wd x w) is far above the formula check's tolerance
    authors_decay = lm_train(lm_data_bin, dirs["authors_decay"], 3, ["--coupled-adam-decay", "non-embedding-matrices",
                                                                     "--weight-decay", "0.5"])
    lm_train(lm_data_bin, dirs["resumed"], 2)
    resumed = lm_train(lm_data_bin, dirs["resumed"], 4)
    reset = lm_train(lm_data_bin, dirs["reset"], 3, [
        "--restore-file", os.path.join(dirs["straight"], "checkpoint_1_2.pt"), "--reset-optimizer",
        "--optimizer", "adam"])
    return {"dirs": dirs, "straight": straight, "resumed": resumed, "reset": reset, "authors_decay": authors_decay}


def test_lm_run_with_agg_couples_the_tied_matrix_and_each_update_follows_the_formula(lm_runs, lm_data_bin):
    out = lm_runs["straight"].stdout + lm_runs["straight"].stderr
    assert "coupled_adam: the " in out and "decoder.embed_tokens.weight = decoder.output_projection.weight" in out
    assert "agg_rare" in out  # AGG ran
    embedding, other = "decoder.embed_tokens.weight", "decoder.layers.0.fc1.weight"
    assert_updates_follow_formula(lm_runs["dirs"]["straight"], lm_data_bin, 4,
                                  {embedding: (True, True), other: (False, True)})


def test_lm_run_in_the_authors_decay_setting_decays_only_the_other_matrices(lm_runs, lm_data_bin):
    out = lm_runs["authors_decay"].stdout + lm_runs["authors_decay"].stderr
    assert "weight decay skips the coupled matrices and" in out
    # {name: (coupled, decayed)}: the tied embedding and a bias undecayed, the other matrix decayed
    assert_updates_follow_formula(lm_runs["dirs"]["authors_decay"], lm_data_bin, 3, {
        "decoder.embed_tokens.weight": (True, False), "decoder.layers.0.fc1.bias": (False, False),
        "decoder.layers.0.self_attn_layer_norm.weight": (False, False),
        "decoder.layers.0.fc1.weight": (False, True)})


def assert_updates_follow_formula(save_dir, data, last_update, expected):
    """Each update k -> k + 1 of the run in ``save_dir`` (checkpoint_1_K.pt) moved each parameter of
    ``expected`` ({name: (coupled, decayed)}) as Coupled Adam's formula says, from the saved state."""
    # the optimizer state is indexed like the Trainer's parameter list: the model's, then the criterion's
    _, _, model, _ = build_parts(data, TINY_LM_ARGS, [], splits=())  # the same model
    index = {name: i for i, (name, p) in enumerate(model.named_parameters()) if p.requires_grad}
    for k in range(1, last_update):
        before = load(os.path.join(save_dir, f"checkpoint_1_{k}.pt"))
        after = load(os.path.join(save_dir, f"checkpoint_1_{k + 1}.pt"))
        group = before["last_optimizer_state"]["param_groups"][0]  # the lr of update k + 1
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        assert wd > 0
        for name, (coupled, decayed) in expected.items():
            state = after["last_optimizer_state"]["state"][index[name]]
            t, m, v = state["step"], state["exp_avg"].double(), state["exp_avg_sq"].double()
            assert t == k + 1
            v_hat = v / (1 - b2 ** t)
            if coupled:
                v_hat = v_hat.mean(dim=0, keepdim=True)
            w = before["model"][name].double()
            decay = lr * wd * w if decayed else 0
            expected_w = w - decay - lr * (m / (1 - b1 ** t)) / (v_hat.sqrt() + eps / math.sqrt(1 - b2 ** t))
            torch.testing.assert_close(after["model"][name].double(), expected_w, rtol=0, atol=1e-6)
        assert after["optimizer_history"][-1]["optimizer_name"] == "FairseqCoupledAdam"


def test_lm_resume_is_bit_equal(lm_runs):
    resumed_updates = [r["num_updates"] for r in read_train_inner(lm_runs["resumed"])]
    assert resumed_updates == ["3", "4"]  # it really resumed
    straight = load(os.path.join(lm_runs["dirs"]["straight"], "checkpoint_last.pt"))
    resumed = load(os.path.join(lm_runs["dirs"]["resumed"], "checkpoint_last.pt"))
    assert straight["model"].keys() == resumed["model"].keys()
    for key, value in straight["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    states = [c["last_optimizer_state"]["state"] for c in (straight, resumed)]
    assert states[0].keys() == states[1].keys()
    for i, state in states[0].items():
        assert state["step"] == states[1][i]["step"] == 4
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], states[1][i][key]), (i, key)


def test_reset_optimizer_switches_a_coupled_adam_checkpoint_to_adam(lm_runs):
    ckpt = load(os.path.join(lm_runs["dirs"]["reset"], "checkpoint_last.pt"))
    assert ckpt["optimizer_history"][-1]["optimizer_name"] == "FairseqAdam"
    # fairseq restarts the update count with the optimizer: 3 updates, all counted by a fresh state
    assert ckpt["optimizer_history"][-1]["num_updates"] == 3
    assert {s["step"] for s in ckpt["last_optimizer_state"]["state"].values()} == {3}


def read_train_inner(proc):
    return [r for r in read_json_log(proc.stdout + proc.stderr) if "num_updates" in r and "loss" in r]


def test_mt_with_shared_embeddings_agg_and_statistics_trains(mt_data_bin, tmp_path):
    save_dir = str(tmp_path / "mt")
    proc = run_cli("fairseq-train", [mt_data_bin, "--user-dir", USER_DIR] + TINY_MT_ARGS + [
        "--optimizer", "coupled_adam", "--coupled-adam-scale", "2", "--criterion", "cross_entropy_agg",
        "--label-smoothing", "0.1", "--agg-alpha", "0.08", "--embed-stats-interval", "3", "--max-update", "6",
        "--save-dir", save_dir, "--no-epoch-checkpoints", "--log-format", "json"])
    out = proc.stdout + proc.stderr
    assert "encoder.embed_tokens.weight = decoder.embed_tokens.weight = decoder.output_projection.weight" in out
    assert "scale 2" in out
    records = read_train_inner(proc)
    assert [int(r["num_updates"]) for r in records] == list(range(1, 7))
    assert all(math.isfinite(float(r["loss"])) for r in records) and "agg_rare" in records[-1]
    assert {"tev_mu", "mean_cos"} <= records[-1].keys()  # the embedding statistics of update 6
    assert load(os.path.join(save_dir, "checkpoint_last.pt"))["cfg"]["optimizer"]["_name"] == "coupled_adam"


def test_two_gloo_processes_equal_one_process_on_the_same_batches(lm_data_bin, tmp_path, monkeypatch):
    from test_distributed import train_two_ranks  # the two-rank launcher of the DDP tests (--max-update 3)

    extra = ["--optimizer", "coupled_adam", "--weight-decay", "0.01"]
    rank0, rank1 = train_two_ranks(lm_data_bin, tmp_path, extra)
    # one process with --update-freq 2 takes rank 0's and rank 1's batch of each update
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the two ranks, so that the kernels sum alike
    save_dir = str(tmp_path / "single")
    run_cli("fairseq-train", [lm_data_bin, "--user-dir", USER_DIR] + TINY_LM_ARGS + extra + [
        "--update-freq", "2", "--max-update", "3", "--save-dir", save_dir, "--no-epoch-checkpoints"])
    single = load(os.path.join(save_dir, "checkpoint_last.pt"))["model"]
    assert rank0["num_updates"] == 3
    for key, value in single.items():
        assert torch.equal(rank0["model"][key], rank1["model"][key]), key
        assert torch.equal(rank0["model"][key], value), key


ADAPTIVE_SOFTMAX = ["--adaptive-softmax-cutoff", "50,100"]
REFUSED = [  # (case id, extra flags, untied, text the error must name)
    ("scale-zero", ["--coupled-adam-scale", "0"], False, "--coupled-adam-scale"),
    ("scale-negative", ["--coupled-adam-scale", "-1"], False, "--coupled-adam-scale"),
    ("scale-nan", ["--coupled-adam-scale", "nan"], False, "--coupled-adam-scale"),
    ("scale-inf", ["--coupled-adam-scale", "inf"], False, "--coupled-adam-scale"),
    ("matrices-unknown", ["--coupled-adam-matrices", "both"], False, "--coupled-adam-matrices"),
    ("decay-unknown", ["--coupled-adam-decay", "none"], False, "--coupled-adam-decay"),
    ("no-output-matrix", ADAPTIVE_SOFTMAX + ["--coupled-adam-matrices", "output"], True, "--coupled-adam-matrices"),
    ("no-matrix-at-all", ADAPTIVE_SOFTMAX + ["--adaptive-input", "--adaptive-input-cutoff", "50,100"], True,
     "--coupled-adam-matrices"),
]


@pytest.mark.parametrize("extra,untied,expected", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_values_are_refused_at_start_up(lm_data_bin, tmp_path, extra, untied, expected):
    save_dir = str(tmp_path / "ckpt")
    args = [lm_data_bin, "--user-dir", USER_DIR] + lm_args(tied=not untied) + [
        "--optimizer", "coupled_adam", "--max-update", "2", "--save-dir", save_dir] + extra
    # fairseq-train's entry point in this process (tests/support/in_process.py; the channel runs as
    # a real process in tests/test_bad_inputs.py)
    proc = in_process.fairseq_train(args[:])
    # exit status 2 and one line naming the flag: argparse's, or the plugin's report of its UsageError
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-train: error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not os.path.isdir(save_dir) or os.listdir(save_dir) == []


# --- the LM demo ---------------------------------------------------------------------------------

def test_demo_offers_coupled_adam_on_request(lm_data_bin, tmp_path):
    from fairseq import options

    from examples.lm_demo import run as demo_run
    from study.harness.fairseq_commands import registered_methods

    assert "coupled-adam" in demo_run.METHODS and "coupled-adam" not in demo_run.DEFAULT_METHODS
    assert registered_methods({"coupled-adam": demo_run.METHODS["coupled-adam"]}) == {"coupled-adam": None}
    cmd = demo_run.DEMO.train_command("coupled-adam", lm_data_bin, str(tmp_path), 1, "quick", 10, True)
    args = options.parse_args_and_arch(options.get_training_parser(), cmd[1:])
    # the demo's adam settings, with coupled_adam as the optimizer
    assert args.optimizer == "coupled_adam" and args.criterion == "cross_entropy"
    assert args.adam_betas == "(0.9, 0.98)" and args.weight_decay == 0.01
    # weight decay as Coupled Adam's authors run it: not on the embedding nor the 1-D parameters
    assert args.coupled_adam_decay == "non-embedding-matrices"
