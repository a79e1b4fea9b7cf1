"""Shared pieces of the LM and MT demos: running fairseq's console scripts with their own log lines
streamed to the terminal, checking which plugin methods are registered, and the result tables."""
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_DIR = os.path.join(REPO, "fairseq_agg")
BIN_DIR = os.path.dirname(sys.executable)
sys.path.insert(0, os.path.join(REPO, "scripts"))
import textprep  # noqa: E402


def say(msg=""):
    print(msg, flush=True)


def console_script(name):
    path = os.path.join(BIN_DIR, name)
    if not os.path.exists(path):
        raise SystemExit(f"{name} not found next to {sys.executable}: run scripts/setup_env.sh first")
    return path


def child_env(threads):
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    # fairseq pickles its legacy config (argparse.Namespace) into checkpoints, which torch >= 2.6
    # refuses to load with its weights_only default; these are checkpoints this demo just wrote.
    env.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    return env


# fairseq's own lines are shown as they come; these noisy library warnings are only logged.
_QUIET = re.compile(r"(Warning|warnings\.warn|deprecation_warning|^\s*$|^\s+super\(\)|^\s+state = torch.load)")


def run_logged(cmd, log_path, prefix, env, show=True):
    """Runs a command, echoing its merged stdout/stderr with a prefix and saving it to log_path.

    Returns (returncode, output lines, wall seconds).
    """
    t0 = time.time()
    lines = []
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            line = line.rstrip("\n")
            lines.append(line)
            if show and not _QUIET.search(line):
                print(f"{prefix}{line}", flush=True)
        proc.wait()
    return proc.returncode, lines, time.time() - t0


def registered_methods(methods):
    """{name: None if usable else the reason}; methods map to dicts with 'criterion' and 'arch'."""
    import fairseq_agg  # noqa: F401  (registers the plugin)
    from fairseq.criterions import CRITERION_REGISTRY
    from fairseq.models import ARCH_MODEL_REGISTRY

    out = {}
    for name, m in methods.items():
        reason = None
        if m["criterion"] not in CRITERION_REGISTRY:
            reason = f"criterion '{m['criterion']}' is not registered in this build of the plugin"
        elif m["arch"] not in ARCH_MODEL_REGISTRY:
            reason = f"architecture '{m['arch']}' is not registered in this build of the plugin"
        out[name] = reason
    return out


_KV = re.compile(r"(\w+)=([-+\w.]+)")


def runnable_methods(requested, methods, tag):
    """(the requested methods whose criterion and architecture the plugin registers, in order,
    {skipped method: why}); says which are skipped; stops when none can run."""
    status = registered_methods({m: methods[m] for m in requested})
    for m in requested:
        if status[m] is not None:
            say(f"[{tag}] SKIPPING {m}: {status[m]} (that method's part of the plugin has not landed)")
    runnable = [m for m in requested if status[m] is None]
    if not runnable:
        raise SystemExit(f"[{tag}] no method can run: the plugin registers none of the requested criteria/architectures")
    return runnable, {m: why for m, why in status.items() if why is not None}


def run_settings(a, budgets):
    """(mode, budget, updates, child environment) of a demo run; makes ``a.work_dir`` absolute."""
    mode = "quick" if a.quick else "default"
    budget = budgets[mode]
    a.work_dir = os.path.abspath(a.work_dir)
    return mode, budget, a.updates or budget["updates"], child_env(a.threads)


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


def print_table(headers, rows, out=None):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    sep = "-+-".join("-" * w for w in widths)
    text = [" | ".join(str(h).ljust(w) for h, w in zip(headers, widths)), sep]
    for r in rows:
        text.append(" | ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    s = "\n".join(text)
    say(s)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(s + "\n")
    return s


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def minutes(seconds):
    return f"{seconds / 60:.1f} min"
