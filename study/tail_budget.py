"""The tail part's comparison with the same runs at another budget (``--compare-budget``,
docs/study.md, "AGG's operating point"), from both budgets' result.json files alone: each metric's
difference to the baseline at both budgets, whether each claim's verdict survives the other budget,
and the baseline's convergence at each (:func:`write_budget_comparison`)."""
import os
from typing import Dict, List, Optional

from study.columns import metric
from study.harness.tables import markdown_table, write_json
from study.report import summarise
from study.tail_claims import CLAIMS, claims
from study.tail_tables import CONVERGENCE_HEADERS, columns, convergence_cells, run_convergence

COMPARED_SEED = 1  # the seed both budgets have (the longer budget trains only the first)
# compared across budgets besides every word list's ρ and every metric a claim is judged on
COMPARED_METRICS = ("test_ppl", "test_ppl_rare", "isotropy", "mean_cos")
BUDGET_COMPARISON_JSON = "budget_comparison.json"
SIDES = ("first", "second")  # the budgets: this work dir's, --compare-budget's


def compared_columns(results):
    """The (key, header, digits, getter) columns of the part's table (:func:`study.tail_tables.columns`)
    compared across budgets."""
    keys = set(COMPARED_METRICS) | {key for _, _, key, _, _ in CLAIMS}
    return [c for c in columns(metric, results) if c[0] in keys or c[0].startswith("ws_")]


def budget_label(results) -> str:
    """A budget named by its runs' updates, e.g. "3,000 updates"."""
    return " / ".join(f"{u:,}" for u in sorted({r["updates"] for r in results})) + " updates"


def runs_of_seed(results, seed=COMPARED_SEED) -> Dict[str, dict]:
    """{run name: its result at ``seed``}, in the order of ``results``."""
    return {r["name"]: r for r in results if r["seed"] == seed}


def _minus(a, b):
    return None if a is None or b is None else a - b


def _sign(x):
    return (x > 0) - (x < 0)


def metric_differences(first: Dict[str, dict], second: Dict[str, dict], cols) -> dict:
    """The baseline's values and every other run's difference to the baseline of the same budget
    and seed, at both budgets (``first``, ``second``: :func:`runs_of_seed` of each) and the change
    between them: {"baseline": {key: {"first", "second"}}, "runs": {name: {key: {"first", "second",
    "change"}}}} for the runs at both budgets; None where a value is missing."""
    base = (first.get("baseline"), second.get("baseline"))
    out = {"baseline": {key: {"first": get(base[0]) if base[0] else None,
                              "second": get(base[1]) if base[1] else None} for key, _, _, get in cols},
           "runs": {}}
    for name in (n for n in first if n in second and n != "baseline"):
        diffs = out["runs"][name] = {}
        for key, _, _, get in cols:
            d1 = _minus(get(first[name]), out["baseline"][key]["first"])
            d2 = _minus(get(second[name]), out["baseline"][key]["second"])
            diffs[key] = {"first": d1, "second": d2, "change": _minus(d2, d1)}
    return out


def survival(expected: str, first: Optional[dict], second: Optional[dict], labels) -> dict:
    """Whether a claim's verdict is the same at both budgets ("survives more budget").

    ``first``, ``second``: the claim at each budget ({"exceeds", "verdict", "seed_diff"}: the report's
    :func:`claims` entry and the run − other difference at :data:`COMPARED_SEED`), None where not
    measured; ``labels``: the budgets' names. The verdicts are compared only where both judged the
    seed spread (two seeds on both sides, the report's rule); otherwise only the direction of the
    seed's difference can be, and a claim of no difference cannot be judged at all.
    Returns {"survives": True / False / None, "basis": "verdict" / "direction" / None, "text"}."""
    if first is None or second is None:
        where = " and ".join(label for label, c in zip(labels, (first, second)) if c is None)
        return {"survives": None, "basis": None, "text": f"not measured at {where}"}
    if first["exceeds"] is not None and second["exceeds"] is not None:
        same = first["verdict"] == second["verdict"]
        return {"survives": same, "basis": "verdict", "text": "yes" if same else "**no**"}
    why = " and ".join(label for label, c in zip(labels, (first, second)) if c["exceeds"] is None)
    why = f"one seed at {why}: no spread to judge"
    if expected == "same":
        return {"survives": None, "basis": None, "text": f"cannot tell ({why})"}
    d1, d2 = first["seed_diff"], second["seed_diff"]
    if d1 is None or d2 is None:
        return {"survives": None, "basis": None, "text": f"not measured at seed {COMPARED_SEED}"}
    same = _sign(d1) == _sign(d2)
    return {"survives": same, "basis": "direction",
            "text": f"{'yes' if same else '**no**'}, in direction only (seed {COMPARED_SEED}; {why})"}


