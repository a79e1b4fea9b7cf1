"""The one registry of the output-layer variants that the benchmark (scripts/bench_criterion.py) and
the GPU check (scripts/gpu_check.py) time, one name per step, and the keys that name one
measurement of a variant.

A variant is a step on the output-layer problem (tests/support/output_layer_problem.py): one
forward and backward pass that leaves H.grad and W.grad behind and returns the loss without its
graph; what a criterion does per micro-batch (AGG's histogram and gates, the teacher, UL's
candidates, FACE's counts) happens inside the step, so inside the timed region.

A key is ``name[+ls][:kernel][@chunk]``:

* ``name``: a variant of :data:`VARIANTS`;
* ``+ls``: at the run's label smoothing (eps > 0; fairseq's convention, converted for torch's op);
  without it, at eps 0. A variant that takes no smoothing has no ``+ls`` key, and the floors,
  which ignore it, neither;
* ``:kernel``: a package variant on another kernel than the default ``auto`` (``eager``,
  ``compiled``, or a foreign one through the package: ``torch``, ``liger``, ``cce``);
* ``@chunk``: a chunked variant at another chunk size than the run's.

So ``agg`` is AGG at eps 0 on the default path at the run's chunk, ``agg+ls:eager@1024`` AGG at
the run's smoothing on the eager chunk body at chunk 1,024.
"""
import dataclasses
import functools
import re
from typing import Callable, Optional

import torch

from benchmarks import external
from benchmarks.ops import DEFAULT_KERNEL, FOREIGN_KERNELS, PACKAGE_KERNELS, foreign_kernel_problem, run_package_step
from tests.support import output_layer_steps as steps
from tests.support.output_layer_problem import matmul_floor, stock_loss, torch_linear_ce, torch_linear_ce_missing

KERNELS = PACKAGE_KERNELS + FOREIGN_KERNELS
# families: who computes the variant
PACKAGE, STOCK, REFERENCE, TORCH, FLOOR, EXTERNAL = "package", "stock", "reference", "torch", "floor", "external"
# what a variant does with the run's label smoothing
TAKES, NONE, IGNORES = "takes", "none", "ignores"


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    step: Callable  # step(p, chunk, kernel, eps) -> the loss without its graph
    family: str
    smoothing: str  # TAKES, NONE (at eps 0 only) or IGNORES (the floors)
    chunked: bool = False  # takes the run's chunk size (and is swept over others)
    unavailable: Callable[[], Optional[str]] = lambda: None  # why it cannot run here, or None


def _package(step, smoothing=TAKES):
    if smoothing == TAKES:
        return lambda p, chunk, kernel, eps: run_package_step(step, p, chunk, kernel, eps)
    return lambda p, chunk, kernel, eps: run_package_step(step, p, chunk, kernel)


@functools.lru_cache(maxsize=8)
def _target_types(target: torch.Tensor) -> torch.Tensor:
    """The distinct targets: index work, left out of the floor's matmuls (cached per target tensor,
    which hashes by identity)."""
    return torch.unique(target)


def al_floor(p, chunk):
    """The augmented loss's floor: the three matmuls of any linear cross-entropy and the teacher's
    (the target types' rows of W against every row: U x d times d x V), nothing else."""
    weight = p.weight.detach()
    types = _target_types(p.target)
    teacher_logits = torch.empty((types.numel(), weight.size(0)), dtype=weight.dtype, device=weight.device)
    torch.mm(weight.index_select(0, types), weight.t(), out=teacher_logits)
    return matmul_floor(p, chunk)


def _stock(p, chunk, kernel, eps):
    return stock_loss(p, label_smoothing=eps if eps > 0 else None)


