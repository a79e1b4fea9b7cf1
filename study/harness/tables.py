"""The result tables of the demos and the study: mean ± half the range over seeds (:func:`fmt`),
plain-text and markdown tables, and the JSON files beside them."""
import json
import math
import statistics

from fairseq_agg.files import atomic_output

from study.harness.progress import say


def write_json(path, obj):
    """``obj`` as indented JSON in ``path``, written atomically (a reader never sees half a file)."""
    with atomic_output(path, "w", flag="JSON output") as f:
        json.dump(obj, f, indent=2)


def mean_spread(values):
    """(mean, half of the range) over seeds; (None, None) without values."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return None, None
    return statistics.fmean(vals), (max(vals) - min(vals)) / 2.0


def fmt(values, digits=2):
    mean, spread = mean_spread(values)
    if mean is None:
        return "-"
    if len([v for v in values if v is not None]) > 1:
        return f"{mean:.{digits}f}±{spread:.{digits}f}"
    return f"{mean:.{digits}f}"


def result_rows(methods, results, columns):
    """(headers, rows) of a demo's table: one row per method, a ``fmt`` cell per (key, header,
    digits) column, over the method's results (one dict per seed)."""
    headers = ["method"] + [h for _, h, _ in columns]
    rows = [[m] + [fmt([r.get(k) for r in results[m]], d) for k, _, d in columns] for m in methods]
    return headers, rows


def print_table(headers, rows, out=None, show=True):
    """The plain-text table of ``headers`` and ``rows`` (numbers right-aligned), printed (unless
    ``show`` is false) and, given ``out``, written there; returns its text."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    sep = "-+-".join("-" * w for w in widths)
    text = [" | ".join(str(h).ljust(w) for h, w in zip(headers, widths)), sep]
    for r in rows:
        text.append(" | ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    s = "\n".join(text)
    if show:
        say(s)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(s + "\n")
    return s


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)
