"""Peak memory of one step on a CPU, which has no allocator statistics of its own.

* ``profiler``: torch.profiler's allocation trace (``profile_memory=True``: every allocation and
  free of torch's CPU allocator, with its size and time) replayed; the maximum of the running sum
  of live bytes above the step's start.
* ``rss``: the step in a fresh process (glibc malloc forced to mmap every block >= 64 KiB, so that
  freed tensors leave the RSS); the peak RSS (VmHWM, reset through /proc/self/clear_refs) above the
  RSS at the step's start. The process is the command itself with a hidden flag
  (``--rss-child KEY``), which calls :func:`rss_of_one_step`.

Both count what the step leaves behind (the gradients H.grad and W.grad). On CUDA the harness
reads the allocator's peak (:meth:`benchmarks.timing.Harness.cuda_peak`).
"""
import gc
import json
import os
import subprocess
import sys

from benchmarks import ROOT

METHODS = {
    "cuda": "torch.cuda.max_memory_allocated() above the step's start",
    "profiler": "torch.profiler allocation trace (profile_memory=True): max live torch CPU bytes above the step's start",
    "rss": "fresh subprocess per variant: peak RSS (VmHWM after clear_refs) above the RSS at the step's start, "
    "MALLOC_MMAP_THRESHOLD_=64KiB",
    "none": "not measured",
}


def profiler_peak(step, before):
    """Peak live bytes of torch's CPU allocator during ``step()``, above the step's start."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    before()
    gc.collect()
    # kineto prints "USDT: ... profiler_start/stop" for every profile at USDT, the highest of its
    # levels (0-5): only 6 keeps those lines out. A KINETO_LOG_LEVEL the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    records.sort(key=lambda e: e.start_ns())
    host = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
    live = peak = 0
    for e in records:
        if e.device_type() in host:
            live += e.nbytes()
            peak = max(peak, live)
    before()
    return peak


def _proc_status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_of_one_step(step, before):
    """In a fresh process: one warm-up step (thread pools, kernel caches, lazy initialisation),
    then the peak RSS increase of one more step, in bytes."""
    step()
    before()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = _proc_status_kib("VmRSS")
    step()
    return (_proc_status_kib("VmHWM") - base) * 1024


def rss_peak(command, key, argv):
    """Peak RSS bytes of one step of ``key``, measured by ``python -m COMMAND --rss-child KEY ARGV``
    from the repository root (the child prints {"peak_bytes": ...} as its last line)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    cmd = [sys.executable, "-m", command, "--rss-child", key, *argv]
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]