VARIANTS = {
    "stock": Variant("fairseq's stock criterion, full logits (label-smoothed CE at eps > 0)", _stock, STOCK, TAKES),
    "fused_ce": Variant("CE, fused_linear_loss", _package(steps.fused_ce), PACKAGE, TAKES, True),
    "agg": Variant("AGG, fused_linear_loss + gates", _package(steps.fused_agg), PACKAGE, TAKES, True),
    "al": Variant("AL, fused_linear_loss + build_teacher", _package(steps.fused_al), PACKAGE, TAKES, True),
    "freeze": Variant("freezing, fused + frozen_rows", _package(steps.fused_freeze, NONE), PACKAGE, NONE, True),
    "cosreg": Variant("CosReg, fused + cosine_regularizer", _package(steps.fused_cosreg, NONE), PACKAGE, NONE, True),
    "face": Variant("FACE pre/out, fused + row weights", _package(steps.fused_face, NONE), PACKAGE, NONE, True),
    "ul": Variant("token-level UL, fused + candidates", _package(steps.fused_ul, NONE), PACKAGE, NONE, True),
    "agg_ref": Variant("AGG reference, three CE terms", lambda p, chunk, kernel, eps: steps.reference_agg(p, eps),
                       REFERENCE, TAKES),
    "al_ref": Variant("AL direct, materialised teacher", lambda p, chunk, kernel, eps: steps.reference_al(p),
                      REFERENCE, NONE),
    "torch_ref": Variant("torch linear_cross_entropy, reference path", lambda p, chunk, kernel, eps: torch_linear_ce(
        p, label_smoothing=eps), TORCH, TAKES, unavailable=torch_linear_ce_missing),
    "torch_auto": Variant("torch linear_cross_entropy, chunked, its chunk", lambda p, chunk, kernel, eps: torch_linear_ce(
        p, chunking="auto"), TORCH, NONE, unavailable=torch_linear_ce_missing),
    "torch_chunk": Variant("torch linear_cross_entropy, chunked", lambda p, chunk, kernel, eps: torch_linear_ce(
        p, chunking=chunk), TORCH, NONE, True, unavailable=torch_linear_ce_missing),
    "floor": Variant("floor: the 3 matmuls alone", lambda p, chunk, kernel, eps: matmul_floor(p, chunk), FLOOR,
                     IGNORES, True),
    "al_floor": Variant("AL's floor: the 3 matmuls and the teacher's", lambda p, chunk, kernel, eps: al_floor(p, chunk),
                        FLOOR, IGNORES, True),
    "liger": Variant("Liger-Kernel fused linear cross-entropy", external.liger_step, EXTERNAL, TAKES,
                     unavailable=lambda: external.problem("liger")),
    "cce": Variant("cut-cross-entropy linear_cross_entropy", external.cce_step, EXTERNAL, NONE,
                   unavailable=lambda: external.problem("cce")),
}


@dataclasses.dataclass(frozen=True)
class Key:
    """One measurement of a variant: at the run's smoothing or at 0, on a kernel (None: the
    default), at a chunk size (None: the run's)."""

    name: str
    smoothed: bool = False
    kernel: Optional[str] = None
    chunk: Optional[int] = None

    def __str__(self):
        return (self.name + ("+ls" if self.smoothed else "") + (f":{self.kernel}" if self.kernel else "")
                + (f"@{self.chunk}" if self.chunk else ""))

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.name]

    def label(self, eps=None) -> str:
        """The variant's label with what the key adds to its name."""
        extra = [f"eps {eps:g}" if self.smoothed and eps is not None else "+ls" if self.smoothed else None,
                 self.kernel, f"chunk {self.chunk}" if self.chunk else None]
        return self.variant.label + "".join(f" [{x}]" for x in extra if x)


_KEY = re.compile(r"^(?P<name>[a-z_]+)(?P<ls>\+ls)?(?::(?P<kernel>[a-z]+))?(?:@(?P<chunk>[0-9]+))?$")


def key(name, smoothed=False, kernel=None, chunk=None, run_chunk=None) -> Key:
    """The key of ``name`` measured so, checked; the default kernel and the run's chunk are left out."""
    variant = VARIANTS.get(name)
    if variant is None:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    if smoothed and variant.smoothing != TAKES:
        raise ValueError(f"{name} takes no label smoothing (no +ls)")
    if kernel not in (None, DEFAULT_KERNEL) and variant.family != PACKAGE:
        raise ValueError(f"{name} is not the package's: it runs on no kernel of the package (no :{kernel})")
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r} in {name}:{kernel}; choose from {', '.join(KERNELS)}")
    if chunk is not None and not variant.chunked:
        raise ValueError(f"{name} is not chunked (no @{chunk})")
    return Key(name, bool(smoothed), None if kernel == DEFAULT_KERNEL else kernel,
               None if chunk == run_chunk else chunk)


def parse_key(text: str) -> Key:
    """A key from its text, ``name[+ls][:kernel][@chunk]``; ValueError names what is wrong."""
    found = _KEY.match(text.strip())
    if not found:
        raise ValueError(f"{text!r} is not name[+ls][:kernel][@chunk]")
    chunk = found["chunk"]
    return key(found["name"], bool(found["ls"]), found["kernel"], int(chunk) if chunk else None)


def run(p, k: Key, eps: float, chunk: int):
    """One step of ``k`` on the problem ``p``: at ``eps`` if the key is smoothed (else at 0), at the
    key's chunk or the run's ``chunk``."""
    return k.variant.step(p, k.chunk or chunk, k.kernel or DEFAULT_KERNEL, eps if k.smoothed else 0.0)


def unavailable(k: Key) -> Optional[str]:
    """Why ``k`` cannot run here (its library, or its foreign kernel, does not load), or None."""
    reason = k.variant.unavailable()
    if reason is None and k.kernel in FOREIGN_KERNELS:
        reason = foreign_kernel_problem(k.kernel)
    return reason
