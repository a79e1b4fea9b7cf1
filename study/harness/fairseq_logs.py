"""fairseq's log lines read back: the values of the last train line, a curve of train_inner values,
fairseq's own training time (--log-format simple)."""
import re

_KV = re.compile(r"(\w+)=([-+\w.]+)")


def last_train_stats(lines):
    """key -> value of the last fairseq 'train' (or train_inner) line of a --log-format simple run."""
    stats = {}
    for line in lines:
        if "| train |" in line or "| train_inner |" in line or re.search(r"\bepoch \d+ \|", line):
            kv = dict(_KV.findall(line))
            if kv:
                stats = kv
    return stats


def train_curve(lines, key="loss"):
    """[(num_updates, value)] from the train_inner lines (for the comparison figure)."""
    pts = []
    for line in lines:
        if "train_inner" not in line:
            continue
        kv = dict(_KV.findall(line))
        if key in kv and "num_updates" in kv:
            try:
                pts.append((int(kv["num_updates"]), float(kv[key])))
            except ValueError:
                pass
    return pts


def done_seconds(lines):
    for line in reversed(lines):
        m = re.search(r"done training in ([\d.]+) seconds", line)
        if m:
            return float(m.group(1))
    return None
