"""The whole-step benchmark's accounting of the statistics' cost (scripts/bench_training.py; the
arithmetic is tests/support/training_runs.py's), on update times written by hand; the benchmark
itself measures, the tests only check its arithmetic."""
import itertools

import pytest

from training_runs import in_run_share, updates_per_second


def _ends(durations):
    """update_ends_s as the training worker records them: the end of update 1, 2, ... (seconds)."""
    return list(itertools.accumulate(durations))


def test_the_measuring_updates_excess_over_the_median_is_the_share():
    # 10 updates of 0.1 s, except updates 5 and 10 (interval 5) at 0.3 s. Counted: updates 3..10
    # (the first two have no full duration after the start); excess 2 x 0.2 s over 1.2 s.
    durations = [0.1] * 10
    durations[4] = durations[9] = 0.3
    assert in_run_share(_ends(durations), 0.0, 5) == pytest.approx(0.4 / 1.2)


def test_the_warm_up_is_left_out():
    # update 5 falls in the leading half: only update 10's 0.2 s excess counts, over updates 6..10
    durations = [0.1] * 10
    durations[4] = durations[9] = 0.3
    assert in_run_share(_ends(durations), 0.5, 5) == pytest.approx(0.2 / 0.7)


def test_no_share_without_statistics_and_none_when_all_updates_are_alike():
    ends = _ends([0.1] * 20)
    assert in_run_share(ends, 0.2, 0) is None
    assert in_run_share(ends, 0.2, 5) == pytest.approx(0.0, abs=1e-12)


def test_updates_per_second_after_the_warm_up():
    # 5 updates of 0.5 s then 5 of 0.25 s; from the end of update 5 to the end of update 10: 4 u/s
    ends = _ends([0.5] * 5 + [0.25] * 5)
    assert updates_per_second(ends, 0.4) == pytest.approx(5 / 1.25)
