"""The ``augmented_loss`` criterion inside real fairseq (Inan et al., ICLR 2017; docs/augmented_loss.md).

In process: real ``language_modeling`` / ``translation`` tasks on the tiny data-bins, real fairseq
transformer models, batches from fairseq's own iterators and collaters, and fairseq's stock
``cross_entropy`` / ``label_smoothed_cross_entropy`` criteria as the baseline.
End to end: real ``fairseq-train --user-dir`` runs (LM with tied embeddings = REAL, MT with shared
embeddings and label smoothing); the logged validation ``nll_loss`` of the final checkpoint is
compared to a stock ``fairseq-validate`` evaluation of the same weights.
"""
import math
import os

import pytest
import torch
from fairseq import metrics

from fairseq_agg.criterions.augmented_loss import AugmentedLossCriterion
from fairseq_agg.fairseq_facts.dictionary import never_real_ids
from reference_constructions import reference_output_loss, reference_teacher
from fairseq_runs import TINY_LM_ARGS, TINY_MT_ARGS, USER_DIR, build_parts, criterion_from_flags, non_pad_features
from fairseq_runs import read_json_log, run_cli

torch.set_num_threads(2)

LN2 = math.log(2)


criterion_for = criterion_from_flags


def first_batch(task, max_tokens=400):
    itr = task.get_batch_iterator(
        dataset=task.dataset("valid"), max_tokens=max_tokens, seed=1, epoch=1, num_workers=0
    ).next_epoch_itr(shuffle=False)
    return next(itr)


def padded_batch(task, size=10):
    """Sentences of different lengths, collated by the dataset's own collater (right-padded targets)."""
    dataset = task.dataset("valid")
    by_length = {}
    for i in range(len(dataset)):
        by_length.setdefault(int(dataset.tgt_sizes[i]), i)
    sample = dataset.collater([dataset[i] for i in list(by_length.values())[:size]])
    assert sample["target"].eq(task.target_dictionary.pad()).any()
    return sample


def loss_and_grads(model, criterion, sample):
    model.zero_grad(set_to_none=True)
    loss, sample_size, log = criterion(model, sample)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), sample_size, log, grads


def rel_err(a, b):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def assert_grads_close(got, want, tol):
    """Every parameter's gradient within tol, relative to the largest gradient entry of the model.

    (Per-tensor relative errors are meaningless for gradients that are analytically zero, such as
    the attention key biases, whose values are pure rounding noise.)
    """
    assert got.keys() == want.keys()
    scale = max(float(w.abs().max()) for w in want.values())
    worst = max((float((got[n] - want[n]).abs().max()) / scale, n) for n in want)
    assert worst[0] <= tol, worst


@pytest.fixture(scope="module")
def lm(lm_data_bin):
    _, task, model, criterion = build_parts(lm_data_bin, TINY_LM_ARGS, ["--criterion", "augmented_loss"], ("valid",))
    model.train()
    return lm_data_bin, task, model, criterion, first_batch(task)


@pytest.fixture(scope="module")
def mt(mt_data_bin):
    _, task, model, criterion = build_parts(mt_data_bin, TINY_MT_ARGS, ["--criterion", "augmented_loss"], ("valid",))
    model.train()
    return mt_data_bin, task, model, criterion, padded_batch(task)


# --------------------------------------------------------------------------------------------
# construction, defaults, bad input


def test_registered_with_the_documented_defaults(lm):
    _, _, _, criterion, _ = lm
    assert isinstance(criterion, AugmentedLossCriterion)
    cfg = criterion.cfg
    assert (cfg.aug_alpha, cfg.aug_temperature, cfg.aug_scale) == (0.5, 10.0, "tau")
    assert (cfg.aug_embed, cfg.aug_warmup_updates, cfg.aug_gate_with_agg) == ("input", 0, False)
    # the detached teacher and the masked columns are the defaults: see the reference and flag tests
    assert cfg.label_smoothing == 0.0 and cfg.output_chunk_tokens == 2048


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--aug-alpha", "-0.1"], "--aug-alpha must be >= 0, got -0.1"),
        (["--aug-temperature", "0"], "--aug-temperature must be > 0, got 0.0"),
        (["--aug-temperature", "-2"], "--aug-temperature must be > 0, got -2.0"),
        (["--output-chunk-tokens", "0"], "--output-chunk-tokens must be >= 1, got 0"),
        (["--aug-warmup-updates", "-1"], "--aug-warmup-updates must be >= 0, got -1"),
        (["--label-smoothing", "1.0"], "--label-smoothing must be in [0, 1), got 1.0"),
    ],
)
def test_bad_flags_rejected_at_construction(lm, flags, message):
    data, task, _, _, _ = lm
    with pytest.raises(ValueError) as err:
        criterion_for(task, data, TINY_LM_ARGS, ["--criterion", "augmented_loss"] + flags)
    assert message in str(err.value)


