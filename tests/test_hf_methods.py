"""The remedies through ``fairseq_agg.hf.apply``: each gives the loss and every gradient of the core's
own object (:mod:`fairseq_agg.ops`, as the fairseq criterion calls it) on the same hidden states and
weights, the unpatched copy's; over two updates where the method counts. The core objects are held
against the papers' formulas by their own tests (test_augmented_ops, test_baselines_ops); what is
tested here is the glue: the shift, the rows kept, the matrices each method reads (tied: REAL), the
option defaults reaching the objects, the reduction, and the combinations cross_entropy_agg allows.
"""
import pytest
import torch

from fairseq_agg.hf import apply
from fairseq_agg.ops import (
    AggLoss, AugmentedLoss, CosRegLoss, FaceLoss, LossRequest, RareFreezing, UnlikelihoodLoss, fused_linear_loss,
)
from hf_models import EOS, IGNORE, PAD, VOCAB, assert_same_step, batch, model_and_copy, shifted_targets, target_count

EAGER = {"output_kernel": "eager"}
PLAIN = LossRequest(kernel="eager")  # the references' request: no compilation in this module
NOT_PAD = [token for token in range(VOCAB) if token != PAD]  # the tiny configs' pad is neither bos nor eos


def reference_rows(reference, data):
    """The unpatched copy's last hidden state at the non-ignored shifted positions: (rows, target,
    the (B, T) shifted labels, the flat indices kept)."""
    hidden = getattr(reference, reference.base_model_prefix)(
        input_ids=data["input_ids"], attention_mask=data["attention_mask"]).last_hidden_state
    padded = shifted_targets(data["labels"])
    flat = padded.reshape(-1)
    keep = flat.ne(IGNORE).nonzero().squeeze(1)
    return hidden.reshape(-1, hidden.size(-1)).index_select(0, keep), flat[keep], padded, keep


def run_against_core(family, method, options, core_loss, updates=2, ignore_index=IGNORE):
    """``updates`` training updates of one micro-batch each: the applied model's loss and gradients
    against ``core_loss(reference, rows, target, padded, keep, update_num)`` (a sum) over the targets;
    the model is given its labels with ``ignore_index`` in place of -100 (and that ``ignore_index``)."""
    model, reference = model_and_copy(family)
    apply(model, method, **options, **EAGER)
    for update in range(updates):
        data = batch(rows=3, seed=30 + update)
        model.fairseq_agg.update_num = update
        labels = data["labels"].masked_fill(data["labels"].eq(IGNORE), ignore_index)
        out = model(**{**data, "labels": labels}, **({} if ignore_index == IGNORE else {"ignore_index": ignore_index}))
        out.loss.backward()
        rows, target, padded, keep = reference_rows(reference, data)
        expected = core_loss(reference, rows, target, padded, keep, update) / keep.numel()
        expected.backward()
        assert_same_step(model, reference, out.loss, expected)
        model.zero_grad(), reference.zero_grad()
    return model, reference


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_augmented_loss_tied_is_real_untied_uses_the_input_embedding(family):
    def core(reference, rows, target, padded, keep, update):
        teacher = reference.get_input_embeddings().weight  # the head's own weight when tied: REAL
        al = AugmentedLoss(alpha=0.5, temperature=10.0, masked_columns=[PAD])
        return al(rows, reference.get_output_embeddings().weight, teacher, target, update, PLAIN).loss

    model, _ = run_against_core(family, "augmented_loss", {}, core)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (family == "gpt2") and model.fairseq_agg.teacher_matrix() is model.get_input_embeddings().weight
    assert model.fairseq_agg.logs()["aug_steps"] == 2


def test_agg_with_the_augmented_loss_in_one_pass():
    options = {"agg_alpha": 0.5, "agg_threshold_mode": "per-update", "agg_window": 2, "aug_alpha": 0.3,
               "aug_temperature": 5.0}
    agg = AggLoss(VOCAB, alpha=0.5, window=2, nspecial=0, threshold_mode="per-update")

    def core(reference, rows, target, padded, keep, update):
        gates = agg.step(target, update)
        al = AugmentedLoss(alpha=0.3, temperature=5.0, masked_columns=[PAD])
        return al(rows, reference.get_output_embeddings().weight, reference.get_input_embeddings().weight, target,
                  update, PLAIN.with_terms(gates)).loss

    model, _ = run_against_core("llama", "agg", options, core, updates=3)
    assert torch.equal(model.fairseq_agg.agg.counter.counts, agg.counter.counts)
    assert agg.gates().rare.any()


