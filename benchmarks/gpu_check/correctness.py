"""Part 1 of the GPU check: the package's fused output layer against the reference constructions
(tests/support/reference_constructions.py), evaluated in float64 on the same rounded inputs, for
CE, AGG (eps 0 and 0.1) and the augmented loss, in fp32 and bf16: loss, NLL, dH and dW."""
import math

import torch

from benchmarks import ops
from benchmarks.gpu_check.plan import TOLERANCE, Plan
from tests.support.output_layer_problem import DTYPES, PAD, OutputProblem, rel_diff
from tests.support.reference_constructions import reference_output_loss, reference_teacher

# case, label smoothing, AGG's gates, the augmented loss
CASES = [("CE", 0.0, False, False), ("AGG eps=0", 0.0, True, False), ("AGG eps=0.1", 0.1, True, False),
         ("AL", 0.0, False, True)]


def _errors(problem, dtype, case, chunk, al):
    """The relative errors of one case in ``dtype`` against float64, and the float64 dW."""
    _, eps, use_gates, use_al = case
    target, gates = problem.target, problem.gates() if use_gates else None
    h_in, w_in = problem.hidden.detach().to(dtype), problem.weight.detach().to(dtype)
    h, w = h_in.clone().requires_grad_(True), w_in.clone().requires_grad_(True)
    teacher = ops.teacher(w.detach(), target, al["tau"], al["coef"], PAD) if use_al else None
    loss, nll = ops.fused_loss(h, w, target, eps, chunk, gates=gates, teacher=teacher)
    loss.backward()
    h64, w64 = h_in.double().requires_grad_(True), w_in.double().requires_grad_(True)
    kwargs = {}
    if use_al:
        kwargs = dict(teacher_probs=reference_teacher(w64.detach(), target, al["tau"], masked_columns=[PAD]),
                      tau=al["tau"], coef=al["coef"])
    ref_loss, ref_nll, _ = reference_output_loss(h64, w64, target, eps, gates=gates, **kwargs)
    ref_loss.backward()
    errors = {"loss": rel_diff(loss, ref_loss), "nll": rel_diff(nll, ref_nll),
              "dH": rel_diff(h.grad, h64.grad), "dW": rel_diff(w.grad, w64.grad)}
    return errors, w64.grad


def part_correctness(plan: Plan, device: torch.device):
    n, d, v = plan.check_shape
    # float64 inputs, rounded to each dtype; a window of 4 updates and alpha 1 so that a good
    # share of the targets is rare and some have g2 < 1
    problem = OutputProblem(n, d, v, dtype=torch.float64, device=device, window_updates=4, agg_alpha=1.0)
    stats, al = problem.target_stats(), ops.augmented_defaults()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    rows, dw_by_case = [], {}
    for dtype_name in ("fp32", "bf16"):
        for case in CASES:
            errors, dw_by_case[(case[0], dtype_name)] = _errors(problem, DTYPES[dtype_name], case, plan.check_chunk, al)
            tol = TOLERANCE[dtype_name]
            finite = all(math.isfinite(x) for x in errors.values())
            rows.append({"case": case[0], "dtype": dtype_name, **{k: float(f"{x:.3e}") for k, x in errors.items()},
                         "tolerance": tol, "passed": finite and max(errors.values()) <= tol})
    passed = all(r["passed"] for r in rows)
    # the gating must change dW (else the AGG cases would test nothing)
    agg_vs_ce = rel_diff(dw_by_case[("AGG eps=0", "fp32")], dw_by_case[("CE", "fp32")])
    return {"status": "ok" if passed else "failed", "passed": passed, "cases": rows,
            "shape": {"N": n, "d": d, "V": v, "chunk": plan.check_chunk},
            "rare_target_fraction": stats["rare_target_frac"],
            "g2_below_one_target_fraction": stats["very_rare_target_frac"], "aug": al, "tolerance": TOLERANCE,
            "reference": "tests/support/reference_constructions.py in float64 on the same rounded inputs",
            "output_path": ops.describe_path("auto", device),  # what kernel "auto" ran (compiled, or why eager)
            "agg_vs_ce_dW_rel": float(f"{agg_vs_ce:.3e}")}
