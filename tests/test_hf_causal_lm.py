"""``fairseq_agg.hf.apply`` on real transformers models (tiny configs, random weights, offline).

* method "ce", and AGG before any counting, give transformers' own loss and every parameter's
  gradient (the unpatched model on materialised logits, same weights): right padding, -100 labels,
  gradient accumulation with ``num_items_in_batch`` over micro-batches of different token counts;
  on every family the call covers, fp32, and fp64 where cheap;
* AGG's gradients over a few updates with real gating equal the released three-CE construction
  (``tests/support/reference_constructions.py``) on the unpatched copy's logits, in both threshold
  modes, tied and untied;
* without labels the model is the model it was (logits, ``generate``); the refusals, one line each;
* the options' names and defaults are the fairseq flags'.
The remedies other than AGG: tests/test_hf_methods.py.
"""
import copy
import dataclasses

import pytest
import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.hf import apply
from fairseq_agg.hf.options import DEFAULTS
from fairseq_agg.ops import AggLoss
from hf_models import (
    EOS, FAMILIES, IGNORE, assert_same_step, batch, model_and_copy, shifted_targets, target_count, tiny_model,
)
from reference_constructions import reference_output_loss

EAGER = {"output_kernel": "eager"}  # the compiled body is tested in the core's suite; here it only costs time


def stock_update(reference, micro_batches, accumulate=True):
    """transformers' own loss (on logits) summed over the micro-batches, with ``num_items_in_batch``
    of the whole update when ``accumulate``; backward after each, as Trainer does."""
    items = sum(target_count(b["labels"]) for b in micro_batches) if accumulate else None
    total = 0
    for b in micro_batches:
        loss = reference(**b, **({"num_items_in_batch": torch.tensor(items)} if accumulate else {})).loss
        loss.backward()
        total = total + loss.detach()
    return total


def fused_update(model, micro_batches, accumulate=True):
    items = sum(target_count(b["labels"]) for b in micro_batches) if accumulate else None
    total = 0
    for b in micro_batches:
        out = model(**b, **({"num_items_in_batch": torch.tensor(items)} if accumulate else {}))
        assert out.logits is None
        out.loss.backward()
        total = total + out.loss.detach()
    return total


def ce_step(family, dtype=torch.float32):
    """One batch through the applied model ("ce") and through the unpatched copy, each backward:
    (model, copy, the applied model's output, transformers' output)."""
    model, reference = model_and_copy(family, dtype)
    apply(model, "ce", **EAGER)
    data = batch(seed=1)
    out, expected = model(**data), reference(**data)
    out.loss.backward()
    expected.loss.backward()
    return model, reference, out, expected


@pytest.mark.parametrize("family", FAMILIES)
def test_ce_is_transformers_loss_and_gradients(family):
    model, reference, out, expected = ce_step(family)
    assert type(out) is type(expected) and out.logits is None and expected.logits is not None
    assert_same_step(model, reference, out.loss, expected.loss)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bf16_model_loss_in_fp32_and_gradients_to_bf16_rounding(family):
    """A bf16 model: the logits matmul in bf16 on both sides, softmax and loss in fp32 (transformers
    upcasts the logits), gradients in bf16."""
    model, reference, out, expected = ce_step(family, torch.bfloat16)
    assert out.loss.dtype == torch.float32 and model.get_output_embeddings().weight.grad.dtype == torch.bfloat16
    assert_same_step(model, reference, out.loss, expected.loss, tol=5e-2)


@pytest.mark.parametrize("family, method", [("gpt2", "ce"), ("llama", "agg"), ("gpt2", "agg"), ("llama_tied", "ce")])
def test_gradient_accumulation_with_num_items_in_batch(family, method):
    """Two micro-batches of different token counts: the summed losses and the accumulated gradients
    are transformers' with num_items_in_batch (AGG evaluated: nothing counted or gated, plain CE)."""
    model, reference = model_and_copy(family)
    apply(model, method, **({"agg_window": 4} if method == "agg" else {}), **EAGER)
    if method == "agg":
        model.eval(), reference.eval()
    micro_batches = [batch(rows=3, seed=2), batch(rows=2, lengths=[5, 3], seed=3)]
    assert target_count(micro_batches[0]["labels"]) != target_count(micro_batches[1]["labels"])
    assert_same_step(model, reference, fused_update(model, micro_batches), stock_update(reference, micro_batches))
    assert model.fairseq_agg.logs()["ntokens"] == sum(target_count(b["labels"]) for b in micro_batches)