def _claims_by_id(part, results, cols) -> Dict[tuple, dict]:
    """The report's :func:`claims` of one budget's results (all its seeds), by (claim, run, key, other)."""
    names = list(dict.fromkeys(r["name"] for r in results))
    by_name = {n: sorted((r for r in results if r["name"] == n), key=lambda r: r["seed"]) for n in names}
    summary, _ = summarise(part, names, by_name, cols, {})
    return {(c["claim"], c["run"], c["key"], c["other"]): c for c in claims(summary)}


def claim_comparison(part, first_results, second_results, cols, labels) -> dict:
    """{"compared": [...], "not_compared": [...]}: every claim whose runs have seed
    :data:`COMPARED_SEED` at both budgets, with its verdict at each budget (over that budget's seeds,
    as the report makes it), the seed's difference (run − other) at each and :func:`survival`; and
    every claim whose runs have it at one budget only, with {"first" / "second": the runs missing there}."""
    runs = (runs_of_seed(first_results), runs_of_seed(second_results))
    found = (_claims_by_id(part, first_results, cols), _claims_by_id(part, second_results, cols))
    getter = {key: get for key, _, _, get in cols}
    compared, not_compared = [], []
    for text, run, key, expected, other in CLAIMS:
        missing = {side: [n for n in (run, other) if n not in seed_runs] for side, seed_runs in zip(SIDES, runs)}
        entry = {"claim": text, "run": run, "key": key, "expected": expected, "other": other}
        if all(missing.values()) or key not in getter:  # runs or metric at neither budget: no claim of either
            continue
        if any(missing.values()):
            not_compared.append(dict(entry, missing={side: ns for side, ns in missing.items() if ns}))
            continue
        at = []
        for seed_runs, by_id in zip(runs, found):
            c = by_id.get((text, run, key, other))
            at.append(None if c is None else {
                "verdict": c["verdict"], "exceeds": c["exceeds"], "diff": c["diff"],
                "seeds": {run: c["seeds_run"], other: c["seeds_other"]},
                "seed_diff": _minus(getter[key](seed_runs[run]), getter[key](seed_runs[other]))})
        if at == [None, None]:  # not measured at either budget
            continue
        compared.append(dict(entry, first=at[0], second=at[1], **survival(expected, at[0], at[1], labels)))
    return {"compared": compared, "not_compared": not_compared}


def budget_comparison(part, first_results, second_results, first_dir, second_dir) -> dict:
    """The comparison of two budgets of the part (what ``--compare-budget`` writes to
    :data:`BUDGET_COMPARISON_JSON`), from their results alone: at :data:`COMPARED_SEED`, each metric's
    difference to the baseline at each budget and its change, the runs at one budget only, every
    claim's verdict at both (:func:`claim_comparison`), and the baseline's convergence at each."""
    labels = (budget_label(first_results), budget_label(second_results))
    cols = compared_columns(first_results + second_results)
    first, second = runs_of_seed(first_results), runs_of_seed(second_results)
    baselines = [[r for r in results if r["name"] == "baseline"] for results in (first_results, second_results)]
    return {
        "seed": COMPARED_SEED,
        "budgets": {side: {"label": label, "work_dir": work_dir}
                    for side, label, work_dir in zip(SIDES, labels, (first_dir, second_dir))},
        "metrics": [{"key": key, "header": header, "digits": digits} for key, header, digits, _ in cols],
        "differences": metric_differences(first, second, cols),
        "missing": {"first": [n for n in second if n not in first], "second": [n for n in first if n not in second]},
        "claims": claim_comparison(part, first_results, second_results, cols, labels),
        "baseline_convergence": [{"budget": label, "seed": r["seed"], "convergence": run_convergence(r)}
                                 for label, rs in zip(labels, baselines) for r in rs],
    }


def _signed(x, digits):
    return "-" if x is None else f"{x:+.{digits}f}"


def _plain(x, digits):
    return "-" if x is None else f"{x:.{digits}f}"


