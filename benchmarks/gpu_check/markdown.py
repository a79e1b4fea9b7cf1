"""The GPU check's report as Markdown (gpu_check.md), one function per section."""
from benchmarks.gpu_check.output_ratios import DEFAULT_PATH, entry_key, ratio
from benchmarks.gpu_check.train_flags import run_key
from benchmarks.ops import FOREIGN_KERNELS


def _fmt(x, digits=3):
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-2 and x != 0 else f"{x:,.{digits}f}".rstrip("0").rstrip(".")
    return str(x)


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def train_runs_table(part, name_header, baseline):
    """A training part's precisions fairseq cannot train at, then one row per run (a size column
    where the runs have sizes) with its ratios against ``baseline``, the run they are taken against."""
    out = [f"Not run at {precision}: {reason}.\n\n" for precision, reason in part.get("not_runnable", {}).items()]
    sized = any("size" in r for r in part["runs"])
    rows = []
    for r in part["runs"]:
        r_ratio = part["ratios"].get(run_key(r), {})
        rows.append([r["precision"], *([r.get("size")] if sized else []), r["name"], r.get("wps"), r.get("peak_mib"),
                     r_ratio.get("wps_vs_stock"), r_ratio.get("memory_vs_stock"), r.get("loss_last"),
                     r.get("output_layer") or "–", r.get("error") or r.get("skipped") or "ok"])
    out.append(_table(["precision", *(["size"] if sized else []), name_header, "words/s", "peak MiB",
                       f"wps / {baseline}", f"memory / {baseline}", "last loss", "output layer (from the log)",
                       "status"], rows))
    return "".join(out)


def _section(out, parts, title, name):
    """The section's heading and status; the part, or None where it did not run."""
    part = parts.get(name)
    out.append(f"\n## {title}\n")
    if part is None:
        out.append("not run\n")
        return None
    out.append(f"status: **{part['status']}** ({part.get('seconds')} s)\n")
    if "error" in part:
        out.append(f"\n```\n{part['error']}\n```\n")
    if "reason" in part:
        out.append(f"{part['reason']}\n")
    return part


def _header(data):
    meta = data["meta"]
    out = [f"# Accelerator check ({meta['mode']})\n",
           f"{meta['date']} · {meta['device']} · torch {meta['torch']} · CUDA {meta.get('cuda') or '–'} · "
           f"Python {meta['python']} · fairseq {meta.get('fairseq')} · fairseq-agg {meta['fairseq_agg']}\n",
           f"Command: `{meta['command']}`\n"]
    if "error" in data:
        out.append(f"\n**Not run: {data['error']}**\n")
    if meta["mode"] != "gpu":
        out.append("CPU smoke run: tiny shapes, the same code paths; times and ratios mean nothing here.\n")
    install = data.get("install")
    if install:
        out.append(f"Install: {install.get('status')} in {install.get('seconds')} s ({install.get('note', '')})\n")
    return out


def _correctness(out, part):
    out.append(f"\nN={part['shape']['N']}, d={part['shape']['d']}, V={part['shape']['V']}, chunk "
               f"{part['shape']['chunk']}; rare targets {part['rare_target_fraction']:.1%}; AGG vs CE dW "
               f"differ by {part['agg_vs_ce_dW_rel']:.2g} (relative); reference: {part['reference']}; "
               f"fused layer on its default path: {part.get('output_path', '–')}.\n\n")
    out.append(_table(["case", "dtype", "loss", "nll", "dH", "dW", "tolerance", "passed"],
                      [[r["case"], r["dtype"], r["loss"], r["nll"], r["dH"], r["dW"], r["tolerance"], r["passed"]]
                       for r in part["cases"]]))


def _output_run(out, key, entry):
    out.append(f"\n### {key}: N={entry['N']}, d={entry['d']}, V={entry['V']}, eps={entry['eps']} "
               f"(rare targets {entry['rare_target_fraction']:.1%}, {entry['unique_targets']} unique)\n\n")
    v = entry["variants"]
    anchor = {name: v.get(str(entry_key(entry["eps"], name)), {}) for name in ("stock", "liger", "floor")}
    best = entry["ratios"].get("torch_best")
    best_ms = {**v, **entry["sweep"]}.get(best, {}).get("median_ms")
    rows = []
    for name, m in v.items():
        ms, peak = m.get("median_ms"), m.get("peak_mib")
        rows.append([name, ms, peak, ratio(ms, anchor["stock"].get("median_ms")), ratio(ms, best_ms),
                     ratio(ms, anchor["floor"].get("median_ms")), ratio(ms, anchor["liger"].get("median_ms")),
                     ratio(peak, anchor["stock"].get("peak_mib")), m.get("first_call_ms"),
                     m.get("loss", m.get("error") or m.get("skipped"))])
    speedups = {name: entry["ratios"].get(f"{name}_speedup_vs_eager") for name in DEFAULT_PATH}
    speedups = ", ".join(f"{name} {'–' if x is None else _fmt(x) + 'x'}" for name, x in speedups.items())
    out.append(f"torch's fastest variant here: {best or '–'}. Default path here: {entry.get('auto_path', '–')}; its "
               f"speed-up over the eager chunk body (eager ms / default ms): {speedups}. AL / its own floor (the "
               f"three matmuls and the teacher's): {_fmt(entry['ratios'].get('al_time_vs_al_floor'))}.\n\n")
    out.append(_table(["variant", "median ms", "peak MiB", "time / stock", "time / torch best", "time / floor",
                       "time / Liger", "memory / stock", "first call ms", "loss"], rows))
    if entry["sweep"]:
        out.append("\nChunk sweep (median ms / peak MiB): " + ", ".join(
            f"{k} {_fmt(m.get('median_ms'))} / {_fmt(m.get('peak_mib'))}" for k, m in entry["sweep"].items())
            + "; fastest chunk: " + ", ".join(f"{k} {c}" for k, c in entry["best_chunk"].items()) + "\n")


