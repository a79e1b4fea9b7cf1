"""The GPU check's bookkeeping: the time budget, the log, the run's description and the report
(the JSON document and its Markdown rendering, both rewritten, atomically, after every part)."""
import datetime
import json
import os
import platform
import sys
import time
import traceback

import torch

from benchmarks.gpu_check.markdown import render_markdown
from fairseq_agg import __version__
from fairseq_agg.files import atomic_output


def log(message):
    print(message, file=sys.stderr, flush=True)


class Budget:
    """Seconds left before the deadline that gpu_check.sh set for the whole check."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def left(self) -> float:
        return self.deadline - time.time()


class Report:
    """The JSON document and its Markdown rendering, both rewritten after every part."""

    def __init__(self, out_dir: str, meta: dict):
        self.out_dir = out_dir
        self.data = {"meta": meta, "parts": {}, "targets": []}
        install_json = os.path.join(out_dir, "install.json")
        if os.path.exists(install_json):
            with open(install_json) as f:
                self.data["install"] = json.load(f)

    def run_part(self, name, fn, budget: Budget, min_seconds: float):
        """Runs one part; an exception or a spent budget is recorded, never raised."""
        started = time.time()
        if budget.left() < min_seconds:
            reason = f"time budget: {budget.left():.0f} s left, needs ~{min_seconds:.0f} s"
            part = {"status": "skipped", "reason": reason}
        else:
            try:
                part = fn()
                part.setdefault("status", "ok")
            except Exception as e:  # recorded; the other parts still run
                part = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        part["seconds"] = round(time.time() - started, 2)
        self.data["parts"][name] = part
        log(f"[gpu_check] part {name}: {part['status']} ({part['seconds']} s)")
        self.save()
        return part

    def save(self):
        os.makedirs(self.out_dir, exist_ok=True)
        with atomic_output(os.path.join(self.out_dir, "gpu_check.json"), "w", flag="--out") as f:
            json.dump(self.data, f, indent=2, default=str)
        with atomic_output(os.path.join(self.out_dir, "gpu_check.md"), "w", flag="--out") as f:
            f.write(render_markdown(self.data))


def collect_meta(mode: str, device: torch.device, argv):
    """The run's description: date, command, versions, the device."""
    meta = {"mode": mode, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python -m scripts.gpu_check", *argv]),
            "python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "fairseq_agg": __version__, "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta["device"] = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor})"
        meta["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    else:
        meta["device"] = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    for module in ("fairseq", "triton", "numpy", "liger_kernel"):
        try:
            meta[module] = getattr(__import__(module), "__version__", "installed")
        except Exception as e:
            meta[module] = f"not importable ({type(e).__name__})"
    return meta