def test_rare_token_freezing_zeroes_the_rare_rows_of_the_head():
    agg = AggLoss(VOCAB, alpha=0.5, window=2, nspecial=0, threshold_mode="per-update")
    freezing = RareFreezing(VOCAB)

    def core(reference, rows, target, padded, keep, update):
        terms = freezing.terms(update, agg.step(target, update))
        return fused_linear_loss(rows, reference.get_output_embeddings().weight, target, PLAIN.with_terms(*terms)).loss

    model, _ = run_against_core("llama", "agg", {"agg_alpha": 0.5, "agg_threshold_mode": "per-update",
                                                 "agg_window": 2, "agg_freeze_rare": True}, core)
    data = batch(seed=40)
    model.fairseq_agg.update_num = 2
    model(**data).loss.backward()
    flat = shifted_targets(data["labels"]).reshape(-1)
    rows = freezing.rows(2, agg.step(flat[flat.ne(IGNORE)], 2))
    head = model.get_output_embeddings().weight.grad
    assert rows.any() and head[rows].abs().max() == 0 and head[~rows].abs().max() > 0
    assert model.fairseq_agg.logs()["agg_freeze_steps"] == 3


@pytest.mark.parametrize("options", [{}, {"face_weighing": "post", "face_frequency": "gt", "face_counting": "window",
                                          "face_window": 2}])
def test_face_counts_and_weights_as_the_core(options):
    face = FaceLoss(VOCAB, weighing=options.get("face_weighing", "pre"), frequency=options.get("face_frequency", "out"),
                    counting=options.get("face_counting", "cumulative"), window=options.get("face_window"),
                    uncounted_id=EOS)

    def core(reference, rows, target, padded, keep, update):
        return face(rows, reference.get_output_embeddings().weight, target, update, PLAIN).loss

    model, _ = run_against_core("qwen2", "face", options, core, updates=3)
    assert torch.equal(model.fairseq_agg.face.counter.counts, face.counter.counts)
    assert face.counter.counts.sum() > 0 and face.counter.counts[EOS] == 0


@pytest.mark.parametrize("ignore_index", [IGNORE, -1])
def test_unlikelihood_candidates_are_the_earlier_labels_of_the_row(ignore_index):
    def core(reference, rows, target, padded, keep, update):
        ul = UnlikelihoodLoss(alpha=0.7, clamp=1e-4, pad=IGNORE)
        return ul(rows, reference.get_output_embeddings().weight, padded, keep, PLAIN).loss

    model, _ = run_against_core("mistral", "unlikelihood", {"ul_alpha": 0.7, "ul_clamp": 1e-4}, core,
                                ignore_index=ignore_index)
    logged = model.fairseq_agg.logs()
    assert logged["ul_candidates"] > 0 and logged["ul_loss"] > 0


def test_cosreg_is_added_once_per_update_over_accumulated_micro_batches():
    """Two micro-batches with num_items_in_batch: mean CE over the update + gamma R once (fairseq's
    gamma R per sample unit), on the tied GPT-2 matrix without its padding row."""
    model, reference = model_and_copy("gpt2")
    apply(model, "cosreg", cosreg_gamma=0.5, **EAGER)
    micro_batches = [batch(rows=3, seed=50), batch(rows=2, lengths=[6, 3], seed=51)]
    items = sum(target_count(b["labels"]) for b in micro_batches)
    fused = sum(model(**b, num_items_in_batch=torch.tensor(items)).loss for b in micro_batches)
    fused.backward()
    weight = reference.get_output_embeddings().weight
    expected = 0.5 * CosRegLoss(rows=torch.tensor(NOT_PAD)).regularizer(weight)
    for b in micro_batches:
        rows, target, _, _ = reference_rows(reference, b)
        expected = expected + fused_linear_loss(rows, weight, target, PLAIN).loss / items
    expected.backward()
    assert_same_step(model, reference, fused.detach(), expected.detach())
    assert model.fairseq_agg.logs()["cosreg_steps"] == 2
