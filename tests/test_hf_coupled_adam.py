"""Coupled Adam for Hugging Face models (``fairseq_agg.hf.coupled_adam_for``, docs/hf.md, "Coupled Adam").

* which matrices are coupled: the tied GPT-2 embedding once, the untied Llama's input embedding and
  head each over its own rows, or the one chosen;
* two updates on real gradients of a tiny GPT-2 (tied) and Llama (untied) follow the formula of
  docs/coupled_adam.md written out by hand: a coupled row, an ordinary decayed matrix, a 1-D parameter;
* the authors' decay groups (which parameters weight decay reaches), and ``all``;
* every bad option refused in one line naming it;
* a real ``Trainer`` run with it trains, and resumed from its checkpoint ends bit-equal.
"""
import math

import pytest
import torch
from transformers import Trainer, default_data_collator

from fairseq_agg.errors import UsageError
from fairseq_agg.hf import coupled_adam_for
from hf_models import tiny_model
from hf_trainer_runs import VOCAB, tiny_llama, token_dataset, training_args

LR, BETAS, EPS, WD = 0.01, (0.9, 0.98), 1e-6, 0.1


def tiny_gpt2():
    return tiny_model("gpt2", vocab=VOCAB)  # tied, the vocabulary of the Trainer runs' data


def names_of(model, params):
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def test_tied_gpt2_couples_its_one_embedding_and_decays_the_other_matrices():
    model = tiny_gpt2()
    opt = coupled_adam_for(model, lr=LR, weight_decay=WD)
    wte = model.transformer.wte.weight
    assert wte is model.lm_head.weight and list(opt.coupled_blocks) == [wte]
    decayed, undecayed = opt.param_groups
    one_dimensional = {n for n, p in model.named_parameters() if p.dim() == 1}
    assert names_of(model, undecayed["params"]) == {"transformer.wte.weight"} | one_dimensional
    assert undecayed["weight_decay"] == 0.0 and decayed["weight_decay"] == WD
    # the position embedding is an ordinary matrix in the authors' setting: decayed, not coupled
    assert names_of(model, decayed["params"]) == {n for n, p in model.named_parameters() if p.dim() >= 2} - {
        "transformer.wte.weight"}
    assert "transformer.wpe.weight" in names_of(model, decayed["params"])


@pytest.mark.parametrize("which, coupled", [("all", {"model.embed_tokens.weight", "lm_head.weight"}),
                                            ("input", {"model.embed_tokens.weight"}),
                                            ("output", {"lm_head.weight"})])
def test_untied_llama_couples_the_chosen_matrices_each_over_its_rows(which, coupled):
    model = tiny_llama()
    opt = coupled_adam_for(model, lr=LR, weight_decay=WD, coupled_adam_matrices=which)
    assert names_of(model, opt.coupled_blocks) == coupled
    assert all(blocks[0].rows == VOCAB and blocks[0].offset == 0 for blocks in opt.coupled_blocks.values())
    decayed, undecayed = opt.param_groups
    matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert names_of(model, decayed["params"]) == matrices - coupled  # an uncoupled head is decayed


def test_decay_all_is_one_group_over_every_trainable_parameter():
    model = tiny_llama()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    opt = coupled_adam_for(model, lr=LR, weight_decay=WD, coupled_adam_decay="all")
    (group,) = opt.param_groups
    assert names_of(model, group["params"]) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.mlp.up_proj.weight" not in names_of(model, group["params"])


def hand_updates(start, grads, coupled, decayed):
    """docs/coupled_adam.md's update in float64, written out per step (bias-corrected form)."""
    w = start.double().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    b1, b2 = BETAS
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        if coupled:
            v_hat = v_hat.mean(dim=0, keepdim=True).expand_as(v_hat)  # one value per dimension
        if decayed:
            w = w - LR * WD * w
        w = w - LR * m_hat / (v_hat.sqrt() + EPS / math.sqrt(1 - b2 ** t))
    return w


def two_updates(model, opt):
    """Two optimizer updates on two batches of real data; each parameter's start and gradients."""
    rows = token_dataset(samples=4)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: [] for n in start}
    for batch in (rows[:2], rows[2:]):
        batch = default_data_collator(batch)
        opt.zero_grad()
        model(**batch).loss.backward()
        for n, p in model.named_parameters():
            grads[n].append(p.grad.detach().clone())
        opt.step()
    return start, grads