def _output_layer(out, part):
    out.append(f"\nDefault chunk {part['default_chunk']}; Liger: {part['liger']}; CCE: {part.get('cce')}; "
               f"torch: {part.get('torch')}; floor: the three matmuls alone (logits, dH, dW) at the default "
               f"chunk; timing: {part['timing']}; memory: {part['memory']}. Keys name[+ls][:kernel][@chunk] "
               "(benchmarks/variants.py): +ls at the shape's label smoothing.\n")
    kernels = part.get("package_kernels", {})
    out.append(f"\nThe package's paths: `fused_ce`, `agg`, `al` = the default, kernel auto: "
               f"{part.get('auto_path', '–')}; `name:eager` = {kernels.get('eager', '–')}; "
               + "; ".join(f"`name:{k}` = {kernels.get(k, '–')}" for k in FOREIGN_KERNELS)
               + ". Skipped runs (time budget): " + (", ".join(part.get("skipped", [])) or "none") + ".\n")
    for key, entry in part["runs"].items():
        _output_run(out, key, entry)


def _train(out, part):
    out.append(f"\n`{part['arch']}` / `{part['mlra_arch']}`, V={part['vocab']}, {part['tokens_per_sample']} tokens "
               f"per sample, --max-tokens {part['max_tokens']}, {part['updates']} updates (the first "
               f"{part['warmup_updates_dropped']} dropped); {part['data']}; memory: {part['memory']}.\n\n")
    out.append(train_runs_table(part, "run", "stock"))


def _train_mt(out, part):
    archs = ", ".join(f"{size} `{arch}`" for size, arch in part["archs"].items())
    out.append(f"\n{archs}, MLRA `{part['mlra_arch']}`; --share-all-embeddings, V={part['vocab']}, "
               f"--max-tokens {part['max_tokens']}, {part['updates']} updates (the first "
               f"{part['warmup_updates_dropped']} dropped); {part['data']}; words = target tokens; memory: "
               f"{part['memory']}.\n\n")
    out.append(train_runs_table(part, "METHOD", "baseline"))


def _stats(out, part):
    out.append("\n" + _table(["V", "d", "TEV + mean cos step ms", "isotropy step ms", "ms per update (intervals "
                              f"{part['embed_stats_interval']} / {part['isotropy_interval']})",
                              "share of a training update"],
                             [[part["V"], part["d"], part["tev_step_ms"], part["isotropy_step_ms"],
                               part["stats_ms_per_update"], part.get("share_of_training")]]))


def _hf(out, part):
    out.append(f"\nOne step (forward + backward) of a {part['layers']}-layer LlamaForCausalLM, {part['dtype']}, "
               f"{part['warmup']} warm-up and {part['repeats']} timed rounds; memory: {part['memory']}.\n\n")
    out.append(part["markdown"] + "\n")


# (title, part, what makes its body, the field the body needs); train_mt and hf only where they ran
SECTIONS = (("1. Correctness: fused vs reference", "correctness", _correctness, "cases"),
            ("2. Output layer + loss (forward + backward)", "output_layer", _output_layer, "runs"),
            ("3. fairseq-train", "train", _train, "runs"),
            ("3b. fairseq-train, the WMT14 recipe's models", "train_mt", _train_mt, "runs"),
            ("4. Embedding statistics", "stats", _stats, "tev_step_ms"),
            ("5. Hugging Face: apply(model) against transformers' loss", "hf", _hf, "markdown"))


def render_markdown(data):
    out, parts = _header(data), data["parts"]
    for title, name, body, needs in SECTIONS:
        if name in ("train_mt", "hf") and name not in parts:
            continue
        part = _section(out, parts, title, name)
        if part and needs in part:
            body(out, part)
    out.append("\n## Targets\n\n")
    out.append(_table(["target", "where", "measured", "limit", "passed", "source"],
                      [[t["target"], t["where"], t["measured"], t["limit"], t["passed"], t.get("source")]
                       for t in data["targets"]]))
    return "".join(out)
