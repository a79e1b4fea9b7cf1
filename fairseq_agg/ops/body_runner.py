"""How the fused output layer's chunk body (:func:`fairseq_agg.ops.output_chunk.chunk_body`) runs.

**How it runs** (:class:`BodyRunner`): eagerly (the reference and the fallback) or through
``torch.compile``, where Dynamo unrolls the fold: the generated code is one kernel per plan
(Inductor: Triton on a GPU, C++/OpenMP on a CPU). Which of the two a run uses is the choice of
``--output-kernel`` (:mod:`fairseq_agg.ops.output_kernel`), resolved once per device.

A plan (:class:`~fairseq_agg.ops.output_chunk.BodyPlan`) is the static shape of the fold: a process
compiles one graph per plan, the first time it is used; all dimensions are dynamic, so fairseq's
varying batch sizes do not recompile it.
"""
import contextlib
import types
from typing import Callable, Dict, Tuple

import torch

from .output_chunk import BodyPlan, RowValues, chunk_body
from .output_kernel import note_compile_failure, private_compile_settings, resolve_body

# --- the runners ----------------------------------------------------------------------------------

MAX_GRAPHS = 4096
_compiled: Dict[BodyPlan, Callable] = {}
_compiled_in_place: Dict[Callable, Callable] = {}
_runners: Dict[Tuple[str, torch.device], "BodyRunner"] = {}


def body_runner(body: str, device: torch.device) -> "BodyRunner":
    """The runner of the body asked (``auto``, ``eager`` or ``compiled``) on ``device``, one per
    pair in a process: the choice is resolved once, not at every call."""
    runner = _runners.get((body, device))
    if runner is None:
        runner = _runners[body, device] = BodyRunner(body, device)
    return runner


def _own_code(function: Callable, name: str) -> Callable:
    """``function`` with a code object of its own named ``name``, for Dynamo to compile and cache apart."""
    # co_qualname exists from Python 3.11 on
    names = {"co_name": name, **({"co_qualname": name} if hasattr(function.__code__, "co_qualname") else {})}
    return types.FunctionType(function.__code__.replace(**names), function.__globals__, name)


def _compiled_version(cache: dict, key, function: Callable, name: str) -> Callable:
    """The compiled ``function`` kept under ``key``. Each key gets a code object of its own:
    Dynamo keeps, and caps, the graphs per code object, so plans sharing one would crowd each
    other out of that cap in a process that uses many of them."""
    compiled = cache.get(key)
    if compiled is None:
        own = _own_code(function, f"{name}_{len(cache)}")
        # dynamic: the rows of a chunk (and V, and a term's widths) vary without recompiling
        compiled = cache[key] = torch.compile(own, dynamic=True, fullgraph=True)
    return compiled


class BodyRunner:
    """How the chunk loop runs its bodies on ``device``: the body asked (``auto``, ``eager`` or
    ``compiled``) as :func:`~fairseq_agg.ops.output_kernel.resolve_body` resolves it there; under
    ``auto`` a failed compilation falls back to eager once and for all (said in the log)."""

    def __init__(self, body: str, device: torch.device):
        self.asked, self.device = body, device
        self.body = resolve_body(body, device)
        # torch's private config modules, looked up only when the compiled body is chosen
        self.settings = private_compile_settings() if self.body == "compiled" else None

    def __call__(self, plan: BodyPlan, *args) -> RowValues:
        if self.body == "compiled" and self.asked == "auto":
            try:
                return self._run(plan, args)
            except Exception as error:  # noqa: BLE001 - any compiler failure: the eager body is the same math
                note_compile_failure(self.device, error)
                self.body = "eager"
        return self._run(plan, args)

    def _compile_settings(self):
        """Dynamo's settings for the chunk body: no duck sizing, which would tie sizes that happen to
        be equal in the first call (a chunk's rows and the batch's, a width of 2) and compile again
        when they differ; and room for a process's many plans under Dynamo's cap on all its graphs."""
        dynamo_config, fx_config = self.settings
        stack = contextlib.ExitStack()
        stack.enter_context(dynamo_config.patch(accumulated_recompile_limit=MAX_GRAPHS))
        stack.enter_context(fx_config.patch(use_duck_shape=False))
        return stack

    def _run(self, plan, args):
        if self.body == "eager":
            return chunk_body(plan, *args)
        with self._compile_settings():
            return _compiled_version(_compiled, plan, chunk_body, "chunk_body")(plan, *args)

    def in_place(self, function: Callable, grad: torch.Tensor, inputs_of: Callable, eager_block: int):
        """The static in-place ``function(grad_rows, inputs)`` over a written chunk gradient, with
        ``inputs_of(rows)`` the inputs of those rows: over the whole chunk compiled, or eager
        through blocks of ``eager_block`` rows (the eager body's cache-sized blocks) so that its
        temporaries stay small."""
        if self.body == "compiled":
            compiled = _compiled_version(_compiled_in_place, function, function, function.__name__)
            with self._compile_settings():
                compiled(grad, inputs_of(slice(0, grad.size(0))))
            return
        for start in range(0, grad.size(0), eager_block):
            rows = slice(start, start + eager_block)
            function(grad[rows], inputs_of(rows))
