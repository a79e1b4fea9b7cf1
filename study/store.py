"""The study's run directories: WORK/PART/RUN_ID/ with ``run.json`` (written first: what the run
is) and ``result.json`` (written last, atomically: the run is finished). A directory without
``result.json`` is an interrupted run and is started again from scratch."""
import json
import os
import shutil
import subprocess
import time

from examples.demo_common import REPO
from fairseq_agg.files import atomic_output

RUN_JSON = "run.json"
RESULT_JSON = "result.json"
INVOCATIONS_JSON = "invocations.json"  # WORK/PART/: every invocation that trained runs of the part


def write_json_atomic(path, obj):
    """Writes ``obj`` to ``path`` through a temporary file, flushed and renamed (the package's
    atomic writer), so that a killed process never leaves a half-written file under the final
    name, and a full disk is one line naming the file."""
    with atomic_output(path, "w", flag="--work-dir") as f:
        json.dump(obj, f, indent=1, allow_nan=True)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def run_dir(work_dir, part, run_id):
    return os.path.join(work_dir, part, run_id)


def finished(directory):
    """(run.json, result.json) of a finished run, else None."""
    if not os.path.isfile(os.path.join(directory, RESULT_JSON)):
        return None
    return read_json(os.path.join(directory, RUN_JSON)), read_json(os.path.join(directory, RESULT_JSON))


def start_clean(directory):
    """An empty run directory (whatever an interrupted attempt left is removed)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)


def read_invocations(part_dir):
    """The records of WORK/PART/invocations.json, oldest first ([] when none)."""
    path = os.path.join(part_dir, INVOCATIONS_JSON)
    return read_json(path) if os.path.isfile(path) else []


def record_invocation(part_dir, seconds, runs_trained):
    """Appends one invocation that trained runs (its wall time, how many runs it trained, the
    checkout) to WORK/PART/invocations.json, so that the part's measured time survives every later
    ``--report`` and resumed invocation."""
    records = read_invocations(part_dir)
    records.append({"finished": time.time(), "seconds": seconds, "runs_trained": runs_trained,
                    "git": git_state()})
    write_json_atomic(os.path.join(part_dir, INVOCATIONS_JSON), records)


def run_key(cmd, data_bin, directory, data_flags, evaluation):
    """What makes two runs the same run: fairseq-train's flags (with the data and run directory as
    placeholders, so that a moved work directory still matches), the data flags and the
    evaluation settings."""
    flags = [{data_bin: "DATA", directory: "RUN_DIR"}.get(x, x) for x in cmd[1:]]
    return {"train_flags": flags, "data": data_flags, "evaluation": evaluation}


def git_state():
    """{"commit", "dirty"} of the checkout, or None outside a git checkout (read-only git calls)."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=30)
        return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None
