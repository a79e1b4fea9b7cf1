"""The remedies of fairseq-agg for Hugging Face causal LMs (docs/hf.md).

``apply(model, method="agg", **options)`` gives a ``*ForCausalLM`` instance the method's fused
loss (:mod:`fairseq_agg.hf.causal_lm`); ``model.fairseq_agg`` is its :class:`CausalLMMethod`.
The one part of the package that imports transformers: nothing else imports this package, and
``import fairseq_agg`` does not load it. Needs ``pip install "fairseq-agg[hf]"``.
"""
import importlib

from fairseq_agg.errors import InstallError

try:
    import transformers  # noqa: F401
except ImportError:
    raise InstallError('fairseq_agg.hf needs transformers: pip install "fairseq-agg[hf]"') from None

from .causal_lm import CausalLMMethod, apply  # noqa: E402

# the Trainer's parts, loaded when first named (their modules import transformers' Trainer)
_LAZY = {"MethodStateCallback": ".trainer", "add_method_state_callback": ".trainer",
         "EmbeddingStatsCallback": ".stats", "coupled_adam_for": ".coupled_adam"}

__all__ = ["apply", "CausalLMMethod", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
