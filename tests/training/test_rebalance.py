"""The re-balancing controller on measured-time inputs (no processes)."""

import pytest

from kaitian.training.split import balanced_split
from kaitian.errors import SplitError


def _compute_times(split, per_sample, overhead):
    return [overhead + b * p for b, p in zip(split, per_sample)]


@pytest.mark.parametrize("per_sample, overhead", [
    ([1.0, 3.0], 0.0), ([1.0, 3.0], 20.0), ([1.0, 1.0, 4.0], 5.0), ([2.0, 1.0, 1.5, 6.0], 10.0),
])
def test_converges_to_equal_compute_time(per_sample, overhead):
    """Fed the measured time per sample of a rank with fixed per-step overhead
    (which makes small batches look slower), the split still settles where
    every rank's step compute time is about equal."""
    world = len(per_sample)
    total = 64 * world
    split = [64] * world
    for _ in range(30):
        times = _compute_times(split, per_sample, overhead)
        measured = [t / b for t, b in zip(times, split)]
        split = balanced_split(total, measured, split, min_gain=0.0)
    times = _compute_times(split, per_sample, overhead)
    assert sum(split) == total
    # within one sample of the best split's time
    assert max(times) - min(times) <= max(per_sample) + 1e-9
    assert split[per_sample.index(max(per_sample))] == min(split)


def test_respects_per_rank_maximum_batch():
    new = balanced_split(128, [1.0, 4.0], [64, 64], caps=[80, None], min_gain=0.0)
    assert new == [80, 48]
    with pytest.raises(SplitError, match="add up to less"):
        balanced_split(128, [1.0, 4.0], [64, 64], caps=[60, 60])


def test_small_gains_keep_the_current_split():
    # measured 1 % apart: not worth changing (noise), with the default min_gain
    assert balanced_split(128, [1.0, 1.01], [64, 64]) == [64, 64]
    assert balanced_split(128, [1.0, 1.5], [64, 64]) != [64, 64]


def test_identical_inputs_give_identical_splits():
    a = balanced_split(300, [0.7, 0.3, 0.9], [100, 100, 100], min_gain=0.0)
    b = balanced_split(300, [0.7, 0.3, 0.9], [100, 100, 100], min_gain=0.0)
    assert a == b and sum(a) == 300