def test_fp64_and_shift_labels_and_evaluation():
    """fp64 to 1e-10 against the model's own logits (transformers' loss casts logits to fp32, so its
    cross-entropy is taken here in fp64); ``shift_labels`` given directly; AGG in eval mode with
    update_num set counts nothing and is plain CE (fairseq's validation)."""
    model, reference = model_and_copy("gpt2", torch.float64)
    apply(model, "agg", agg_window=4, **EAGER)
    model.fairseq_agg.update_num = 0
    model.eval(), reference.eval()
    data = batch(seed=4)
    shift = shifted_targets(data["labels"])
    inputs = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]}
    out = model(**inputs, labels=data["labels"], shift_labels=shift)
    out.loss.backward()
    logits = reference(**inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), shift.reshape(-1),
                                                 ignore_index=IGNORE)
    expected.backward()
    assert out.loss.dtype == torch.float64
    assert_same_step(model, reference, out.loss, expected, tol=1e-10)
    assert int(model.fairseq_agg.agg.counter.counts.sum()) == 0 and not model.fairseq_agg.logs().get("agg_steps")


@pytest.mark.parametrize("family, options", [
    ("gpt2", {"agg_alpha": 1.0, "agg_threshold_mode": "per-update", "label_smoothing": 0.1}),  # tied
    ("llama", {"agg_alpha": 0.1, "agg_ref_tokens": 1}),  # untied; relative: rare below 10 % of the window's tokens
])
def test_agg_gradients_are_the_three_ce_construction_on_the_models_logits(family, options):
    """Three updates of two micro-batches, SGD between them: every gradient equals the released
    code's construction on the unpatched copy's logits with the gates of an AggLoss fed the same
    targets; the gates are real (g1 < 1 and g2 < 1 on some tokens)."""
    model, reference = model_and_copy(family)
    apply(model, "agg", agg_window=2, **options, **EAGER)
    mode = options.get("agg_threshold_mode", "relative")
    gates_of = AggLoss(model.fairseq_agg.vocab_size, alpha=options["agg_alpha"], window=2, nspecial=0,
                       threshold_mode=mode, ref_tokens=options.get("agg_ref_tokens") if mode == "relative" else None)
    epsilon = options.get("label_smoothing", 0.0)
    base = getattr(reference, reference.base_model_prefix)
    head = reference.get_output_embeddings()
    seen_rare = False
    for update in range(3):
        micro_batches = [batch(rows=3, seed=10 + 2 * update), batch(rows=2, lengths=[6, 4], seed=11 + 2 * update)]
        items = sum(target_count(b["labels"]) for b in micro_batches)
        model.fairseq_agg.update_num = update
        fused = fused_update(model, micro_batches)
        expected = 0
        for b in micro_batches:
            hidden = base(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
            flat = shifted_targets(b["labels"]).reshape(-1)
            keep = flat.ne(IGNORE)
            gates = gates_of.step(flat[keep], update)
            loss, _, _ = reference_output_loss(hidden.reshape(-1, hidden.size(-1))[keep], head.weight, flat[keep],
                                               epsilon, gates=gates)
            (loss / items).backward()
            expected = expected + loss.detach() / items
        rare = gates.rare
        assert rare.any() and (gates.g1[rare] < 1).any() and (gates.g2[rare] < 1).any()
        seen_rare = seen_rare or bool((gates.g1[rare] > 0).any())  # rare tokens seen in the window, not only unseen ones
        assert_same_step(model, reference, fused, expected)
        for m in (model, reference):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.5 * p.grad
            m.zero_grad()
    assert seen_rare
    logged = model.fairseq_agg.logs()
    assert logged["agg_steps"] == 6 and logged["agg_rare"] > 0


def test_without_labels_the_model_is_unchanged():
    model, reference = model_and_copy("llama")
    apply(model, "agg", agg_window=4, **EAGER)
    model.fairseq_agg.update_num = 0
    data = batch(seed=5)
    inputs = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"]}
    assert torch.equal(model(**inputs).logits, reference(**inputs).logits)
    assert int(model.fairseq_agg.agg.counter.counts.sum()) == 0  # training mode, but no labels: nothing counted
    model.eval(), reference.eval()
    prompt = data["input_ids"][:1, :4]
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=EOS)
    assert generated.shape == (1, 9)
    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=EOS))
    # the class and a second instance keep the stock forward
    other = tiny_model("llama")
    assert "forward" not in vars(other) and other(**inputs, labels=data["labels"]).logits is not None


def test_only_the_instance_changes_and_a_deep_copy_runs_its_own():
    model, _ = model_and_copy("gpt2")
    apply(model, "agg", agg_window=3, **EAGER)
    twin = copy.deepcopy(model)
    twin.fairseq_agg.update_num = 0
    twin(**batch(seed=6)).loss.backward()
    assert twin.fairseq_agg.model is twin and model.fairseq_agg.model is model
    assert int(twin.fairseq_agg.agg.counter.counts.sum()) > 0 and int(model.fairseq_agg.agg.counter.counts.sum()) == 0


