"""The GPU check's targets (rows of :data:`benchmarks.targets.TARGETS` that it judges): one row per
target and place it applies, with the measured ratio."""
from benchmarks.targets import GPU_CHECK, target

# (what, target, the run's ratio it reads where that is not the target's own name)
OUTPUT_LAYER_CHECKS = (
    ("AGG output-layer time / stock fairseq", "agg_time_vs_stock", None),
    ("AGG output-layer time / Liger", "agg_time_vs_liger", None),
    ("AL output-layer time / Liger", "al_time_vs_liger", None),
    ("fused CE time / three-matmul floor", "fused_ce_time_vs_floor", None),
    ("AGG time / three-matmul floor", "agg_time_vs_floor", None),
    ("AL time / fused CE", "al_time_vs_fused_ce", None),
    # the augmented loss against its own floor (its four matmuls), at the fused CE's limit
    ("AL time / its own floor (the fused CE's limit)", "fused_ce_time_vs_floor", "al_time_vs_al_floor"),
    # issue #33's memory target, read as the package's fused variants' peak against stock's
    ("fused CE output-layer peak memory / stock", "memory_vs_stock", "fused_ce_memory_vs_stock"),
    ("AGG output-layer peak memory / stock", "memory_vs_stock", "agg_memory_vs_stock"),
    ("AL output-layer peak memory / stock", "memory_vs_stock", "al_memory_vs_stock"),
    *((f"{name} peak memory / torch chunked (auto)", "memory_vs_torch_chunked", f"{name}_memory_vs_torch_chunked")
      for name in ("fused_ce", "agg", "al")),
)
TRAIN_CHECKS = {"cross_entropy_agg": ("fairseq-train words/s, AGG / stock", "agg_train_wps_vs_stock"),
                "augmented_loss": ("fairseq-train words/s, AL / stock", "al_train_wps_vs_stock")}


def _row(what, where, measured, name):
    t = target(name, GPU_CHECK)
    return {"target": what, "where": where, "measured": measured, "limit": t.text(), "passed": t.passed(measured),
            "source": t.source}


def evaluate_targets(data):
    parts, rows = data["parts"], []
    for key, entry in parts.get("output_layer", {}).get("runs", {}).items():
        ratios = entry.get("ratios", {})
        for what, name, ratio in OUTPUT_LAYER_CHECKS:
            if target(name, GPU_CHECK).applies_to(key):
                rows.append(_row(what, key, ratios.get(ratio or name), name))
    train = parts.get("train", {})
    for key, r in train.get("ratios", {}).items():
        precision, _, name = key.partition(" ")
        if precision in train.get("target_precisions", []) and name in TRAIN_CHECKS:
            what, target_name = TRAIN_CHECKS[name]
            rows.append(_row(what, key, r.get("wps_vs_stock"), target_name))
    stats = parts.get("stats", {})
    if stats.get("status") == "ok":
        rows.append(_row("statistics at the recommended intervals / training time", f"V={stats['V']} d={stats['d']}",
                         stats.get("share_of_training"), "stats_share_of_training"))
    return rows
