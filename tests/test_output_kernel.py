"""The fused output layer's chunk body, compiled (torch.compile, Inductor's C++ on this CPU) against
the same body run eagerly and against float64 references, for every method; the compiled graphs'
count over varying batch sizes; and the generated code's structure: one kernel per chunk body, and
in bf16 no fp32 chunk x V buffer.

The other test files exercise the default kernel (``auto``, compiled on this CPU) against the
methods' formula references; this file pins the two paths to each other and to float64.
"""
import contextlib
import re
import sys
import types

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from fairseq_agg.ops import (
    FaceWeights, FrozenRows, LossRequest, agg_gates, body_runner, build_teacher, fused_linear_loss, output_kernel,
    unlikelihood_candidates,
)
from fairseq_agg.ops.fused_linear_loss import chunk_bounds
from fairseq_agg.ops.output_chunk import Tile
from reference_constructions import gate_matrix

pytestmark = pytest.mark.skipif(output_kernel.compile_unavailable(torch.device("cpu")) is not None,
                                reason=str(output_kernel.compile_unavailable(torch.device("cpu"))))

N, D, V, CHUNK, T = 37, 8, 53, 16, 6  # rows not a multiple of the chunk; UL sequences of T tokens (padded)
PAD, NSPECIAL = 1, 4
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class Problem:
    """Leaves in ``dtype`` made from the same float64 draw, targets with rare and unseen types, and
    every method's inputs."""

    def __init__(self, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.hidden64 = torch.randn(N, D, generator=g, dtype=torch.float64)
        self.weight64 = torch.randn(V, D, generator=g, dtype=torch.float64) * D**-0.5 * 4
        padded = torch.randint(NSPECIAL, V, (N // T + 1, T), generator=g)
        padded[-1, N % T:] = PAD
        self.padded = padded
        self.keep = padded.reshape(-1).ne(PAD).nonzero().squeeze(1)
        self.target = padded.reshape(-1)[self.keep]
        counts = torch.randint(0, 40, (V,), generator=g)
        counts[V - 8:] = 0  # never seen: g1 = g2 = 0
        self.counts = counts
        self.gates = agg_gates(counts, 10, 1.0, NSPECIAL)
        assert self.gates.rare[self.target].any() and (~self.gates.rare[self.target]).any()

    def leaves(self):
        return (self.hidden64.to(self.dtype, copy=True).requires_grad_(True),
                self.weight64.to(self.dtype, copy=True).requires_grad_(True))

    def request(self, case, kernel, per_token=False):
        terms = []
        methods = case.split("+")
        if "agg" in methods:
            terms.append(self.gates)
        if "freeze" in methods:
            terms.append(FrozenRows(self.gates.rare))
        if "al" in methods or "algated" in methods:
            terms.append(build_teacher(self.weight64.to(self.dtype), self.target, 2.0, 0.7,
                                       masked_columns=[PAD], gate_with_agg="algated" in methods))
        if "facepre" in methods:
            terms.append(FaceWeights(token_weight=torch.rand(V, generator=torch.Generator().manual_seed(3))))
        if "facepost" in methods:
            terms.append(FaceWeights(counts=self.counts))
        if "ul" in methods:
            terms.append(unlikelihood_candidates(self.padded, self.keep, PAD, alpha=0.8))
        return LossRequest(0.1 if "ls" in methods else 0.0, terms=tuple(terms), chunk_size=CHUNK,
                           per_token=per_token, kernel=kernel)

    def run(self, case, kernel, per_token=False):
        """{name: loss, nll and each term's logged value}, dH, dW, the penalty candidates (or None)
        and the argmax where recorded."""
        hidden, weight = self.leaves()
        out = fused_linear_loss(hidden, weight, self.target, self.request(case, kernel, per_token))
        upstream = torch.linspace(0.5, 2.0, N, dtype=out.loss.dtype) if per_token else 1.0
        (out.loss * upstream).sum().backward()
        values = {"loss": out.loss.detach(), "nll": out.nll}
        values.update({f"{term}.{name}": value for term, logged in out.terms.items() for name, value in logged.items()
                       if (term, name) != ("unlikelihood", "candidates")})
        candidates = out.terms.get("unlikelihood", {}).get("candidates")
        return values, hidden.grad, weight.grad, candidates, out.argmax


CASES = ["ce", "ls", "agg", "agg+ls", "freeze", "al", "agg+al", "agg+algated+ls", "facepre", "facepost", "ul",
         "ul+ls+agg"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_compiled_body_equals_eager_and_float64(case, dtype):
    problem = Problem(dtype)
    compiled = problem.run(case, "compiled")
    eager = problem.run(case, "eager")
    reference = Problem(torch.float64).run(case, "eager")
    tol = TOLERANCE[dtype]
    assert compiled[0].keys() == eager[0].keys() == reference[0].keys()
    for name, want in reference[0].items():
        if want.abs().max() > 0:
            assert rel(compiled[0][name], want) <= tol, (name, rel(compiled[0][name], want))
    assert rel(compiled[1], reference[1]) <= tol and rel(compiled[2], reference[2]) <= tol
    assert (compiled[3] is None) == (reference[3] is None) == ("ul" not in case)
    if compiled[3] is not None:
        assert int(compiled[3]) == int(reference[3]) == int(eager[3])  # penalty candidates
    if compiled[4] is not None:  # FACE's argmax: the same rows, up to ties under rounding
        assert (compiled[4] == reference[4]).float().mean() >= (1.0 if dtype != torch.bfloat16 else 0.8)
    # the two paths of the same dtype agree at least as well as either agrees with float64
    same = 1e-12 if dtype == torch.float64 else tol
    for got, want in zip([*compiled[0].values(), compiled[1], compiled[2]], [*eager[0].values(), eager[1], eager[2]]):
        if want.abs().max() > 0:
            assert rel(got, want) <= same


@pytest.mark.parametrize("case", ["ls", "agg+al", "ul+ls", "facepost"])
def test_per_token_losses_and_their_gradients_compiled(case):
    problem = Problem(torch.float32)
    compiled, eager = problem.run(case, "compiled", per_token=True), problem.run(case, "eager", per_token=True)
    reference = Problem(torch.float64).run(case, "eager", per_token=True)
    assert compiled[0]["loss"].shape == (N,)
    for got, want in [(compiled[0]["loss"], reference[0]["loss"]), (compiled[0]["nll"], reference[0]["nll"]),
                      (compiled[1], reference[1]), (compiled[2], reference[2])]:
        assert rel(got, want) <= 2e-5
    assert rel(compiled[1], eager[1]) <= 2e-5 and rel(compiled[2], eager[2]) <= 2e-5


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("kernel", ["compiled", "eager"])
def test_agg_against_its_formula_in_float64(kernel, epsilon):
    """AGG on full float64 logits, by its formula: loss = -sum Q log softmax(Z), G = softmax(Z) - Q
    (fairseq's smoothing), dH = G W, dW = (Gamma * G)^T H (docs/agg.md (A5)-(A6)); to 1e-12."""
    problem = Problem(torch.float64)
    hidden, weight = problem.leaves()
    out = fused_linear_loss(hidden, weight, problem.target, problem.request("agg+ls" if epsilon else "agg", kernel))
    out.loss.backward()
    h, w, y = problem.hidden64, problem.weight64, problem.target
    z = h @ w.t()
    q = torch.full_like(z, epsilon / (V - 1)).scatter_(1, y.unsqueeze(1), 1 - epsilon)
    loss = -(q * torch.log_softmax(z, dim=1)).sum()
    g = torch.softmax(z, dim=1) - q
    assert rel(out.loss, loss) <= 1e-12
    assert rel(hidden.grad, g @ w) <= 1e-12
    assert rel(weight.grad, (gate_matrix(y, problem.gates).double() * g).t() @ h) <= 1e-12


def test_gate_factor_is_the_hand_written_gate_matrix():
    problem = Problem(torch.float64)
    z = torch.randn(N, V, dtype=torch.float64)
    tile = Tile(z, problem.target, torch.float64, with_argmax=False)
    inputs = problem.gates.tile_inputs(slice(0, N), problem.target, torch.float64)
    gamma = gate_matrix(problem.target, problem.gates).double()
    assert torch.equal(problem.gates.tile(tile, inputs).factor.double(), gamma)  # the body's factor
    in_place = z.clone()
    problem.gates.gate_in_place(in_place, problem.target)  # the pass after dH (on a CPU)
    assert torch.equal(in_place, gamma * z)


@contextlib.contextmanager
def _own_compiled_bodies():
    """Compiled bodies and gate passes of this test's own (new code objects, so Dynamo compiles them afresh and
    counts their graphs), without resetting Dynamo or dropping the bodies the rest of the process
    compiled: those are put back afterwards, so no later test compiles them again."""
    caches = (body_runner._compiled, body_runner._compiled_in_place)
    kept = [dict(cache) for cache in caches]
    for cache in caches:
        cache.clear()
    try:
        yield
    finally:
        for cache, entries in zip(caches, kept):
            cache.clear()
            cache.update(entries)


def _graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_twenty_batch_sizes_compile_at_most_two_graphs_per_dtype():
    """No recompilation across batch sizes: one dynamic graph per dtype, a second only for a batch
    of a single target (a compiled body specialises on a size of 1; the chunking never leaves a
    one-row chunk after others)."""
    g = torch.Generator().manual_seed(5)
    # 20 distinct N for chunks of 64: 65, 129 and 257 have a one-row remainder; the last is a single target
    sizes = [2, 3, 7, 16, 31, 63, 64, 65, 100, 127, 128, 129, 150, 191, 200, 255, 256, 257, 300, 1]
    for dtype in (torch.float32, torch.bfloat16):
        with _own_compiled_bodies():
            before = _graphs()
            for n in sizes:
                hidden = torch.randn(n, D, generator=g).to(dtype).requires_grad_(True)
                weight = torch.randn(V, D, generator=g).to(dtype).requires_grad_(True)
                target = torch.randint(NSPECIAL, V, (n,), generator=g)
                request = LossRequest(0.1, chunk_size=64, kernel="compiled")
                fused_linear_loss(hidden, weight, target, request).loss.backward()
                if n == sizes[-2]:
                    assert _graphs() - before == 1, (dtype, n)
            assert _graphs() - before == 2, dtype


def test_chunk_bounds_never_leave_a_single_row_after_others():
    assert chunk_bounds(129, 64) == [(0, 64), (64, 127), (127, 129)]
    assert chunk_bounds(128, 64) == [(0, 64), (64, 128)]
    assert chunk_bounds(1, 64) == [(0, 1)]
    assert chunk_bounds(5, 1) == [(i, i + 1) for i in range(5)]


def _generated_code(case, dtype):
    """The code Inductor generates for one forward + backward of ``case``, compiled afresh."""
    problem = Problem(dtype)

    def step():
        hidden, weight = problem.leaves()
        fused_linear_loss(hidden, weight, problem.target, problem.request(case, "compiled")).loss.backward()

    with _own_compiled_bodies(), torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(step)
    return codes


def _symbol_values(code):
    """{symbol: its value in the compiled call} from the module's ``call`` and ``get_args``."""
    binding = dict(re.findall(r"(s\d+) = (arg\d+_1)\n", code))
    values = dict(re.findall(r"(arg\d+_1) = (\d+)\n", code))
    return {sym: int(values[arg]) for sym, arg in binding.items() if arg in values}


@pytest.mark.parametrize("case", ["ls", "agg+ls", "al", "agg+al", "facepost", "ul"])
def test_generated_code_is_one_kernel_without_fp32_chunk_by_vocab_buffers(case):
    codes = _generated_code(case, torch.bfloat16)
    # one graph, the chunk body (the matmuls stay outside, in MKL); on a CPU AGG's gate is a second
    # graph, an in-place pass after dH (fused_linear_loss.gate_after_dh), except with a teacher
    # kept apart from the gate, whose body writes G and G_w
    gate_pass = case == "agg+ls"
    assert len(codes) == (2 if gate_pass else 1)
    for code in codes:
        kernels = set(re.findall(r"\b(cpp_fused_\w+)\(", code))
        assert len(kernels) == 1, sorted(kernels)
        symbols = _symbol_values(code)
        assert V in symbols.values(), "the vocabulary's symbol was not found in the generated module"
        for shape, dtype in re.findall(r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", code):
            dims = [d.strip() for d in shape.split(",") if d.strip()]
            if dtype == "float32" and len(dims) == 2:
                assert symbols.get(dims[1]) != V, f"an fp32 rows x V buffer ({shape}) in the bf16 code of {case}"


@pytest.mark.parametrize("private_config", [None, types.SimpleNamespace(__name__="torch.fx.experimental._config")],
                         ids=["module-missing", "setting-missing"])
def test_a_torch_without_the_compiled_bodys_settings_runs_eager_and_says_why(monkeypatch, private_config):
    # the private settings the compiled body patches are looked up when it is asked for, never at
    # import: a torch that lacks them (another version) runs the eager body, and says why
    monkeypatch.setitem(sys.modules, "torch.fx.experimental._config", private_config)
    cpu = torch.device("cpu")
    reason = output_kernel.compile_unavailable(cpu)
    assert reason.startswith(f"torch {torch.__version__} ") and "torch.fx.experimental._config" in reason
    assert output_kernel.resolve_body("auto", cpu) == "eager"
    assert output_kernel.describe("auto", cpu) == f"eager chunk body ({reason})"
    with pytest.raises(RuntimeError, match="output kernel 'compiled' is not available on cpu"):
        output_kernel.resolve_body("compiled", cpu)