def test_return_dict_false_gives_the_tuple():
    model, _ = model_and_copy("opt")
    apply(model, "ce", **EAGER)
    data = batch(seed=7)
    out = model(**data, return_dict=False)
    assert isinstance(out, tuple) and torch.equal(out[0], model(**data).loss)


def test_state_round_trip_and_its_refusals():
    model, _ = model_and_copy("gpt2")
    apply(model, "agg", agg_window=3, agg_alpha=1.0, agg_threshold_mode="per-update", **EAGER)
    method = model.fairseq_agg
    for update in range(2):
        method.update_num = update
        model(**batch(seed=20 + update)).loss.backward()
    state = method.state_dict()
    assert state["method"] == "agg" and state["vocab_size"] == 300 and state["updates"] == 2
    fresh, _ = model_and_copy("gpt2")
    apply(fresh, "agg", agg_window=3, agg_alpha=1.0, agg_threshold_mode="per-update", **EAGER)
    fresh.fairseq_agg.load_state_dict(copy.deepcopy(state))
    assert torch.equal(fresh.fairseq_agg.agg.gates().g1, method.agg.gates().g1)
    other_method, _ = model_and_copy("gpt2")
    apply(other_method, "face", **EAGER)
    small = tiny_model("gpt2", vocab=200)
    apply(small, "agg", agg_window=3, **EAGER)
    cases = [(other_method, state, "of method 'agg', this model runs 'face'"),
             (small, state, "a vocabulary of 300 tokens, the model has 200"),
             (fresh, {**state, "updates": 7}, "the checkpoint was saved after 7 updates"),
             (fresh, {"counts": {}}, "not a fairseq_agg.hf method state")]
    for target, bad, message in cases:
        with pytest.raises(UsageError, match=message) as refused:
            target.fairseq_agg.load_state_dict(copy.deepcopy(bad))
        assert "\n" not in str(refused.value)


def test_an_unset_auto_window_is_refused_when_counting_and_set_window_sizes_it():
    model, _ = model_and_copy("gpt2")
    apply(model, "agg", **EAGER)
    method = model.fairseq_agg
    assert not method.window_is_set
    method.update_num = 0
    with pytest.raises(UsageError, match="agg_window is 0"):
        model(**batch(seed=8))
    method.set_window(5)
    assert method.window_is_set and method.agg.counter.window == 5
    model(**batch(seed=8)).loss.backward()


@pytest.mark.parametrize("method, options, message", [
    ("agg", {"agg_alpha": 0.0}, "agg_alpha must be in (0, 1]"),
    ("agg", {"agg_alpha": 2.0, "agg_g1_mode": "code"}, "agg_alpha must be in (0, 1] with agg_g1_mode code"),
    ("agg", {"agg_window": -1}, "agg_window must be >= 0, got -1"),
    ("agg", {"agg_g1_mode": "sqrt"}, "agg_g1_mode must be one of code, normalized"),
    ("agg", {"agg_threshold_mode": "daily"}, "agg_threshold_mode must be one of auto, relative, per-update"),
    ("agg", {"agg_threshold_mode": "per-update", "agg_ref_tokens": 5}, "agg_ref_tokens needs agg_threshold_mode"),
    ("agg", {"agg_local_counts": "yes"}, "agg_local_counts must be True or False"),
    ("agg", {"agg_freeze_until_update": 3}, "agg_freeze_until_update needs agg_freeze_rare=True"),
    ("agg", {"aug_gate_with_agg": True}, "aug_gate_with_agg needs aug_alpha > 0"),
    ("agg", {"face_weighing": "pre"}, "unknown option 'face_weighing' for method 'agg'; its options are: label_smoothing,"),
    ("ce", {"label_smoothing": 1.0}, "label_smoothing must be in [0, 1)"),
    ("ce", {"output_chunk_tokens": 0}, "output_chunk_tokens must be >= 1, got 0"),
    ("ce", {"output_kernel": "fast"}, "output_kernel must be one of auto, eager, compiled"),
    ("ce", {"agg_alpha": 0.1}, "unknown option 'agg_alpha' for method 'ce'"),
    ("augmented_loss", {"aug_temperature": 0}, "aug_temperature must be > 0"),
    ("augmented_loss", {"aug_scale": "tau3"}, "aug_scale must be one of"),
    ("augmented_loss", {"aug_embed": "both"}, "aug_embed must be one of input, output"),
    ("augmented_loss", {"aug_gate_with_agg": True}, "unknown option 'aug_gate_with_agg' for method 'augmented_loss'"),
    ("augmented_loss", {"output_kernel": "torch"}, "output_kernel torch cannot compute"),
    ("face", {"face_window": 3}, "face_window needs face_counting window"),
    ("face", {"face_frequency": "both"}, "face_frequency must be one of"),
    ("unlikelihood", {"ul_clamp": 1.0}, "ul_clamp must be in (0, 1)"),
    ("unlikelihood", {"ul_alpha": -1}, "ul_alpha must be >= 0"),
    ("cosreg", {"cosreg_rows": "some"}, "cosreg_rows must be one of all, no-pad-madeup, no-special"),
    ("cosreg", {"cosreg_gamma": float("nan")}, "cosreg_gamma must be >= 0"),
    ("mlra", {}, "method must be one of ce, agg, augmented_loss, face, unlikelihood, cosreg, got 'mlra'"),
])
def test_each_bad_option_is_one_line_naming_it(method, options, message):
    model = tiny_model("gpt2")
    with pytest.raises(UsageError) as refused:
        apply(model, method, **options)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert "forward" not in vars(model) and not hasattr(model, "fairseq_agg")  # nothing was changed