def test_chunk_size_flag_is_used_and_does_not_change_the_result(lm, monkeypatch):
    from fairseq_agg.ops import augmented

    data, task, model, criterion, sample = lm
    small = criterion_for(task, data, TINY_LM_ARGS, ["--criterion", "augmented_loss", "--output-chunk-tokens", "60"])
    fused, chunks = augmented.fused_linear_loss, []

    def recording(hidden, weight, target, request):
        chunks.append(request.chunk_size)
        return fused(hidden, weight, target, request)

    monkeypatch.setattr(augmented, "fused_linear_loss", recording)
    loss_a, _, log_a, grads_a = loss_and_grads(model, criterion, sample)
    loss_b, _, log_b, grads_b = loss_and_grads(model, small, sample)
    assert chunks == [2048, 60] and sample["ntokens"] > 60  # the small chunks really split the batch
    assert rel_err(loss_b, loss_a) <= 1e-6 and rel_err(log_b["aug_loss"], log_a["aug_loss"]) <= 1e-5
    assert_grads_close(grads_b, grads_a, 1e-5)


def test_adaptive_input_is_refused_in_process(lm_data_bin):
    """A decoder without a plain input embedding (adaptive input): clear error, nothing computed."""
    _, task, model, criterion = build_parts(
        lm_data_bin,
        TINY_LM_ARGS[:-1],  # untied: adaptive input cannot be tied to a plain output projection
        ["--criterion", "augmented_loss", "--adaptive-input", "--adaptive-input-cutoff", "20,100",
         "--adaptive-input-factor", "2"],
        ("valid",),
    )
    with pytest.raises(ValueError, match="--adaptive-input is not supported"):
        criterion(model, first_batch(task))


def criterion_or_none(task, data, flags):
    """The criterion, or None when argparse rejects the flags (a spelling that is not a flag at all)."""
    try:
        return criterion_for(task, data, TINY_LM_ARGS, ["--criterion", "augmented_loss"] + flags)
    except SystemExit:
        return None


def pad_teacher_mass(crit, model, task, sample):
    target = sample["target"].reshape(-1)
    target = target[target.ne(task.target_dictionary.pad())]
    return crit.augmented.teacher(model.decoder.embed_tokens.weight, target).probs[:, task.target_dictionary.pad()]


def test_mask_special_flag_spelling(lm):
    """Masking is the default; ``--no-aug-mask-special`` turns it off; the positive spelling never does."""
    data, task, model, criterion, sample = lm
    assert torch.all(pad_teacher_mass(criterion, model, task, sample) == 0)
    off = criterion_for(task, data, TINY_LM_ARGS, ["--criterion", "augmented_loss", "--no-aug-mask-special"])
    assert torch.all(pad_teacher_mass(off, model, task, sample) > 0)
    on = criterion_or_none(task, data, ["--aug-mask-special"])
    assert on is None or torch.all(pad_teacher_mass(on, model, task, sample) == 0)


def test_detach_flag_spelling(lm):
    """``--aug-detach-target`` (the natural "on" spelling) must never turn detaching *off*."""
    data, task, model, criterion, sample = lm
    explicit = criterion_or_none(task, data, ["--aug-detach-target"])
    if explicit is not None:
        loss_a, _, _, grads_a = loss_and_grads(model, criterion, sample)
        loss_b, _, _, grads_b = loss_and_grads(model, explicit, sample)
        assert float(loss_a) == float(loss_b)
        assert_grads_close(grads_b, grads_a, 0.0)


# --------------------------------------------------------------------------------------------
# α = 0 is fairseq's own (label-smoothed) cross-entropy


