"""What the package needs installed, each missing piece said in one line.

Neither torch nor fairseq is a pinned dependency (installing the plugin must not replace a user's
torch or fairseq), so a missing or too old one is reported here: :func:`require_torch` when the
package is imported, :func:`require_fairseq` first thing in each fairseq-side subpackage
(:mod:`fairseq_agg.criterions`, :mod:`fairseq_agg.models`, the fairseq optimizer). Both import
what they check only inside the check.
"""
import re

MIN_TORCH = (2, 1)  # F.scaled_dot_product_attention(scale=...) in the MLRA attention

INSTALL_HINT = (
    "install torch >= 2.1, then a fairseq built against it: stock fairseq 0.12.x (Python <= 3.10), "
    "fairseq main from source, or the fork with pip install --no-build-isolation 'fairseq-agg[fairseq]' "
    "(scripts/setup_env.sh does all of this)"
)


def _missing(name: str) -> ImportError:
    return ImportError(f"fairseq-agg needs {name}, which is not installed: {INSTALL_HINT}")


def require_torch():
    """Refuses a missing torch, or one older than :data:`MIN_TORCH`, in one ImportError line."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise _missing("torch") from None
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found and tuple(int(x) for x in found.groups()) < MIN_TORCH:
        raise ImportError(
            f"fairseq-agg needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}: "
            "upgrade torch and rebuild fairseq against it"
        )


def require_fairseq():
    """What the fairseq side of the plugin calls first: one line naming what to install."""
    require_torch()
    try:
        import fairseq  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "fairseq":
            raise
        raise _missing("fairseq") from None
