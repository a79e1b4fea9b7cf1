"""The body of the fused output layer's chunk loop: everything between ``Z = H_c W^T`` and the
matmuls ``dH = G W`` and ``dW += G_w^T H_c``, as one pure function of the logit tile.

The body is a composition. Cross-entropy (with fairseq's label smoothing) is its core; each method
adds to it through one small interface of pure tensor code on the tile and its per-row and
per-column vectors (:class:`Tile`, :class:`TermOut`):

* a **term** (the augmented loss's teacher, unlikelihood's penalty) adds a per-row loss, a logged
  per-row value and a logit-gradient expression, plus optional sparse columns;
* a **row weight** (FACE) scales each row's cross-entropy and its gradient;
* a **gate** (AGG) turns the logit gradient into the one that forms dW; dH is never gated. The
  body writes both where the caller asks (a GPU); on a CPU the caller gates in place after dH
  instead (:func:`run_gate_in_place`; why: ``gate_after_dh`` in fused_linear_loss).

Each method object says what it needs from a chunk (``tile_inputs``: index work of O(rows) done
outside the body, scalars as 0-d tensors so that a changing weight never recompiles) and supplies
the static function the body calls. The same body runs eagerly (the reference and the fallback) or
through ``torch.compile`` (Inductor: one generated Triton kernel on a GPU, C++/OpenMP on a CPU).

Dtypes: the tile's logits arrive in the model dtype, every expression is evaluated in fp32 (fp64
for fp64 inputs), and the gradients are written back in the model dtype into buffers the caller
owns. Compiled, the expressions stay in registers: in bf16/fp16 no fp32 chunk x V tensor exists
(tests/test_output_kernel.py reads the generated code). The softmax is written as
``exp(z - lse)`` rather than ``exp(z - max) / sum`` on purpose: the second form reuses
``exp(z - max)`` and makes Inductor store it as an fp32 chunk x V buffer.

Compilation: all dimensions are dynamic, so fairseq's varying batch sizes compile once per body
plan (a batch of a single target specialises once more; the chunking never leaves a one-row chunk
after others); a plan is the static shape of the
composition (:class:`BodyPlan`), so a process compiles one graph per method combination, dtype and
grad mode, the first time it is used.
"""
import contextlib
import importlib
import logging
import shutil
import types
from typing import Callable, Dict, NamedTuple, Optional

import torch

logger = logging.getLogger(__name__)


class TargetColumns:
    """Each row's target as a comparison with the column index (rows x V, never materialised when
    compiled): one-hot and smoothed targets, and AGG's own-column exception, without a scatter."""

    def __init__(self, target: torch.Tensor, vocab: int):
        self.target = target
        self.columns = torch.arange(vocab, device=target.device)
        self.is_target = self.columns.unsqueeze(0) == target.unsqueeze(1)


class Tile(TargetColumns):
    """A chunk of logits as every term sees it: ``z`` (rows x V) in the accumulation dtype, the
    targets, the row maximum and log-sum-exp (rows x 1)."""

    def __init__(self, z: torch.Tensor, target: torch.Tensor, acc: torch.dtype, with_argmax: bool):
        super().__init__(target, z.size(1))
        self.z = z.to(acc)
        if with_argmax:
            row_max, self.argmax = self.z.max(dim=1, keepdim=True)
            self.argmax = self.argmax.squeeze(1)
        else:
            row_max, self.argmax = self.z.amax(dim=1, keepdim=True), None
        self.row_max = row_max
        self.lse = row_max + torch.exp(self.z - row_max).sum(dim=1, keepdim=True).log()

    @property
    def vocab(self) -> int:
        return self.z.size(1)

    def probs(self) -> torch.Tensor:
        """softmax(z), recomputed from z and lse (see the module docstring)."""
        return torch.exp(self.z - self.lse)

    def target_logit(self) -> torch.Tensor:
        return self.z.gather(1, self.target.unsqueeze(1)).squeeze(1)