def test_alpha_zero_is_stock_cross_entropy_lm(lm):
    data, task, model, _, sample = lm
    ours = criterion_for(task, data, TINY_LM_ARGS, ["--criterion", "augmented_loss", "--aug-alpha", "0"])
    stock = criterion_for(task, data, TINY_LM_ARGS, ["--criterion", "cross_entropy"])
    loss, size, log, grads = loss_and_grads(model, ours, sample)
    s_loss, s_size, s_log, s_grads = loss_and_grads(model, stock, sample)
    assert size == s_size == sample["ntokens"] and log["ntokens"] == s_log["ntokens"]
    assert rel_err(loss, s_loss) <= 1e-6
    assert rel_err(log["nll_loss"], s_log["loss"]) <= 1e-6  # stock CE: loss is the summed NLL
    assert "aug_loss" not in log and "aug_alpha" not in log
    assert_grads_close(grads, s_grads, 1e-5)


def test_alpha_zero_is_stock_label_smoothed_ce_mt(mt):
    data, task, model, _, sample = mt
    ours = criterion_for(
        task, data, TINY_MT_ARGS, ["--criterion", "augmented_loss", "--aug-alpha", "0", "--label-smoothing", "0.1"]
    )
    stock = criterion_for(
        task, data, TINY_MT_ARGS, ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]
    )
    loss, size, log, grads = loss_and_grads(model, ours, sample)
    s_loss, s_size, s_log, s_grads = loss_and_grads(model, stock, sample)
    assert size == s_size and log["ntokens"] == s_log["ntokens"] and log["nsentences"] == s_log["nsentences"]
    assert rel_err(loss, s_loss) <= 1e-6
    assert rel_err(log["nll_loss"], s_log["nll_loss"]) <= 1e-6
    assert "aug_loss" not in log
    assert_grads_close(grads, s_grads, 1e-5)


# --------------------------------------------------------------------------------------------
# the augmented loss at criterion level


def test_criterion_matches_reference_on_the_real_model(mt):
    """Full model gradients vs the direct reference (materialised teacher), label smoothing, shared embeddings."""
    data, task, model, _, sample = mt
    tau, alpha = 2.0, 0.5
    crit = criterion_for(
        task, data, TINY_MT_ARGS,
        ["--criterion", "augmented_loss", "--label-smoothing", "0.1", "--aug-temperature", str(tau),
         "--aug-alpha", str(alpha), "--output-chunk-tokens", "16"],
    )
    loss, size, log, grads = loss_and_grads(model, crit, sample)

    model.zero_grad(set_to_none=True)
    hidden, target = non_pad_features(model, sample, task.target_dictionary.pad())
    weight = model.decoder.output_projection.weight
    assert weight is model.decoder.embed_tokens.weight  # --share-all-embeddings: REAL
    probs = reference_teacher(model.decoder.embed_tokens.weight, target, tau, never_real_ids(task.target_dictionary))
    ref_loss, ref_nll, ref_kl = reference_output_loss(
        hidden, weight, target, 0.1, teacher_probs=probs, tau=tau, coef=alpha * tau
    )
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert rel_err(loss, ref_loss) <= 1e-6
    assert rel_err(log["nll_loss"], ref_nll) <= 1e-6 and rel_err(log["aug_loss"], ref_kl) <= 1e-5
    assert size == sample["ntokens"] == target.numel()
    assert_grads_close(grads, ref_grads, 1e-5)


@pytest.mark.parametrize("scale, factor", [("none", 1.0), ("tau", 3.0), ("tau2", 9.0)])
def test_scale_modes_weight_the_kl(lm, scale, factor):
    data, task, model, _, sample = lm
    crit = criterion_for(
        task, data, TINY_LM_ARGS,
        ["--criterion", "augmented_loss", "--aug-alpha", "0.4", "--aug-temperature", "3", "--aug-scale", scale],
    )
    with torch.no_grad():
        loss, _, log = crit(model, sample)
    assert log["aug_loss"] > 0 and log["aug_alpha"] == 0.4
    # label smoothing 0: the CE part is the NLL, so loss - nll = alpha * s(tau) * KL
    assert math.isclose(float(loss - log["nll_loss"]), 0.4 * factor * float(log["aug_loss"]), rel_tol=1e-4)


def test_warmup_ramps_alpha_linearly(lm):
    data, task, model, _, sample = lm
    crit = criterion_for(
        task, data, TINY_LM_ARGS,
        ["--criterion", "augmented_loss", "--aug-alpha", "0.8", "--aug-temperature", "2", "--aug-scale", "none",
         "--aug-warmup-updates", "4"],
    )
    kls = []
    for update, expect in [(0, 0.2), (1, 0.4), (2, 0.6), (3, 0.8), (10, 0.8)]:
        crit.set_update_num(update)
        with torch.no_grad():
            loss, _, log = crit(model, sample)
        assert math.isclose(log["aug_alpha"], expect, rel_tol=1e-12)
        assert math.isclose(float(loss - log["nll_loss"]), expect * float(log["aug_loss"]), rel_tol=1e-4)
        kls.append(float(log["aug_loss"]))
    assert max(kls) - min(kls) <= 1e-6 * max(kls)  # the model did not change, only the weight


