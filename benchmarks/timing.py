"""The one timing harness of the benchmarks and the GPU check.

:meth:`Harness.first_calls` calls every step once, untimed by the report (the first call of a
compiled variant compiles its chunk body: no compilation may fall into a timed round; its time is
kept as ``first``). :meth:`Harness.rounds` then runs warm-up rounds and timed rounds, every step
once per round, the order rotated from round to round (so that every step sees the same machine
load, and a ratio can be taken within a round: :meth:`Samples.paired`). One call is timed by CUDA
events on a GPU and by the wall clock elsewhere, with the process's CPU time (all threads) beside
it. A step that cannot run here (:class:`~benchmarks.ops.NotApplicable`) is recorded as skipped;
one that fails, as an error where the caller asks for that (the GPU check records and goes on),
else the error is raised.
"""
import gc
import statistics
import time
from typing import Callable, Dict, Optional

import torch

from benchmarks.ops import NotApplicable
from tests.support.output_layer_problem import cuda_peak_bytes


def timed_call(fn, device):
    """(wall seconds, process CPU seconds, result) of one call of ``fn`` on ``device``."""
    cpu_started = time.process_time()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        wall = start.elapsed_time(end) / 1e3
    else:
        started = time.perf_counter()
        result = fn()
        wall = time.perf_counter() - started
    return wall, time.process_time() - cpu_started, result


class Samples:
    """What the harness measured, per key: the first call's seconds, each round's wall and CPU
    seconds, the last result, and why a key was not measured (``failed``: {"skipped": why} or
    {"error": what})."""

    def __init__(self):
        self.first: Dict[str, float] = {}
        self.wall: Dict[str, list] = {}
        self.cpu: Dict[str, list] = {}
        self.result: Dict[str, object] = {}
        self.failed: Dict[str, dict] = {}

    def median(self, key):
        return statistics.median(self.wall[key])

    def best(self, key):
        return min(self.wall[key])

    def median_cpu(self, key):
        return statistics.median(self.cpu[key])

    def paired(self, a, b):
        """Median over rounds of a's time over b's in the same round (the same machine load)."""
        return statistics.median(x / y for x, y in zip(self.wall[a], self.wall[b]))

    def timed(self):
        """The keys with timed rounds, in the order they were measured."""
        return [k for k in self.wall if self.wall[k]]


class Harness:
    """Times the steps of ``calls`` ({key: fn}) on ``device``; ``before(key)`` runs, untimed, before
    every call (clearing gradients, filling a cache); ``log`` gets one line per phase and round."""

    def __init__(self, device, before: Optional[Callable] = None, log: Optional[Callable] = None,
                 record_errors: bool = False):
        self.device = torch.device(device)
        self.before = before or (lambda key: None)
        self.log = log or (lambda message: None)
        self.record_errors = record_errors

    def _call(self, fn, key):
        self.before(key)
        gc.collect()
        return timed_call(fn, self.device)

    def _guarded(self, calls, key, samples):
        """One call of ``key``, or None where it was skipped or failed (recorded in ``samples``)."""
        try:
            return self._call(calls[key], key)
        except NotApplicable as reason:
            samples.failed[key] = {"skipped": str(reason)}
        except Exception as error:
            if not self.record_errors:
                raise
            samples.failed[key] = {"error": f"{type(error).__name__}: {error}"}
        return None

    def first_calls(self, calls, samples=None) -> Samples:
        """Every step once: its wall seconds as ``first``, its result, or why it cannot run."""
        samples = samples or Samples()
        for key in calls:
            done = self._guarded(calls, key, samples)
            if done is not None:
                samples.first[key], _, samples.result[key] = done
                self.log(f"  first call {key:<24s} {samples.first[key] * 1e3:9.1f} ms (compilation included where "
                         "compiled)")
        return samples

    def rounds(self, calls, warmup, repeats, samples=None) -> Samples:
        """``warmup`` untimed rounds, then ``repeats`` timed ones, over the keys not yet failed."""
        samples = samples or Samples()
        keys = [k for k in calls if k not in samples.failed]
        for w in range(warmup):
            for key in keys:
                self._guarded(calls, key, samples)
            self.log(f"  warm-up round {w + 1}/{warmup}")
        for key in keys:
            samples.wall[key], samples.cpu[key] = [], []
        for r in range(repeats):
            live = [k for k in keys if k not in samples.failed]
            turn = r % max(len(live), 1)
            for key in live[turn:] + live[:turn]:  # the order rotated every round
                done = self._guarded(calls, key, samples)
                if done is not None:
                    wall, cpu, samples.result[key] = done
                    samples.wall[key].append(wall)
                    samples.cpu[key].append(cpu)
            self.log(f"  round {r + 1}/{repeats} wall/cpu ms: " + "  ".join(
                f"{k}={samples.wall[k][-1] * 1e3:.0f}/{samples.cpu[k][-1] * 1e3:.0f}" for k in live
                if samples.wall[k] and k not in samples.failed))
        for key in samples.failed:
            samples.wall.pop(key, None)
        return samples

    def measure(self, calls, warmup, repeats) -> Samples:
        """First calls, then the rounds."""
        return self.rounds(calls, warmup, repeats, self.first_calls(calls))

    def cuda_peak(self, fn, key) -> float:
        """Peak CUDA bytes of one call above the allocation at its start (what it leaves behind,
        such as gradients, included)."""
        self.before(key)
        gc.collect()
        return cuda_peak_bytes(fn)


def seconds_of(fn, device, repeats, reduce=statistics.median):
    """One call's seconds: a warm-up call, then ``reduce`` (median, or min) over ``repeats`` calls."""
    samples = Harness(device).measure({"step": fn}, 0, repeats)
    return reduce(samples.wall["step"])