class TermOut(NamedTuple):
    """What a term adds to a chunk: per row ``loss`` (weighted, in the optimised loss) and ``value``
    (logged, before its weight), the logit-gradient expression ``grad`` (rows x V), and, where the
    term has sparse columns, their ids (rows x L) and the gradient added there."""

    loss: torch.Tensor
    value: torch.Tensor
    grad: Optional[torch.Tensor]
    columns: Optional[torch.Tensor] = None
    column_grad: Optional[torch.Tensor] = None
    count: Optional[torch.Tensor] = None  # (rows,) e.g. the number of penalty candidates


class RowValues(NamedTuple):
    """The per-row results of a chunk; the chunk loop sums them or keeps them per token."""

    loss: torch.Tensor
    nll: torch.Tensor
    aug_kl: Optional[torch.Tensor]
    penalty: Optional[torch.Tensor]
    candidates: Optional[torch.Tensor]
    row_weight: Optional[torch.Tensor]
    argmax: Optional[torch.Tensor]
    # a term's sparse columns (rows x L) and what they add to G and to G_w, for the caller to add in
    # place after the body: inside a compiled graph the scatter would copy the whole chunk
    columns: Optional[torch.Tensor] = None
    column_grad: Optional[torch.Tensor] = None
    gated_column_grad: Optional[torch.Tensor] = None


class BodyPlan(NamedTuple):
    """The static shape of a chunk body; one compiled graph per distinct plan.

    ``gate``, ``row_weight``, ``teacher`` and ``penalty`` are the static functions of the methods
    present (None where absent); ``teacher_gated`` says whether AGG's gate also acts on the
    teacher's part of dW."""

    acc: torch.dtype  # the arithmetic's dtype: fp32, or fp64 for fp64 inputs
    smoothing: bool  # label smoothing on (its weights are an argument: no graph per epsilon or V)
    needs_grad: bool
    row_scale: bool
    argmax: bool
    gate: Optional[Callable] = None
    row_weight: Optional[Callable] = None
    teacher: Optional[Callable] = None
    teacher_gated: bool = True
    penalty: Optional[Callable] = None


def smoothing_weights(epsilon: float, vocab: int, acc: torch.dtype, device) -> torch.Tensor:
    """(1 - eps - eps_i, eps_i), eps_i = eps / (V - 1): fairseq's label smoothing gives the target
    1 - eps and every other class eps_i (``label_smoothed_nll_loss``)."""
    smooth = epsilon / (vocab - 1) if epsilon > 0 else 0.0
    return torch.tensor([1.0 - epsilon - smooth, smooth], dtype=acc, device=device)


def cross_entropy_tile(tile: Tile, smoothing: Optional[torch.Tensor]):
    """Per-row (label-smoothed) cross-entropy and NLL of a tile:
    loss = (1 - eps - eps_i) nll + eps_i sum_k -log p_k, with ``smoothing`` = (1 - eps - eps_i, eps_i)."""
    nll = tile.lse.squeeze(1) - tile.target_logit()
    if smoothing is None:
        return nll, nll
    smooth = tile.vocab * tile.lse.squeeze(1) - tile.z.sum(dim=1)
    return smoothing[0] * nll + smoothing[1] * smooth, nll


def cross_entropy_grad(tile: Tile, smoothing: Optional[torch.Tensor]) -> torch.Tensor:
    """d(loss)/dz of :func:`cross_entropy_tile`: softmax(z) - Q, Q built by comparison."""
    if smoothing is None:
        return tile.probs() - tile.is_target.to(tile.z.dtype)
    return tile.probs() - torch.where(tile.is_target, smoothing[0] + smoothing[1], smoothing[1])