def test_logging_is_in_bits_and_ppl_comes_from_the_nll_only(lm):
    data, task, model, _, sample = lm
    crit = criterion_for(task, data, TINY_LM_ARGS, ["--criterion", "augmented_loss", "--aug-temperature", "2"])
    with torch.no_grad():
        loss, size, log = crit(model, sample)
    with metrics.aggregate(new_root=True) as agg:
        AugmentedLossCriterion.reduce_metrics([log])
        values = agg.get_smoothed_values()
    ntok = log["ntokens"]
    assert math.isclose(values["loss"], round(float(loss) / size / LN2, 3), abs_tol=1e-9)
    assert math.isclose(values["nll_loss"], round(float(log["nll_loss"]) / ntok / LN2, 3), abs_tol=1e-9)
    assert math.isclose(values["aug_loss"], round(float(log["aug_loss"]) / ntok / LN2, 4), abs_tol=1e-9)
    assert math.isclose(values["ppl"], round(2 ** (float(log["nll_loss"]) / ntok / LN2), 2), rel_tol=1e-3)
    assert values["loss"] > values["nll_loss"]


def test_pad_positions_change_nothing(mt):
    """Changing the decoder input (hence the features and logits) at pad targets leaves loss and grads unchanged."""
    data, task, model, _, sample = mt
    crit = criterion_for(
        task, data, TINY_MT_ARGS,
        ["--criterion", "augmented_loss", "--aug-temperature", "2", "--label-smoothing", "0.1"],
    )
    pad = task.target_dictionary.pad()
    at_pad = sample["target"].eq(pad)
    changed = {k: v for k, v in sample.items()}
    changed["net_input"] = dict(sample["net_input"])
    prev = sample["net_input"]["prev_output_tokens"].clone()
    prev[at_pad] = task.target_dictionary.index("de1")
    changed["net_input"]["prev_output_tokens"] = prev
    with torch.no_grad():  # the test has teeth: the features at the pad positions do change
        f_a = model(**sample["net_input"], features_only=True)[0]
        f_b = model(**changed["net_input"], features_only=True)[0]
    assert (f_a[at_pad] - f_b[at_pad]).abs().max() > 1e-2
    assert (f_a[~at_pad] - f_b[~at_pad]).abs().max() <= 1e-5
    loss_a, _, log_a, grads_a = loss_and_grads(model, crit, sample)
    loss_b, _, log_b, grads_b = loss_and_grads(model, crit, changed)
    assert rel_err(loss_b, loss_a) <= 1e-6 and rel_err(log_b["aug_loss"], log_a["aug_loss"]) <= 1e-5
    assert_grads_close(grads_b, grads_a, 1e-5)


# --------------------------------------------------------------------------------------------
# AGG + AL in one criterion (docs/augmented_loss.md, "Combination with AGG")


def test_agg_plus_augmented_loss_gates_the_ce_part_only(mt):
    data, task, model, _, sample = mt
    tau, alpha, eps = 2.0, 0.5, 0.1
    crit = criterion_for(
        task, data, TINY_MT_ARGS,
        ["--criterion", "cross_entropy_agg", "--aug-alpha", str(alpha), "--aug-temperature", str(tau),
         "--label-smoothing", str(eps), "--agg-window", "1", "--agg-alpha", "1.5", "--agg-threshold-mode", "per-update", "--agg-g1-mode", "normalized",
         "--output-chunk-tokens", "16"],
    )
    crit.set_update_num(0)
    loss, _, log, grads = loss_and_grads(model, crit, sample)
    gates = crit.last_gates
    assert gates is not None and gates.rare.any() and (gates.g1 < 1).any() and (gates.g2 < 1).any()
    assert log["aug_alpha"] == alpha and log["aug_loss"] > 0

    def reference_grads(gate_aug):
        model.zero_grad(set_to_none=True)
        hidden, target = non_pad_features(model, sample, task.target_dictionary.pad())
        weight = model.decoder.output_projection.weight
        probs = reference_teacher(weight, target, tau, never_real_ids(task.target_dictionary))
        ref_loss, _, _ = reference_output_loss(
            hidden, weight, target, eps, gates=gates, teacher_probs=probs, tau=tau, coef=alpha * tau,
            gate_aug_with_agg=gate_aug,
        )
        ref_loss.backward()
        return ref_loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = reference_grads(gate_aug=False)
    assert rel_err(loss, ref_loss) <= 1e-6
    assert_grads_close(grads, ref_grads, 1e-5)
    # the choice matters: gating the AL part as well gives a different embedding gradient
    _, gated_grads = reference_grads(gate_aug=True)
    emb = "encoder.embed_tokens.weight"
    assert rel_err(gated_grads[emb], grads[emb]) > 1e-3


