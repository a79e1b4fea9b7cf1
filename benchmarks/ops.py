"""The benchmarks' one door into the core: every call into ``fairseq_agg.ops`` and every default
read from the criteria that the benchmarks make themselves, so that a change of the core's API is
adapted here and nowhere else in ``benchmarks/``.

The steps the benchmarks time on the output-layer problem (the package's fused CE, AGG, augmented
loss and remedies, and the reference constructions) are tests/support/output_layer_steps.py's,
kept with the core; :mod:`benchmarks.variants` names them. This module adds what the benchmarks
call directly: the fused layer on tensors of their own (the GPU check's correctness part), the
teacher, the augmented loss's coefficient, and the kernels' names, paths and availability.
"""
import dataclasses
from typing import Optional

from fairseq_agg.errors import UsageError
from fairseq_agg.ops import output_kernel
from fairseq_agg.ops.augmented import aug_scale_factor, build_teacher
from fairseq_agg.ops.foreign_kernels import load_foreign_kernel
from fairseq_agg.ops.fused_linear_loss import LossRequest, fused_linear_loss

DEFAULT_KERNEL = "auto"  # what a LossRequest runs unless told otherwise
PACKAGE_KERNELS = tuple(output_kernel.BODIES)  # the package's own chunk body: auto, eager, compiled
FOREIGN_KERNELS = tuple(output_kernel.FOREIGN_KERNELS)  # the package's request on another library's kernel


class NotApplicable(Exception):
    """A variant that cannot compute what is asked here (recorded as skipped, not as an error)."""


def run_package_step(step, *args):
    """A package step (tests/support/output_layer_steps.py); a foreign kernel's refusal of the
    request (cut-cross-entropy takes no smoothing, no foreign kernel takes a teacher) is
    :class:`NotApplicable`."""
    try:
        return step(*args)
    except UsageError as error:
        raise NotApplicable(str(error)) from None


# --------------------------------------------------------------------------- kernels
def describe_path(kernel: str, device) -> str:
    """One line: which path the package's ``kernel`` (auto, eager, compiled) runs on ``device``."""
    return output_kernel.describe(kernel, device)


def compile_problem(device) -> Optional[str]:
    """Why torch.compile cannot generate the chunk body on ``device``, or None."""
    return output_kernel.compile_unavailable(device)


def foreign_kernel_problem(kernel: str) -> Optional[str]:
    """Why the foreign ``kernel`` does not load here, or None."""
    try:
        load_foreign_kernel(kernel)
    except UsageError as error:
        return str(error)
    return None


def foreign_kernel_description(kernel: str) -> str:
    return output_kernel.DESCRIPTIONS[kernel]


# --------------------------------------------------------------------------- the fused layer itself
def fused_loss(hidden, weight, target, eps, chunk, gates=None, teacher=None):
    """(loss, NLL) of the package's fused output layer on its default kernel, graph attached."""
    out = fused_linear_loss(hidden, weight, target, LossRequest(eps, chunk_size=chunk).with_terms(gates, teacher))
    return out.loss, out.nll


def teacher(weight, target, tau, coef, pad):
    """The augmented loss's per-type teacher from the rows of ``weight``, the padding column masked."""
    return build_teacher(weight, target, tau, coef, masked_columns=[pad])


def aug_coefficient(alpha, scale, tau) -> float:
    """The augmented loss's weight of the KL: alpha times its scale factor (none, tau or tau^2)."""
    return alpha * aug_scale_factor(scale, tau)


# --------------------------------------------------------------------------- the criteria's defaults
def _criterion_default(config_class, name):
    """A flag's default, read from the criterion's dataclass (so the benchmarks follow the code)."""
    for field in dataclasses.fields(config_class):
        if field.name == name:
            return getattr(field.default, "value", field.default)
    raise KeyError(f"{config_class.__name__} has no field {name}")


def augmented_defaults() -> dict:
    """The augmented loss's defaults: alpha, tau, scale and the coefficient they make."""
    from fairseq_agg.criterions.augmented_loss import AugmentedLossConfig

    alpha, tau, scale = (_criterion_default(AugmentedLossConfig, name)
                         for name in ("aug_alpha", "aug_temperature", "aug_scale"))
    return {"alpha": alpha, "tau": tau, "scale": scale, "coef": aug_coefficient(alpha, scale, tau)}


def default_chunk() -> int:
    """The criteria's default --output-chunk-tokens."""
    from fairseq_agg.criterions.output_loss import OutputLossConfig

    return int(_criterion_default(OutputLossConfig, "output_chunk_tokens"))