def _verdict_cell(at):
    if at is None:
        return "not measured"
    return f"{at['verdict']} (seeds {' / '.join(str(n) for n in at['seeds'].values())})"


def budget_comparison_section(comparison) -> List[str]:
    """table.md's section of a :func:`budget_comparison`."""
    label = {side: b["label"] for side, b in comparison["budgets"].items()}
    b1, b2 = label["first"], label["second"]
    seed, diffs = comparison["seed"], comparison["differences"]
    rows = []
    for name, by_key in diffs["runs"].items():
        for m in comparison["metrics"]:
            key, digits = m["key"], m["digits"]
            base, d = diffs["baseline"][key], by_key[key]
            rows.append([name, m["header"], _plain(base["first"], digits), _signed(d["first"], digits),
                         _plain(base["second"], digits), _signed(d["second"], digits), _signed(d["change"], digits)])
    missing = comparison["missing"]
    lines = [f"### Budget comparison: {b1} ({comparison['budgets']['first']['work_dir']}) and {b2} "
             f"({comparison['budgets']['second']['work_dir']})", "",
             f"Seed {seed} at both budgets. Δ = the run's value − the baseline's at the same budget and seed; "
             f"change = Δ at {b2} − Δ at {b1}.", ""]
    if not diffs["runs"]:
        lines += [f"(no run besides the baseline has seed {seed} at both budgets, or the baseline lacks it at one)", ""]
    else:
        lines += [markdown_table(["run", "metric", f"baseline, {b1}", f"Δ, {b1}", f"baseline, {b2}", f"Δ, {b2}",
                                  "change of Δ"], rows), ""]
    lines += [f"Runs with seed {seed} at one budget only (not compared): at {b1} only: "
              f"{', '.join(missing['second']) or 'none'}; at {b2} only: {', '.join(missing['first']) or 'none'}.", ""]
    found = comparison["claims"]
    if found["compared"]:
        digits = {m["key"]: m["digits"] for m in comparison["metrics"]}
        rows = [[c["claim"], f"{c['run']} − {c['other']}: {c['key']}", _verdict_cell(c["first"]),
                 _verdict_cell(c["second"]),
                 " → ".join(_signed(c[side] and c[side]["seed_diff"], digits[c["key"]]) for side in SIDES), c["text"]]
                for c in found["compared"]]
        lines += ["#### Claims at both budgets", "",
                  markdown_table(["claim (source)", "compared", f"verdict at {b1} (seeds run / other)",
                                  f"verdict at {b2} (seeds run / other)", f"seed {seed}: run − other, {b1} → {b2}",
                                  "same verdict at both budgets?"], rows), "",
                  "Verdicts as in the claims table, each over its budget's seeds. The verdicts themselves are "
                  "compared only where both budgets judged the seed spread (two seeds on both sides); otherwise "
                  f"only the direction of seed {seed}'s difference is, and a claim of no difference cannot be "
                  "judged.", ""]
    if found["not_compared"]:
        lines += ["Claims measured at one budget only (not compared): " + "; ".join(
            f"{c['run']} − {c['other']}: {c['key']} (" + ", ".join(
                f"no seed {seed} of {' '.join(ns)} at {label[side]}" for side, ns in c["missing"].items()) + ")"
            for c in found["not_compared"]) + ".", ""]
    lines += ["#### The baseline's convergence at each budget (valid PPL over the last fifth of training)", "",
              markdown_table(["budget"] + CONVERGENCE_HEADERS,
                             [[c["budget"], "baseline", c["seed"]] + convergence_cells(c["convergence"])
                              for c in comparison["baseline_convergence"]]), ""]
    return lines


def write_budget_comparison(part, first_results, second_results, first_dir, second_dir, out_dir) -> str:
    """``--compare-budget``: appends the comparison's section to out_dir/table.md (made by the report
    just before) and writes it to out_dir/:data:`BUDGET_COMPARISON_JSON`; returns that path."""
    comparison = budget_comparison(part, first_results, second_results, first_dir, second_dir)
    with open(os.path.join(out_dir, "table.md"), "a", encoding="utf-8") as f:
        f.write("\n" + "\n".join(budget_comparison_section(comparison)) + "\n")
    path = os.path.join(out_dir, BUDGET_COMPARISON_JSON)
    write_json(path, comparison)
    return path