def unsupported_models():
    import transformers as t

    seq = t.GPT2ForSequenceClassification(t.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    t5 = t.T5ForConditionalGeneration(t.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    biased = tiny_model("llama")
    biased.lm_head = torch.nn.Linear(32, 300, bias=True)
    capped = t.Gemma2ForCausalLM(t.Gemma2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                                final_logit_softcapping=30.0))
    twice = apply(tiny_model("gpt2"), "ce", **EAGER)
    return [(seq, "GPT2ForSequenceClassification has no linear output layer"),
            (t5, "T5ForConditionalGeneration is an encoder-decoder model"),
            (biased, "LlamaForCausalLM has a bias in its output layer"),
            (capped, "Gemma2ForCausalLM changes its output layer's result before returning it as logits"),
            (twice, "GPT2LMHeadModel already runs fairseq_agg.hf's 'ce' forward")]


def test_each_unsupported_model_is_one_line_naming_its_class():
    for model, message in unsupported_models():
        training = [m.training for m in model.modules()]
        with pytest.raises(UsageError) as refused:
            apply(model, "agg", **EAGER)
        assert str(refused.value).startswith("fairseq_agg.hf.apply: " + message), str(refused.value)
        assert "\n" not in str(refused.value)
        assert [m.training for m in model.modules()] == training  # the probe restored every mode


def test_the_options_are_the_fairseq_flags_with_their_defaults():
    from fairseq_agg.criterions.agg import AggCriterionConfig
    from fairseq_agg.criterions.augmented_loss import AugmentedLossConfig
    from fairseq_agg.criterions.cosreg import CosRegConfig
    from fairseq_agg.criterions.face import FaceConfig
    from fairseq_agg.criterions.output_loss import OutputLossConfig
    from fairseq_agg.criterions.unlikelihood import UnlikelihoodConfig

    configs = {"ce": OutputLossConfig, "agg": AggCriterionConfig, "augmented_loss": AugmentedLossConfig,
               "face": FaceConfig, "unlikelihood": UnlikelihoodConfig, "cosreg": CosRegConfig}
    fairseq_auto = {"agg_threshold_mode": "auto"}  # fairseq's auto is relative for a language model
    for method, config in configs.items():
        flags = {f.name: f.default for f in dataclasses.fields(config)}
        for name, default in DEFAULTS[method].items():
            assert name in flags, (method, name)
            assert str(getattr(flags[name], "value", flags[name])) == str(fairseq_auto.get(name, default)), (method, name)


@pytest.mark.parametrize("method", ["agg", "face"])
def test_training_without_the_update_number_is_refused_in_one_line(method):
    """A counting method trained with ``update_num`` unset would silently be plain CE: refused."""
    model, _ = model_and_copy("llama")
    apply(model, method, **EAGER)
    with pytest.raises(UsageError, match=r"^[^\n]*update_num is None while training[^\n]*add_method_state_callback"):
        model(**batch(seed=2))


def test_the_forward_keeps_the_class_signature_for_trainer_columns():
    """``Trainer(remove_unused_columns=True)`` keeps the dataset columns the forward's signature
    names: the fused forward must show the class's, or the Trainer drops ``input_ids``."""
    import inspect

    model, _ = model_and_copy("gpt2")
    apply(model, "ce", **EAGER)
    names = list(inspect.signature(model.forward).parameters)
    assert names[:1] == ["input_ids"] and "labels" in names and "attention_mask" in names
