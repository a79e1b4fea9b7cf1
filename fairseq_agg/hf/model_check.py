"""What :func:`fairseq_agg.hf.apply` requires of a Hugging Face model, checked at the call.

The fused output layer replaces ``logits = head(hidden)`` and the loss on them, so a model is taken
only where that is what its forward computes: a decoder-only model whose output layer
(``get_output_embeddings()``) is an ``nn.Linear`` without a bias, beside a base model
(``base_model_prefix``) whose ``last_hidden_state`` the head reads, and whose logits are the head's
output unchanged. The last two are facts of the model's code, not of its class name, so they are
read from one probe forward of a few tokens (:func:`probe_output_class`): the head's input is
recorded and its output replaced by a known tensor, which the model must return as its logits
(logit soft-capping, a scale or a bias added after the head change it). Every refusal is one line
naming the model's class.
"""
import torch
from torch import nn

from fairseq_agg.errors import UsageError

PROBE_TOKENS = 4
PROBE_LOGIT_SCALE = 20.0  # large enough that soft-capping (e.g. 30 tanh(z / 30)) moves it visibly


def refuse(model, why: str):
    raise UsageError(f"fairseq_agg.hf.apply: {type(model).__name__} {why}")


def base_model(model) -> nn.Module:
    """The model under the head (``getattr(model, model.base_model_prefix)``)."""
    return getattr(model, getattr(model, "base_model_prefix", "") or "", None)


def check_model(model) -> None:
    """The structural checks: a Hugging Face decoder-only model with a linear, bias-free head and a base model."""
    if not isinstance(model, nn.Module) or not hasattr(model, "get_output_embeddings") or \
            getattr(model, "config", None) is None:
        refuse(model, "is not a Hugging Face model (no config or get_output_embeddings)")
    if getattr(model.config, "is_encoder_decoder", False):
        refuse(model, "is an encoder-decoder model; the fused loss takes decoder-only causal LMs (*ForCausalLM)")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        refuse(model, f"has no linear output layer (get_output_embeddings() is {type(head).__name__}); "
                      "the fused loss takes a *ForCausalLM whose head is an nn.Linear")
    if head.bias is not None:
        refuse(model, "has a bias in its output layer; the fused loss computes hidden @ weight.T only")
    base = base_model(model)
    if not isinstance(base, nn.Module) or base is model:
        refuse(model, f"has no base model at its base_model_prefix {getattr(model, 'base_model_prefix', None)!r}")
    if getattr(model, "fairseq_agg", None) is not None:
        refuse(model, f"already runs fairseq_agg.hf's {model.fairseq_agg.name!r} forward; apply once per model")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    tol = 1e-5 if a.dtype in (torch.float32, torch.float64) else 2e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * PROBE_LOGIT_SCALE)


def probe_output_class(model) -> type:
    """One forward of ``PROBE_TOKENS`` tokens in eval mode without gradients (every module's
    training flag restored after): refuses a model whose logits are not its head applied to its
    base model's last hidden state; returns the class of its output (the fused forward returns one)."""
    head, base = model.get_output_embeddings(), base_model(model)
    weight = head.weight
    vocab = weight.size(0)
    ids = (torch.arange(PROBE_TOKENS) % vocab).unsqueeze(0).to(weight.device)
    generator = torch.Generator().manual_seed(0)  # the process's random state stays as it was
    known = (PROBE_LOGIT_SCALE * torch.randn(1, PROBE_TOKENS, vocab, generator=generator)).to(weight.device,
                                                                                             weight.dtype)
    seen = {}
    modes = [(module, module.training) for module in model.modules()]
    handles = [head.register_forward_pre_hook(lambda module, args: seen.setdefault("hidden", args[0])),
               head.register_forward_hook(lambda module, args, output: known)]
    try:
        model.eval()
        with torch.no_grad():
            output = model(input_ids=ids, return_dict=True)
            for handle in handles:
                handle.remove()
            hidden = base(input_ids=ids, return_dict=True).last_hidden_state
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training
    logits = getattr(output, "logits", None)
    if "hidden" not in seen:
        refuse(model, "does not call its output layer (get_output_embeddings()) in its forward")
    if logits is None or not _close(logits, known):
        refuse(model, "changes its output layer's result before returning it as logits (soft-capping, a scale "
                      "or a bias); the fused loss needs logits = head(hidden)")
    if not _close(seen["hidden"], hidden):
        refuse(model, "does not apply its output layer to its base model's last hidden state")
    return type(output)