def chunk_body(plan: BodyPlan, z, target, smoothing, row_scale, grad_out, grad_weight_out,
               gate_inputs, weight_inputs, teacher_inputs, penalty_inputs) -> RowValues:
    """One chunk: the per-row values, and with ``plan.needs_grad`` the logit gradient written into
    ``grad_out`` (for dH; it may be ``z`` itself) and the gated one into ``grad_weight_out`` (for dW,
    only with a gate). Reads all of ``z`` before writing."""
    tile = Tile(z, target, plan.acc, plan.argmax)
    ce, nll = cross_entropy_tile(tile, smoothing if plan.smoothing else None)
    row_weight = plan.row_weight(tile, weight_inputs) if plan.row_weight is not None else None
    loss = ce if row_weight is None else row_weight * ce
    teacher = plan.teacher(tile, teacher_inputs) if plan.teacher is not None else None
    penalty = plan.penalty(tile, penalty_inputs) if plan.penalty is not None else None
    for term in (teacher, penalty):
        if term is not None:
            loss = loss + term.loss
    values = RowValues(
        loss=loss, nll=nll, aug_kl=None if teacher is None else teacher.value,
        penalty=None if penalty is None else penalty.value, candidates=None if penalty is None else penalty.count,
        row_weight=row_weight, argmax=tile.argmax,
    )
    if not plan.needs_grad:
        return values

    scale = None if row_scale is None else row_scale.to(tile.z.dtype).unsqueeze(1)
    grad = cross_entropy_grad(tile, smoothing if plan.smoothing else None)
    if row_weight is not None:
        grad = grad * row_weight.unsqueeze(1)
    if penalty is not None:
        grad = grad + penalty.grad
    # the parts of G that AGG's gate acts on (all but a teacher kept apart) and the rest
    gated_part, apart = grad, None
    if teacher is not None:
        grad = grad + teacher.grad
        if plan.teacher_gated:
            gated_part = grad
        else:
            apart = teacher.grad
    columns = column_grad = None
    if penalty is not None and penalty.columns is not None:
        columns, column_grad = penalty.columns, penalty.column_grad
    if scale is not None:
        grad = grad * scale
        if column_grad is not None:
            column_grad = column_grad * scale

    gated_columns = None
    if plan.gate is not None:
        factor = plan.gate(tile, gate_inputs)
        grad_weight = gated_part * factor
        if apart is not None:
            grad_weight = grad_weight + apart
        if scale is not None:
            grad_weight = grad_weight * scale
        gated_columns = None if columns is None else factor.gather(1, columns) * column_grad
        grad_weight_out.copy_(grad_weight.to(grad_weight_out.dtype))
    grad_out.copy_(grad.to(grad_out.dtype))
    return values._replace(columns=columns, column_grad=column_grad, gated_column_grad=gated_columns)


def add_columns(out: torch.Tensor, columns: torch.Tensor, column_grad: torch.Tensor):
    """Adds a term's sparse column gradient to a written chunk gradient, in place (duplicate ids
    carry zeros)."""
    out.scatter_add_(1, columns, column_grad.to(out.dtype))


# --- eager or compiled ---------------------------------------------------------------------------

KERNELS = ("auto", "eager", "compiled")


def _private_settings():
    """The two settings :func:`_compile_settings` patches, from torch's private config modules,
    looked up only when the compiled path is asked for (they move between torch versions): (dynamo
    config, fx config), or the reason this torch lacks them."""
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
    settings = _private_settings()
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


MAX_GRAPHS = 4096
_compiled: Dict[BodyPlan, Callable] = {}
_fallen_back: Dict[str, str] = {}


def _own_code(function: Callable, name: str) -> Callable:
    """``function`` with a code object of its own named ``name``, for Dynamo to compile and cache apart."""
    # co_qualname exists from Python 3.11 on
    names = {"co_name": name, **({"co_qualname": name} if hasattr(function.__code__, "co_qualname") else {})}
    return types.FunctionType(function.__code__.replace(**names), function.__globals__, name)


