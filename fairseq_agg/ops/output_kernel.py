"""Which code computes the fused output layer: the one home of ``--output-kernel``.

The choice has two axes (:class:`OutputKernel`):

* the **implementation**: this package's chunk loop (``package``), or another fused linear
  cross-entropy that serves plain CE, label smoothing and the terms that can run on it by algebra
  (AGG's gates, freezing): PyTorch's ``F.linear_cross_entropy`` (``torch``), Liger-Kernel
  (``liger``), cut-cross-entropy (``cce``; :mod:`fairseq_agg.ops.foreign_kernels`);
* the package's **body**, how a chunk's element-wise work runs (:mod:`fairseq_agg.ops.output_chunk`):
  ``compiled`` by ``torch.compile``, ``eager``, or ``auto`` (compiled where torch.compile can
  generate code for the device and has not failed in this process, else eager).

The flag ``--output-kernel`` (and ``LossRequest(kernel=...)``) names one point of the two axes in
one word, as it always has: a body (``auto``, ``eager``, ``compiled``) runs the package's loop, a
foreign name its kernel. This module also checks a choice at start-up, says in one line what runs,
and resolves ``auto`` on a device (the body itself runs in :mod:`fairseq_agg.ops.body_runner`).
"""
import importlib
import logging
import shutil
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from fairseq_agg.errors import UsageError, check_choice

from .foreign_kernels import load_foreign_kernel

logger = logging.getLogger(__name__)

PACKAGE = "package"
BODIES = ("auto", "eager", "compiled")
FOREIGN_KERNELS = ("torch", "liger", "cce")
IMPLEMENTATIONS = (PACKAGE,) + FOREIGN_KERNELS
FLAG_CHOICES = BODIES + FOREIGN_KERNELS  # the values of --output-kernel

DESCRIPTIONS = {
    "torch": "PyTorch's F.linear_cross_entropy",
    "liger": "Liger-Kernel's fused linear cross-entropy",
    "cce": "cut-cross-entropy's linear_cross_entropy",
}


@dataclass(frozen=True)
class OutputKernel:
    """A point of the two axes: ``implementation`` (package, torch, liger, cce) and, for the
    package's loop, its ``body`` (auto, eager, compiled; None for a foreign kernel)."""

    implementation: str
    body: Optional[str]
    foreign: bool = field(init=False)  # another library's kernel, not the package's loop

    def __post_init__(self):
        object.__setattr__(self, "foreign", self.implementation != PACKAGE)

    @classmethod
    def from_flag(cls, value) -> "OutputKernel":
        """The choice that a value of ``--output-kernel`` names (a UsageError naming the flag)."""
        value = check_choice("output_kernel", value, FLAG_CHOICES)
        return cls(PACKAGE, value) if value in BODIES else cls(value, None)

    @property
    def flag(self) -> str:
        return self.body if self.implementation == PACKAGE else self.implementation


# --- can the body be compiled here ---------------------------------------------------------------


def private_compile_settings():
    """The two settings the compiled body patches (:class:`~fairseq_agg.ops.body_runner.BodyRunner`),
    from torch's private config modules, looked up only when the compiled path is asked for (they
    move between torch versions): (dynamo config, fx config), or the reason this torch lacks them."""
    try:
        import torch._dynamo

        fx_config = importlib.import_module("torch.fx.experimental._config")
    except ImportError as e:
        return f"torch {torch.__version__} lacks a module the compiled body's settings need ({e.name})"
    dynamo_config = torch._dynamo.config
    for config, name in ((dynamo_config, "accumulated_recompile_limit"), (fx_config, "use_duck_shape")):
        if not hasattr(config, name):
            return f"torch {torch.__version__} has no setting {config.__name__}.{name}"
    return dynamo_config, fx_config


def compile_unavailable(device: torch.device) -> Optional[str]:
    """Why ``torch.compile`` cannot generate the chunk body's kernel on ``device``, or None."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    settings = private_compile_settings()
    if isinstance(settings, str):
        return settings
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed (Inductor generates Triton kernels on a GPU)"
        return None
    if device.type == "cpu":
        if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
            return "no C++ compiler (g++, c++ or clang++) on PATH (Inductor generates C++ on a CPU)"
        return None
    return f"the chunk body is compiled on cpu and cuda only, not on {device.type}"


_fallen_back: Dict[str, str] = {}


def resolve_body(body: str, device: torch.device) -> str:
    """``eager`` or ``compiled`` for a body choice on ``device``: ``auto`` is compiled where
    torch.compile can generate code there (and has not failed in this process), else eager."""
    if body == "eager":
        return "eager"
    reason = compile_unavailable(device) or _fallen_back.get(device.type)
    if reason is None:
        return "compiled"
    if body == "compiled":
        raise RuntimeError(f"output kernel 'compiled' is not available on {device.type}: {reason}")
    return "eager"


def describe(kernel, device: torch.device) -> str:
    """One line for the log: which path ``kernel`` (an :class:`OutputKernel` or a value of
    ``--output-kernel``) runs on ``device``, and why."""
    kernel = OutputKernel.from_flag(kernel) if isinstance(kernel, str) else kernel
    if kernel.foreign:
        return f"{DESCRIPTIONS[kernel.implementation]} (AGG's gates by algebra)"
    if resolve_body(kernel.body, device) == "compiled":
        target = "Triton" if device.type == "cuda" else "C++/OpenMP"
        return f"compiled chunk body (torch.compile, Inductor -> {target} on {device.type})"
    why = "as asked" if kernel.body == "eager" else (compile_unavailable(device) or _fallen_back.get(device.type))
    return f"eager chunk body ({why})"


def check_available(kernel: OutputKernel, device: torch.device) -> None:
    """Refuses at start-up, in one line, a choice that cannot run: a foreign kernel that is not
    installed, or ``compiled`` where torch.compile cannot generate code for ``device``."""
    if kernel.foreign:
        load_foreign_kernel(kernel.implementation)
    elif kernel.body == "compiled":
        reason = compile_unavailable(device)
        if reason:
            raise UsageError(f"--output-kernel compiled cannot run on {device.type}: {reason} (choose auto or eager)")


def foreign_refusal(kernel: OutputKernel, terms=(), *, label_smoothing: bool = False,
                    argmax: bool = False) -> Optional[str]:
    """Why a foreign ``kernel`` cannot compute what is asked (one line naming the flags), or None:
    ``terms`` are the request's terms (or their classes), each saying what it needs."""
    asked = [term.foreign_refusal for term in terms]
    asked += ["each row's argmax (FACE's out counts)" if argmax else None,
              "label smoothing (--label-smoothing)" if kernel.implementation == "cce" and label_smoothing else None]
    for what in asked:
        if what:
            return (f"--output-kernel {kernel.implementation} cannot compute {what}: it computes cross-entropy only "
                    "(choose auto, compiled or eager)")
    return None


def note_compile_failure(device: torch.device, error: BaseException):
    """Records that compilation failed on ``device``: ``auto`` runs eagerly from now on."""
    reason = f"torch.compile failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if device.type not in _fallen_back:
        logger.warning(f"fused output layer: {reason}; running the eager chunk body instead")
    _fallen_back[device.type] = reason
