"""The study's own numbers, as pure functions of fairseq's log lines and of token ids (the
definitions are in docs/study.md; each has a test with hand-computed values in tests/test_study.py).

* :func:`valid_curve` - (update, value) points of fairseq's ``valid`` lines (``train_inner``
  lines: :func:`study.harness.fairseq_logs.train_curve`);
* :func:`resumed_log` - the log of a run trained in several attempts as if trained in one;
* :func:`convergence` - the relative change of a curve over the last part of training;
* :func:`count_spikes` - values above k x the median of the previous w points (loss and gnorm);
* :func:`unique_tokens` - the AGG paper's "Uniq" of a set of continuations;
* :func:`group_shares` - the share of tokens in each frequency group (MT hypotheses vs references);
* :func:`compare_to_baseline` - whether a method's difference to the baseline exceeds the spread
  over seeds (mean ± half the range, :func:`study.harness.tables.mean_spread`);
* :func:`spearman_interval`, :func:`resolvable_difference` - what a word-similarity rho over n pairs
  can tell apart (Fisher z).
"""
import math
import re
import statistics
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from study.harness.tables import mean_spread

Points = List[Tuple[int, float]]


# fairseq's resume ("Loaded checkpoint X (epoch 1 @ 300 updates)") and the update of a progress line
# (train_inner: "num_updates=300"; valid and train: "| num_updates 300")
_LOADED = re.compile(r"Loaded checkpoint .* \(epoch \d+ @ (\d+) updates\)")
_UPDATE = re.compile(r"\bnum_updates[= ](\d+)")


def resumed_log(lines: Sequence[str], header: str) -> List[str]:
    """The log lines of a run whose fairseq-train was started several times, each attempt
    beginning with a line that starts with ``header`` (its command; a resumed attempt's adds
    ``--restore-file``) and every later one resuming from a checkpoint: the progress
    lines that an attempt logged after the update the next one resumed from are left out (the next
    attempt logs those updates again), so that the curves hold each update once."""
    attempts: List[List[str]] = []
    for line in lines:
        if line.startswith(header) or not attempts:
            attempts.append([])
        attempts[-1].append(line)
    out: List[str] = []
    for attempt, following in zip(attempts, attempts[1:] + [None]):
        if following is not None:
            resumed = next((int(m.group(1)) for m in map(_LOADED.search, following) if m), 0)
            attempt = [x for x in attempt if not (m := _UPDATE.search(x)) or int(m.group(1)) <= resumed]
        out.extend(attempt)
    return out


# a valid line: "... | valid | epoch 001 | valid on 'valid' subset | loss 6.656 | ppl 100.85 | ... | num_updates 5"
_VALID_FIELD = re.compile(r"\|\s*(\w+) ([-+\w.]+)\s*(?=\||$)")


def valid_curve(lines: Iterable[str], key: str = "ppl", subset: str = "valid") -> Points:
    """[(num_updates, value)] of ``key`` in fairseq's validation lines of ``subset`` (one per
    validation: with ``--validate-interval-updates N`` every N updates and at the end)."""
    pts = []
    for line in lines:
        if "| valid |" not in line or f"valid on '{subset}' subset" not in line:
            continue
        fields = dict(_VALID_FIELD.findall(line))
        try:
            pts.append((int(fields["num_updates"]), float(fields[key])))
        except (KeyError, ValueError):
            pass
    return pts


def convergence(points: Points, total_updates: int, last_fraction: float = 0.2, tolerance: float = 0.01) -> Optional[dict]:
    """How much a curve still moves at the end of training.

    Over the points at update >= (1 - last_fraction) x total_updates: change = (last - first) /
    first (signed, relative), converged = |change| < tolerance. None when fewer than two points
    fall in that window (the run validated too rarely to tell).
    """
    if not 0 < last_fraction <= 1:
        raise ValueError(f"last_fraction must be in (0, 1], got {last_fraction}")
    start = (1.0 - last_fraction) * total_updates
    window = [(u, v) for u, v in points if u >= start]
    if len(window) < 2:
        return None
    (u0, v0), (u1, v1) = window[0], window[-1]
    change = (v1 - v0) / v0
    return {"from_update": u0, "to_update": u1, "from": v0, "to": v1, "change": change,
            "converged": abs(change) < tolerance, "tolerance": tolerance}


def count_spikes(values: Sequence[float], factor: float, window: int) -> List[int]:
    """Indices i >= window with values[i] > factor x median(values[i - window : i]).

    A spike is judged against the points just before it, so a trend (the loss falling, the
    gradient norm settling after warm-up) is not one; the first ``window`` points are never
    spikes (too little history)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    return [i for i in range(window, len(values)) if values[i] > factor * statistics.median(values[i - window:i])]


def unique_tokens(continuations: Iterable[Sequence[int]]) -> int:
    """The AGG paper's "Uniq": the number of distinct token ids in all the continuations together."""
    seen = set()
    for seq in continuations:
        seen.update(int(t) for t in seq)
    return len(seen)


def group_shares(token_lists: Iterable[Sequence[int]], group_of: Sequence[int], names: Sequence[str]) -> Dict[str, Optional[float]]:
    """{group name: share of the tokens in that group}; ``group_of[id]`` is the index of the
    id's group in ``names``, or -1 for ids in no group (special symbols), which are not counted."""
    counts = [0] * len(names)
    for seq in token_lists:
        for t in seq:
            g = group_of[int(t)]
            if g >= 0:
                counts[g] += 1
    total = sum(counts)
    return {n: (c / total if total else None) for n, c in zip(names, counts)}


def compare_to_baseline(values: Sequence[Optional[float]], baseline: Sequence[Optional[float]]) -> Optional[bool]:
    """True when |mean - mean_baseline| > h + h_baseline (mean ± h = mean ± half the range over
    seeds): the seed ranges around the two means do not overlap. None with fewer than two seeds
    on either side (no spread to compare with) or missing values."""
    vals = [v for v in values if v is not None]
    base = [v for v in baseline if v is not None]
    if len(vals) < 2 or len(base) < 2:
        return None
    (m, h), (mb, hb) = mean_spread(vals), mean_spread(base)
    return abs(m - mb) > h + hb


# Spearman's rho on n pairs: Fisher's z = atanh(rho) is about normal with variance 1.06 / (n - 3)
# (Fieller, Hartley & Pearson 1957; 1 / (n - 3) is Pearson's r's), the usual interval for rho.
SPEARMAN_Z_VARIANCE = 1.06
Z_95 = 1.959964  # the two-sided 95 % quantile of the normal


def spearman_interval(rho: Optional[float], pairs: int, z: float = Z_95) -> Optional[Tuple[float, float]]:
    """The 95 % interval of a Spearman rho over ``pairs`` word pairs (Fisher z); None without rho or
    with fewer than 4 pairs."""
    if rho is None or pairs < 4:
        return None
    center, half = math.atanh(max(min(rho, 0.999999), -0.999999)), z * math.sqrt(SPEARMAN_Z_VARIANCE / (pairs - 3))
    return math.tanh(center - half), math.tanh(center + half)


def resolvable_difference(pairs: int, z: float = Z_95) -> Optional[float]:
    """The smallest difference of two rhos near 0, each over ``pairs`` pairs, that exceeds z
    standard errors of their difference in Fisher z (treating them as independent, which two
    embeddings scored on the same pairs are not, so a conservative yardstick)."""
    if pairs < 4:
        return None
    return math.tanh(z * math.sqrt(2 * SPEARMAN_Z_VARIANCE / (pairs - 3)))
