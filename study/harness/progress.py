"""What the terminal is told while runs go side by side: whole lines (:func:`say`), minutes, and
"run k of N" with the time left (:class:`Progress`)."""
import re
import threading
import time


_PRINT = threading.Lock()


def say(msg=""):
    """One whole line on stdout, also when runs side by side report at the same moment."""
    with _PRINT:
        print(msg, flush=True)


def minutes(seconds):
    return f"{seconds / 60:.1f} min"


def time_left(seconds):
    return f"about {minutes(seconds)} left" if seconds >= 60 else "less than a minute left"


class Progress:
    """The "run k of N" of each run and the time left, while a demo's runs go ``lanes`` at a time.

    The time left starts from the demo's estimates (``updates * seconds_per_update +
    seconds_per_run`` a run, ``after_seconds`` for the work after all runs) and follows the
    measured speed: every estimate is scaled by the seconds taken over the seconds estimated, for
    the finished runs and for the updates between the running runs' first and latest train_inner
    lines. A running run has its scaled estimate minus its time so far left; the runs not started
    go to the lane that frees first. Thread-safe (the runs report from their own threads).
    """

    def __init__(self, n_runs, lanes, updates, seconds_per_update, seconds_per_run, after_seconds=0.0,
                 clock=time.monotonic):
        self.n_runs, self.lanes = n_runs, max(1, min(lanes, n_runs))
        self.seconds_per_update = seconds_per_update
        self.run_estimate = updates * seconds_per_update + seconds_per_run
        self.after_seconds = after_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._number = {}  # label -> k, in the order the runs started
        self._running = {}  # label -> clock at its start
        self._logged = {}  # label -> [(clock, num_updates) of its first train_inner line, of its latest]
        self._taken = {}  # label -> seconds from start to finish

    def start(self, label):
        """Records the start of run ``label``; returns 'run k of N'."""
        with self._lock:
            self._number[label] = len(self._number) + 1
            self._running[label] = self.clock()
            return f"run {self._number[label]} of {self.n_runs}"

    def observe(self, label, line):
        """Takes the update number of a fairseq train_inner line of run ``label`` (other lines: nothing)."""
        if "train_inner" not in line:
            return
        m = re.search(r"\bnum_updates=(\d+)", line)
        if m:
            with self._lock:
                point = (self.clock(), int(m.group(1)))
                self._logged.setdefault(label, [point, point])[1] = point

    def finish(self, label):
        """Records the end of run ``label``; returns ('run k of N', its seconds)."""
        with self._lock:
            self._taken[label] = self.clock() - self._running.pop(label)
            self._logged.pop(label, None)
            return f"run {self._number[label]} of {self.n_runs}", self._taken[label]

    def speed(self):
        """Seconds taken per second estimated so far (1 before anything is measured)."""
        with self._lock:
            estimated = self.run_estimate * len(self._taken)
            taken = sum(self._taken.values())
            for (t0, u0), (t1, u1) in self._logged.values():
                estimated += (u1 - u0) * self.seconds_per_update
                taken += t1 - t0
        return taken / estimated if estimated > 0 else 1.0

    def seconds_left(self):
        """The estimated seconds until the runs and the work after them are done."""
        f = self.speed()
        with self._lock:
            now = self.clock()
            lanes = [max(0.0, self.run_estimate * f - (now - t0)) for t0 in self._running.values()]
            waiting = self.n_runs - len(self._taken) - len(self._running)
        lanes += [0.0] * max(0, self.lanes - len(lanes))
        for _ in range(waiting):
            lanes.sort()
            lanes[0] += self.run_estimate * f
        return max(lanes) + self.after_seconds * f
