"""Tiny Hugging Face causal LMs of the families ``fairseq_agg.hf.apply`` covers, built from configs
(random weights, offline, no dropout so that two copies compute the same), and batches for them:
right-padded rows with ``-100`` labels at the padding and at a masked prompt.

For tests/test_hf_causal_lm.py and tests/test_hf_methods.py; each returns the model in training mode.
"""
import copy

import torch

VOCAB = 300
PAD, BOS, EOS = 2, 0, 1
IGNORE = -100

FAMILIES = ("gpt2", "llama", "llama_tied", "qwen2", "qwen3", "mistral", "opt")


def tiny_model(family: str, seed: int = 0, vocab: int = VOCAB):
    """A 2-layer model of ``family`` (width 32; OPT projects to 16 before its tied head)."""
    import transformers as t

    ids = dict(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    decoder = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=64, attention_dropout=0.0, **ids)
    builders = {
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**decoder)),
        "llama_tied": lambda: t.LlamaForCausalLM(t.LlamaConfig(**decoder, tie_word_embeddings=True)),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**decoder)),
        "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**decoder, head_dim=16)),
        "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**decoder)),
        "opt": lambda: t.OPTForCausalLM(t.OPTConfig(vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                    num_attention_heads=2, max_position_embeddings=64, dropout=0.0,
                                                    attention_dropout=0.0, word_embed_proj_dim=16, **ids)),
    }
    torch.manual_seed(seed)
    model = builders[family]()
    model.train()
    return model


def model_and_copy(family: str, dtype=torch.float32, seed: int = 0):
    """(model, an unpatched copy with the same weights), both in ``dtype``."""
    model = tiny_model(family, seed).to(dtype)
    return model, copy.deepcopy(model)


def batch(rows: int = 3, length: int = 10, seed: int = 0, lengths=None, prompt: int = 2, vocab: int = VOCAB):
    """input_ids, attention_mask, labels: row i holds ``lengths[i]`` tokens then padding (PAD, mask
    0, label -100); the first ``prompt`` labels of the first row are -100 too (a masked prompt).
    Token ids are drawn from a skewed distribution over 3..V-1, so counts differ between ids."""
    generator = torch.Generator().manual_seed(seed)
    lengths = lengths or [length - (i * 3) % length for i in range(rows)]
    weights = 1.0 / torch.arange(1, vocab - 2, dtype=torch.float64) ** 0.8
    input_ids = torch.full((len(lengths), length), PAD, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        input_ids[i, :n] = torch.multinomial(weights, n, replacement=True, generator=generator) + 3
        mask[i, :n] = 1
    labels = input_ids.masked_fill(mask.eq(0), IGNORE)
    labels[0, :prompt] = IGNORE
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """The (B, T) targets of transformers' causal-LM loss: labels shifted left, -100 at the end."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[:, 1:].contiguous()


def target_count(labels: torch.Tensor) -> int:
    """The non-ignored targets of a batch (``num_items_in_batch`` for one micro-batch)."""
    return int(shifted_targets(labels).ne(IGNORE).sum())


def grads(model) -> dict:
    """{name: gradient} of every parameter (tied ones once, by their first name)."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_step(model, reference, loss, reference_loss, tol=1e-5):
    """The same loss and, parameter by parameter, the same gradient (relative to its largest entry)."""
    assert torch.allclose(loss, reference_loss, rtol=tol, atol=tol), (loss, reference_loss)
    ours, theirs = grads(model), grads(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        scale = theirs[name].abs().max().clamp(min=1e-3)
        assert (ours[name] - theirs[name]).abs().max() <= tol * scale, name