@pytest.mark.parametrize("build, coupled, ordinary, one_dimensional", [
    (tiny_gpt2, ["transformer.wte.weight"], "transformer.h.0.attn.c_attn.weight", "transformer.h.1.ln_2.weight"),
    (tiny_llama, ["model.embed_tokens.weight", "lm_head.weight"], "model.layers.0.self_attn.q_proj.weight",
     "model.norm.weight"),
])
def test_two_updates_follow_the_formula_by_hand(build, coupled, ordinary, one_dimensional):
    model = build()
    opt = coupled_adam_for(model, lr=LR, adam_betas=BETAS, adam_eps=EPS, weight_decay=WD)
    start, grads = two_updates(model, opt)
    params = dict(model.named_parameters())
    for name in coupled:
        expected = hand_updates(start[name], grads[name], coupled=True, decayed=False)
        # a row that was never a target of these batches: its few, small gradients still get the shared step
        rare = int(grads[name][0].norm(dim=1).argmin())
        torch.testing.assert_close(params[name][rare].double(), expected[rare], rtol=0, atol=1e-6)
        torch.testing.assert_close(params[name].double(), expected, rtol=0, atol=1e-6)
        adam = hand_updates(start[name], grads[name], coupled=False, decayed=False)
        assert (adam - expected).abs().max() > 1e-3  # coupling changed this matrix's step
    for name, decayed in ((ordinary, True), (one_dimensional, False)):
        expected = hand_updates(start[name], grads[name], coupled=False, decayed=decayed)
        torch.testing.assert_close(params[name].double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("options, message", [
    ({"lr": 0}, "--lr must be > 0, got 0"),
    ({"lr": float("nan")}, "--lr must be > 0"),
    ({"adam_betas": (0.9, 1.0)}, "--adam-betas must be in [0, 1), got 1.0"),
    ({"adam_betas": (0.9,)}, "--adam-betas must be two numbers in [0, 1), got (0.9,)"),
    ({"adam_betas": "0.9,0.98"}, "--adam-betas must be two numbers in [0, 1)"),
    ({"adam_eps": -1e-8}, "--adam-eps must be >= 0"),
    ({"weight_decay": float("inf")}, "--weight-decay must be >= 0, got inf (not a finite number)"),
    ({"coupled_adam_matrices": "both"}, "--coupled-adam-matrices must be one of input, output, all, got 'both'"),
    ({"coupled_adam_scale": 0.0}, "--coupled-adam-scale must be > 0, got 0.0"),
    ({"coupled_adam_decay": "none"}, "--coupled-adam-decay must be one of all, non-embedding-matrices, got 'none'"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(UsageError) as error:
        coupled_adam_for(tiny_gpt2(), **options)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_model_without_a_trainable_embedding_is_refused():
    model = tiny_llama()
    model.lm_head.weight.requires_grad_(False)
    with pytest.raises(UsageError, match=r"--coupled-adam-matrices output: LlamaForCausalLM has no trainable"):
        coupled_adam_for(model, coupled_adam_matrices="output")
    assert len(coupled_adam_for(model).coupled_blocks) == 1  # "all" still finds the input embedding


def train(output_dir, resume=None):
    model = tiny_llama()
    opt = coupled_adam_for(model, lr=1e-2, weight_decay=WD)
    args = training_args(output_dir, max_steps=8, save_steps=4, gradient_accumulation_steps=1, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(), data_collator=default_data_collator,
                      optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@torch.no_grad()
def loss_on_the_training_set(model):
    return model.eval()(**default_data_collator(token_dataset())).loss.item()


def test_trainer_run_trains_and_resumes_bit_equal(tmp_path):
    straight = train(tmp_path / "straight")
    assert len([entry for entry in straight.state.log_history if "loss" in entry]) == 8
    assert loss_on_the_training_set(straight.model) < loss_on_the_training_set(tiny_llama()) - 0.3
    assert isinstance(straight.optimizer.optimizer, type(coupled_adam_for(tiny_gpt2())))
    # a fresh model and optimizer, resumed from the checkpoint the first run wrote at update 4
    resumed = train(tmp_path / "resumed", resume=str(tmp_path / "straight" / "checkpoint-4"))
    assert resumed.state.global_step == 8
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    a_state, b_state = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert a_state.keys() == b_state.keys()
    for key in a_state:
        assert a_state[key]["step"] == b_state[key]["step"] == 8
        assert torch.equal(a_state[key]["exp_avg_sq"], b_state[key]["exp_avg_sq"])