# --------------------------------------------------------------------------------------------
# end to end: fairseq-train, then a stock fairseq-validate of the final checkpoint


def stock_checkpoint(path, criterion_cfg):
    """The same checkpoint with the plugin removed from its config: a stock criterion, no --user-dir."""
    state = torch.load(path, map_location="cpu", weights_only=False)  # our own file; cfg is a plain container
    state["cfg"]["criterion"] = criterion_cfg
    state["cfg"]["common"]["user_dir"] = None
    out = path.replace(".pt", "_stock.pt")
    torch.save(state, out)
    return out


def valid_record(output, prefix="valid_"):
    recs = [r for r in read_json_log(output) if any(k.startswith(prefix + "loss") for k in r)]
    assert recs, output[-3000:]
    return recs[-1]


def train_8_updates(data, base_args, save, flags):
    """A real ``fairseq-train --criterion augmented_loss`` run of 8 updates; returns its output."""
    proc = run_cli(
        "fairseq-train",
        [data, "--user-dir", USER_DIR] + base_args
        + ["--criterion", "augmented_loss", "--max-update", "8", "--save-dir", save, "--log-format", "json",
           "--no-epoch-checkpoints"] + flags,
    )
    return proc.stdout + proc.stderr


def test_end_to_end_lm_real(lm_data_bin, tmp_path):
    save = str(tmp_path / "ck")
    out = train_8_updates(
        lm_data_bin, TINY_LM_ARGS, save,
        ["--aug-alpha", "0.5", "--aug-temperature", "2", "--aug-warmup-updates", "4", "--output-chunk-tokens", "100",
         "--output-kernel", "auto"],  # the default, compiled here: the augmented loss's one compiled real run
    )
    inner = [r for r in read_json_log(out) if "aug_alpha" in r and "num_updates" in r]
    alphas = {int(r["num_updates"]): float(r["aug_alpha"]) for r in inner}
    assert alphas[1] == 0.125 and alphas[2] == 0.25 and alphas[3] == 0.375 and alphas[4] == 0.5 and alphas[8] == 0.5
    assert float(inner[-1]["loss"]) < float(inner[0]["loss"])  # it trains
    valid = valid_record(out)
    assert float(valid["valid_aug_loss"]) > 0
    ckpt = os.path.join(save, "checkpoint_last.pt")
    stock = stock_checkpoint(ckpt, {"_name": "cross_entropy", "sentence_avg": False})
    ev = run_cli(
        "fairseq-validate",
        [lm_data_bin, "--path", stock, "--task", "language_modeling", "--tokens-per-sample", "64",
         "--sample-break-mode", "none", "--max-tokens", "512", "--cpu", "--num-workers", "0", "--log-format", "json"],
    )
    stock_valid = valid_record(ev.stdout + ev.stderr)
    assert "valid_aug_loss" not in stock_valid  # really the stock criterion
    # stock CE logs the NLL as "loss" (base 2, per token), rounded to 3 digits like ours
    assert abs(float(valid["valid_nll_loss"]) - float(stock_valid["valid_loss"])) <= 0.0011
    # and our total is that NLL plus alpha * tau * KL
    total = float(stock_valid["valid_loss"]) + 0.5 * 2 * float(valid["valid_aug_loss"])
    assert abs(float(valid["valid_loss"]) - total) <= 0.002


