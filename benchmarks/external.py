"""The anchors outside torch and the package: Liger-Kernel's fused linear cross-entropy and Apple's
cut-cross-entropy, each timed as a step on the output-layer problem where it imports (both need
Triton, so a GPU), and otherwise recorded as skipped with the reason.
"""
from importlib import metadata

from tests.support.output_layer_problem import PAD


def _version(module, distribution):
    return getattr(module, "__version__", None) or metadata.version(distribution)


def _import_liger():
    import liger_kernel
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return f"liger-kernel {_version(liger_kernel, 'liger-kernel')}", LigerFusedLinearCrossEntropyLoss


def _import_cce():
    import cut_cross_entropy
    from cut_cross_entropy import linear_cross_entropy

    note = (f"cut-cross-entropy {_version(cut_cross_entropy, 'cut-cross-entropy')} (impl cce, its default "
            "gradient filtering)")
    return note, linear_cross_entropy


_IMPORTS = {"liger": ("liger_kernel", _import_liger), "cce": ("cut_cross_entropy", _import_cce)}
_loaded = {}


def _load(name):
    """(note, entry point) of an anchor, imported once; an ImportError (or any failure: no Triton)
    says why it cannot run."""
    if name not in _loaded:
        module, load = _IMPORTS[name]
        try:
            _loaded[name] = load()
        except Exception as error:  # not installed, or no Triton
            _loaded[name] = ImportError(f"{module} not importable: {type(error).__name__}: {error}")
    if isinstance(_loaded[name], ImportError):
        raise _loaded[name]
    return _loaded[name]


def problem(name):
    """Why the anchor ``name`` (liger, cce) cannot run here, or None."""
    try:
        _load(name)
    except ImportError as error:
        return str(error)
    return None


def note(name):
    """What the anchor is (its version), or "skipped: why"."""
    reason = problem(name)
    return f"skipped: {reason}" if reason else _load(name)[0]


_liger_losses = {}


def liger_step(p, chunk, kernel, eps):
    """Liger-Kernel's fused linear cross-entropy; the smoothing in PyTorch's convention (eps / V on
    every class; fairseq's puts eps / (V - 1) on the non-targets: the same work, a slightly
    different loss)."""
    _, loss_class = _load("liger")
    if eps not in _liger_losses:
        _liger_losses[eps] = loss_class(ignore_index=PAD, label_smoothing=eps, reduction="sum")
    loss = _liger_losses[eps](p.weight, p.hidden, p.target)
    loss.backward()
    return loss.detach()


def cce_step(p, chunk, kernel, eps):
    """cut-cross-entropy's ``linear_cross_entropy`` (its default Triton kernels); it takes no smoothing."""
    _, linear_cross_entropy = _load("cce")
    loss = linear_cross_entropy(p.hidden, p.weight, p.target, ignore_index=PAD, reduction="sum")
    loss.backward()
    return loss.detach()