def _compiled_body(plan: BodyPlan) -> Callable:
    """The compiled chunk body of ``plan``, called as ``body(plan, *args)``. Each plan gets a code
    object of its own: Dynamo keeps, and caps, the graphs per code object, so plans sharing
    chunk_body's would crowd each other out of that cap in a process that uses many of them."""
    body = _compiled.get(plan)
    if body is None:
        own = _own_code(chunk_body, f"chunk_body_{len(_compiled)}")
        # dynamic: the rows of a chunk (and V, and a teacher's or penalty's widths) vary without recompiling
        body = _compiled[plan] = torch.compile(own, dynamic=True, fullgraph=True)
    return body


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``eager`` or ``compiled`` for a request's ``kernel`` on ``device``: ``auto`` is compiled where
    torch.compile can generate code there (and has not failed in this process), else eager."""
    if kernel == "eager":
        return "eager"
    reason = compile_unavailable(device) or _fallen_back.get(device.type)
    if reason is None:
        return "compiled"
    if kernel == "compiled":
        raise RuntimeError(f"output kernel 'compiled' is not available on {device.type}: {reason}")
    return "eager"


def describe_kernel(kernel: str, device: torch.device) -> str:
    """One line for the log: which path a request's ``kernel`` (auto, eager or compiled) runs on
    ``device``, and why."""
    chosen = resolve_kernel(kernel, device)
    if chosen == "compiled":
        target = "Triton" if device.type == "cuda" else "C++/OpenMP"
        return f"compiled chunk body (torch.compile, Inductor -> {target} on {device.type})"
    why = "as asked" if kernel == "eager" else (compile_unavailable(device) or _fallen_back.get(device.type))
    return f"eager chunk body ({why})"


def _compile_settings():
    """Dynamo's settings for the chunk body: no duck sizing, which would tie sizes that happen to
    be equal in the first call (a chunk's rows and the batch's, a width of 2) and compile again
    when they differ; and room for a process's many plans under Dynamo's cap on all its graphs."""
    dynamo_config, fx_config = _private_settings()  # present: resolve_kernel chose "compiled"
    stack = contextlib.ExitStack()
    stack.enter_context(dynamo_config.patch(accumulated_recompile_limit=MAX_GRAPHS))
    stack.enter_context(fx_config.patch(use_duck_shape=False))
    return stack


def run_chunk_body(kernel: str, plan: BodyPlan, *args) -> RowValues:
    """Runs the body with ``kernel`` (``eager`` or ``compiled``, from :func:`resolve_kernel`)."""
    if kernel == "eager":
        return chunk_body(plan, *args)
    with _compile_settings():
        return _compiled_body(plan)(plan, *args)


_compiled_gates: Dict[Callable, Callable] = {}


def run_gate_in_place(kernel: str, gates, grad: torch.Tensor, target: torch.Tensor, eager_block: int):
    """``gates.gate_in_place`` over a written chunk gradient (AGG after dH = G W; see
    ``gate_after_dh`` in fused_linear_loss), its pass over the chunk compiled, or eager through
    blocks of ``eager_block`` rows (the eager body's cache-sized blocks) so that its temporaries
    stay small."""
    scale_rows_ = type(gates).scale_rows_
    if kernel == "compiled":
        compiled = _compiled_gates.get(scale_rows_)
        if compiled is None:
            own = _own_code(scale_rows_, f"scale_rows_{len(_compiled_gates)}")
            compiled = _compiled_gates[scale_rows_] = torch.compile(own, dynamic=True, fullgraph=True)

        def scale(block, inputs):
            with _compile_settings():
                compiled(block, inputs)
    else:
        def scale(block, inputs):
            for start in range(0, block.size(0), eager_block):
                rows = slice(start, start + eager_block)
                scale_rows_(block[rows], inputs._replace(rare_target=inputs.rare_target[rows]))
    gates.gate_in_place(grad, target, scale)


def note_compile_failure(device: torch.device, error: BaseException):
    """Records that compilation failed on ``device``: ``auto`` runs eagerly from now on."""
    reason = f"torch.compile failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if device.type not in _fallen_back:
        logger.warning(f"fused output layer: {reason}; running the eager chunk body instead")
    _fallen_back[device.type] = reason