def test_end_to_end_mt_label_smoothed(mt_data_bin, tmp_path):
    save = str(tmp_path / "ck")
    out = train_8_updates(
        mt_data_bin, TINY_MT_ARGS, save,
        ["--label-smoothing", "0.1", "--aug-alpha", "0.5", "--aug-temperature", "2", "--aug-scale", "tau2"],
    )
    valid = valid_record(out)
    stock = stock_checkpoint(
        os.path.join(save, "checkpoint_last.pt"),
        {"_name": "label_smoothed_cross_entropy", "label_smoothing": 0.1, "sentence_avg": False},
    )
    # --user-dir only because fairseq saves the legacy ``transformer``'s argparse.Namespace in the
    # checkpoint, which torch >= 2.6 refuses to unpickle unless allowed (the plugin does that on
    # import); the criterion and model come from the checkpoint: stock fairseq code.
    ev = run_cli(
        "fairseq-validate",
        [mt_data_bin, "--user-dir", USER_DIR, "--path", stock, "--task", "translation", "--source-lang", "en", "--target-lang", "de",
         "--max-tokens", "600", "--cpu", "--num-workers", "0", "--log-format", "json"],
    )
    stock_valid = valid_record(ev.stdout + ev.stderr)
    assert "valid_aug_loss" not in stock_valid
    assert abs(float(valid["valid_nll_loss"]) - float(stock_valid["valid_nll_loss"])) <= 0.0011
    # loss = label-smoothed CE + alpha * tau^2 * KL
    total = float(stock_valid["valid_loss"]) + 0.5 * 4 * float(valid["valid_aug_loss"])
    assert abs(float(valid["valid_loss"]) - total) <= 0.003


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--aug-alpha", "-1"], "--aug-alpha must be >= 0"),
        (["--adaptive-softmax-cutoff", "20,100"], "--adaptive-softmax-cutoff is not supported"),
    ],
    ids=["alpha", "adaptive-softmax"],  # the other range checks share the alpha code path (in-process tests)
)
def test_end_to_end_bad_input_fails_before_any_checkpoint(lm_data_bin, tmp_path, flags, message):
    save = tmp_path / "ck"
    base = TINY_LM_ARGS[:-1] if "--adaptive-softmax-cutoff" in flags else TINY_LM_ARGS  # untied output
    proc = run_cli(
        "fairseq-train",
        [lm_data_bin, "--user-dir", USER_DIR] + base
        + ["--criterion", "augmented_loss", "--max-update", "2", "--save-dir", str(save)] + flags,
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert not save.exists() or not any(save.iterdir())


# --------------------------------------------------------------------------------------------
# non-detached teacher (--no-aug-detach-target; docs/augmented_loss.md, "Non-detached teacher")


def test_non_detached_teacher_gradients_flow_into_the_embedding(lm):
    data, task, model, _, sample = lm
    tau, alpha = 2.0, 0.5
    crit = criterion_for(
        task, data, TINY_LM_ARGS,
        ["--criterion", "augmented_loss", "--no-aug-detach-target", "--aug-temperature", str(tau),
         "--aug-alpha", str(alpha), "--output-chunk-tokens", "100"],
    )
    loss, _, log, grads = loss_and_grads(model, crit, sample)

    # reference: CE + alpha * tau * KL with the teacher materialised and *not* detached
    model.zero_grad(set_to_none=True)
    hidden, target = non_pad_features(model, sample, task.target_dictionary.pad())
    emb = model.decoder.embed_tokens.weight
    logits = hidden @ model.decoder.output_projection.weight.t()
    ce = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
    s = (emb[target] @ emb.t()) / tau
    masked = torch.tensor(never_real_ids(task.target_dictionary))
    log_p = torch.log_softmax(s.index_fill(1, masked, float("-inf")), -1)
    p = log_p.exp()
    kl = (p * torch.where(p > 0, log_p - torch.log_softmax(logits / tau, -1), torch.zeros_like(p))).sum()
    (ce + alpha * tau * kl).backward()
    ref_grads = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
    assert rel_err(loss, ce + alpha * tau * kl) <= 1e-6 and rel_err(log["aug_loss"], kl) <= 1e-5
    assert_grads_close(grads, ref_grads, 1e-5)
    # and it is a different gradient from the detached teacher's
    detached = criterion_for(
        task, data, TINY_LM_ARGS,
        ["--criterion", "augmented_loss", "--aug-temperature", str(tau), "--aug-alpha", str(alpha)],
    )
    _, _, _, det_grads = loss_and_grads(model, detached, sample)
    name = "decoder.embed_tokens.weight"
    assert rel_err(det_grads[name], grads[name]) > 1e-4  # 100x the rounding level of the comparison above
