"""The step-cost model and the solver that decides who trains (pure Python)."""

import itertools
import random

import pytest

from kaitian.errors import SplitError
from kaitian.training.sampler import DistributedSampler
from kaitian.training.split import SplitSchedule, epoch_layout
from kaitian.training.stepcost import (
    StepCost, StepCostFit, exchange_of, follow_exchange, halfway, predicted_step, solve_split,
)


def test_the_fit_follows_a_rank_that_slows_down():
    fit = StepCostFit()
    for n in [32, 8] * 18:
        fit.add(n, 0.001 + 0.0001 * n)
    for n in [32, 8] * 6:  # one half-life of steps 50 ms slower, after 36 fast ones
        fit.add(n, 0.051 + 0.0001 * n)
    before, now = 0.001 + 0.0032, 0.051 + 0.0032
    assert fit.cost().at(32) > (before + now) / 2  # past the midpoint already (plain least squares: a quarter)


def test_a_device_several_times_slower_is_a_new_regime_not_a_fixed_cost():
    """5x slower per sample from one step on, while the split moves samples away from it (the
    test_rebalance_online case): a fit across both regimes read the change as a fixed cost
    (later steps: fewer samples, more time) and stopped moving samples."""
    fit = StepCostFit()
    for _ in range(10):
        fit.add(64, 0.0001 * 64)
    for n in [61, 61, 67, 53, 53, 45, 45]:
        fit.add(n, 0.0005 * n)
    cost = fit.cost()
    assert cost.per_sample_s == pytest.approx(0.0005, rel=0.05) and cost.fixed_s < 0.001
    steady = StepCostFit()  # noise well inside the fit's reach is no change of regime
    for i in range(30):
        steady.add(32 + i % 3, (0.0001 * 32) * (1.3 if i % 2 else 0.8))
    assert len(steady.points) == 30


def test_after_a_move_the_fit_predicts_the_new_size_as_measured():
    """The 3:1 bench's slow rank: 2048 samples a step at 0.95 ms each while the machine was cold,
    then 689 at 0.76 ms. The old points weigh by their size: plain least squares predicted 0.66 s
    at 689 for the next 16 rounds while its steps took 0.52 s, and the split stayed 15 % off."""
    fit = StepCostFit()
    for _ in range(3):
        fit.add(2048, 2048 * 0.00095)
    for _ in range(3):
        fit.add(689, 689 * 0.00076)
    assert fit.cost().at(689) == pytest.approx(689 * 0.00076, rel=1e-9)
    assert fit.cost().fixed_s == 0.0  # the cautious reading holds: no fixed cost from faster later steps
    affine = StepCostFit()  # a real fixed cost is still read; the level follows the recent steps
    for n in [64] * 10 + [12] * 10:
        affine.add(n, 0.030 + 0.002 * n)
    for _ in range(5):
        affine.add(116, 1.1 * (0.030 + 0.002 * 116))
    cost = affine.cost()
    assert cost.at(116) == pytest.approx(1.1 * 0.262, rel=1e-6)
    assert 0.02 < cost.fixed_s < 0.04
    recent = StepCostFit()  # the level: the mean of the last 12 steps at the size
    for t in [0.5] * 20 + [0.8] * 3 + [0.5] * 9:
        recent.add(800, t)
    assert recent.cost().at(800) == pytest.approx(0.575)
    short = StepCostFit()  # fewer steps in a row at the size than set the level: the fit alone
    for n in [64, 12] * 5 + [116, 116]:
        short.add(n, 0.030 + 0.002 * n + (0.01 if n == 116 else 0.0))
    assert short.cost().at(116) < 0.030 + 0.002 * 116 + 0.01


def test_sizes_close_together_under_drift_read_little_fixed_cost():
    """The 3:1 bench's slow rank moved from 867 to 965 samples while the machine got faster: its
    fit read 0.19 s of a 0.62 s step as fixed and predicted 0.84 s for 1407 samples (a 46 % move),
    which took 1.0-1.14 s; its peer waited 0.5 s a step. Here 7 % of drift alone: plain least
    squares reads 0.42 s as fixed and predicts 0.71 s for 1407. Sizes 11 % apart are now trusted
    for an eighth of their fixed part."""
    fit = StepCostFit()
    for _ in range(12):
        fit.add(867, 0.60)
    for _ in range(3):
        fit.add(965, 0.62)
    assert fit.cost().at(1407) > 0.95 * 0.62 * 1407 / 965
    assert fit.cost().at(965) == pytest.approx(0.62)
    far = StepCostFit()  # sizes far apart: the fixed part is read whole
    for n in [16, 32] * 8:
        far.add(n, 0.050 + 0.0001 * n)
    assert far.cost().fixed_s == pytest.approx(0.050)


def test_the_fit_separates_the_fixed_cost_from_the_per_sample_cost():
    fit = StepCostFit()
    rng = random.Random(0)
    for n in [64] * 10 + [12] * 10 + [116] * 10:
        fit.add(n, 0.030 + 0.002 * n + rng.uniform(-1e-4, 1e-4))
    cost = fit.cost()
    assert abs(cost.fixed_s - 0.030) < 1e-3 and abs(cost.per_sample_s - 0.002) < 2e-5


def test_alike_batches_are_read_as_all_per_sample_and_noise_keeps_both_parts_physical():
    fit = StepCostFit()
    for _ in range(5):
        fit.add(64, 0.128)
    assert not fit.varied and fit.cost().fixed_s == 0.0 and fit.cost().per_sample_s == pytest.approx(0.002)
    noisy = StepCostFit()
    for n, t in [(10, 0.05), (20, 0.04), (30, 0.05), (40, 0.04)]:  # no trend at all
        noisy.add(n, t)
    cost = noisy.cost()
    assert cost.per_sample_s > 0 and cost.fixed_s >= 0
    assert cost.at(40) > 0  # positive where it was measured


def _brute_force(total, costs, exchange, minimum=1, groups=None, within=None):
    """The best predicted step over every split of ``total`` (tiny cases)."""
    best = None
    world = len(costs)
    for split in itertools.product(range(total + 1), repeat=world):
        if sum(split) != total or any(0 < n < minimum for n in split):
            continue
        t = predicted_step(split, costs, exchange, groups, within)
        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_solver_finds_the_best_split_over_every_subset(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 4)
    costs = [StepCost(rng.choice([0.0, rng.uniform(0, 0.05)]), rng.uniform(1e-4, 5e-3)) for _ in range(world)]
    groups = [f"g{rng.randint(0, 1)}" for _ in range(world)]
    exchange = rng.choice([0.0, 0.002, 0.02])
    within = rng.choice([None, {}, {"g0": rng.choice([0.0, 0.001, 0.03])}])  # g1's not measured (when given)
    total = rng.randint(world, 24)
    current = [total // world] * (world - 1) + [total - total // world * (world - 1)]
    decision = solve_split(total, costs, groups, exchange, current, allow_bench=True, within_s=within)
    assert sum(decision.split) == total
    assert decision.predicted_s == pytest.approx(_brute_force(total, costs, exchange, 1, groups, within), abs=1e-12)
    for group, alone in decision.alone_s.items():  # never slower than a vendor group alone
        assert decision.predicted_s <= alone + 1e-15


def test_a_rank_with_a_high_fixed_cost_or_an_expensive_exchange_gets_nothing():
    fast, slow = StepCost(0.004, 0.0001), StepCost(0.050, 0.001)
    decision = solve_split(128, [fast, slow], ["cuda", "cpu"], 0.002, [64, 64], allow_bench=True)
    assert decision.split == [128, 0] and decision.benched == [1]
    assert decision.alone_s["cuda"] == pytest.approx(0.004 + 0.0128)
    # equal ranks: both train while the exchange is cheap, one alone when it is not
    equal = [StepCost(0.001, 0.001), StepCost(0.001, 0.001)]
    assert solve_split(128, equal, ["a", "b"], 0.002, [64, 64], allow_bench=True).split == [64, 64]
    assert solve_split(128, equal, ["a", "b"], 0.08, [64, 64], allow_bench=True).split == [128, 0]
    # without benching every rank keeps its minimum
    assert solve_split(128, [fast, slow], ["cuda", "cpu"], 0.002, [64, 64], minimum=2).split == [126, 2]


def test_the_exchange_within_a_group_is_charged_apart_from_the_one_across_groups():
    """Ranks 0 and 1 in group a, rank 2 (slow) in b. The measured exchange across groups (with
    rank 2 in it) is not charged to ranks 0 and 1 alone: their own, once measured, is."""
    fast, slow = StepCost(0.002, 0.0001), StepCost(0.05, 0.002)
    costs, groups = [fast, fast, slow], ["a", "a", "b"]
    across = 0.02  # the bridge, with the slow rank's host in it
    # one cost for every set of ranks (no within_s): two fast ranks pay the bridge's 20 ms, one alone is best
    assert solve_split(128, costs, groups, across, [43, 43, 42], allow_bench=True).split == [128, 0, 0]
    # group a's own exchange not measured yet: tried (charged nothing) ...
    decision = solve_split(128, costs, groups, across, [43, 43, 42], allow_bench=True, within_s={})
    assert decision.split == [64, 64, 0] and decision.alone_s["a"] == pytest.approx(0.002 + 0.0064)
    # ... measured cheap: kept; measured dear: one rank alone
    assert solve_split(128, costs, groups, across, [64, 64, 0], allow_bench=True, within_s={"a": 0.001}).split == [
        64, 64, 0]
    assert solve_split(128, costs, groups, across, [64, 64, 0], allow_bench=True, within_s={"a": 0.01}).split == [
        128, 0, 0]
    assert exchange_of([0, 2], across, groups, {"a": 0.001}) == across
    assert exchange_of([1], across, groups, {"a": 0.001}) == 0.0


def test_the_solver_is_deterministic_and_takes_the_lower_rank_on_ties():
    same = [StepCost(0.01, 0.001)] * 3
    results = {tuple(solve_split(30, same, ["a", "a", "a"], 1.0, [10, 10, 10], allow_bench=True).split)
               for _ in range(5)}
    assert results == {(30, 0, 0)}


def test_halfway_keeps_the_total_and_stays_between_the_two_splits():
    assert halfway([64, 64], [48, 80]) == [56, 72]
    assert halfway([64, 64, 0], [49, 79, 0]) == [57, 71, 0]  # the half goes to the lower rank; a benched one stays
    assert halfway([64, 64], [63, 65]) == [64, 64]
    rng = random.Random(0)
    for _ in range(200):
        old = [rng.randint(1, 50) for _ in range(4)]
        new = list(old)
        for _ in range(10):
            a, b = rng.randrange(4), rng.randrange(4)
            if a != b and new[a] > 1:
                new[a], new[b] = new[a] - 1, new[b] + 1
        mid = halfway(old, new)
        assert sum(mid) == sum(old) and all(min(o, n) <= m <= max(o, n) for o, n, m in zip(old, new, mid))


def test_a_round_that_moves_samples_back_the_way_the_last_one_moved_them_goes_halfway():
    from types import SimpleNamespace

    from kaitian.training.rebalance import Rebalancer, RebalanceDecision

    def reverses(last_old, old, new):
        last = RebalanceDecision(step=0, epoch=0, per_sample_s=[], old=last_old, new=old, applied=True)
        return Rebalancer._reverses(SimpleNamespace(history=[last]), old, new)

    assert reverses([64, 64], [48, 80], [70, 58])  # 64 -> 48 -> 70: back, so halfway (59, 69)
    assert not reverses([64, 64], [48, 80], [40, 88])  # on the same way: a full move
    assert not reverses([64, 64], [64, 64], [70, 58])  # the last round kept the split
    assert not reverses([64, 64], [48, 80], [128, 0])  # benching is no reversal of a re-split
    assert not reverses([0, 128], [48, 80], [70, 58])  # nor is a call-back


def test_one_round_moves_the_kept_exchange_at_most_twice_up_or_down_and_a_real_change_is_followed():
    assert follow_exchange(None, 0.05) == 0.05 and follow_exchange(0.0, 0.05) == 0.05  # the first reading, whole
    assert follow_exchange(0.01, 0.015) == 0.015 and follow_exchange(0.01, 0.006) == 0.006  # within 2x: as read
    assert follow_exchange(0.01, 0.05) == 0.02  # a spike: twice at most
    assert follow_exchange(0.01, 0.0002) == 0.005  # a lucky round: half at most
    for start, real in ((0.01, 0.1), (0.1, 0.01)):  # a real change of 10x is followed within four rounds
        kept = start
        for _ in range(4):
            kept = follow_exchange(kept, real)
        assert kept == real


def test_a_loaded_round_s_exchange_does_not_bench_a_group_that_pays():
    """Two groups of one rank, 3 ms + 2 ms a sample each: together 67 ms + the exchange (10 ms),
    either alone 131 ms. A loaded round reads the exchange across them as 70 ms: kept whole, either
    alone would look faster, the other benched, and nothing would measure the exchange again."""
    from types import SimpleNamespace

    from kaitian.training.rebalance import Rebalancer

    state = SimpleNamespace(_vendor_groups=["a", "b"], _within_s={}, _exchange_s=0.0)
    for comm in (0.01, 0.07):
        Rebalancer._keep_exchange(state, [0, 1], comm)
    assert state._exchange_s == 0.02 and state._within_s == {}
    costs = [StepCost(0.003, 0.002)] * 2
    assert solve_split(64, costs, ["a", "b"], state._exchange_s, [32, 32], allow_bench=True).split == [32, 32]
    assert solve_split(64, costs, ["a", "b"], 0.07, [32, 32], allow_bench=True).split == [64, 0]
    Rebalancer._keep_exchange(state, [0], 0.5)  # one rank alone exchanges nothing
    Rebalancer._keep_exchange(state, [0, 1], 0.01)  # the next round reads the typical time again
    assert state._exchange_s == 0.01
    state._vendor_groups = ["a", "a"]
    Rebalancer._keep_exchange(state, [0, 1], 0.004)  # within one group: its own kind
    assert state._within_s == {"a": 0.004} and state._exchange_s == 0.01


def test_a_cap_or_a_minimum_that_no_subset_meets_is_an_error():
    with pytest.raises(SplitError, match="no set of ranks can hold the global batch 64"):
        solve_split(64, [StepCost(0, 1e-3)] * 2, ["a", "b"], 0.0, [32, 32], caps=[16, 16], allow_bench=True)


def test_zero_shares_in_the_epoch_layout_and_the_schedule():
    assert epoch_layout(100, [32, 0, 16], minimum=2) == (2, [2, 0, 2])  # short step of 4 over the trainers
    schedule = SplitSchedule([24, 24], minimum=1)
    with pytest.raises(SplitError, match=r"takes it out of the exchange"):
        schedule.change([48, 0], after_draws=None)
    schedule.benching = True
    schedule.change([48, 0], after_draws=0)  # benching mid-epoch: yes
    schedule.before_batch(at_epoch_start=False, draw=True)
    with pytest.raises(SplitError, match="calls back a benched rank"):
        schedule.change([24, 24], after_draws=0)  # calling back: at an epoch start only
    schedule.change([24, 24], after_draws=None)
    schedule.raise_minimum(3)  # a benched rank is not lifted to the minimum
    assert schedule.current == [48, 0]


def test_a_benched_rank_has_no_batch_and_its_pass_ends_where_it_is_benched():
    samplers = [DistributedSampler(list(range(100)), batch_size=16, num_replicas=2, rank=r) for r in range(2)]
    spare_calls = []
    for s in samplers:
        s.enable_benching()
        s.add_spare_hook(lambda epoch, r=s.rank: spare_calls.append((r, epoch)))
        s.set_epoch(0)
    passes = [iter(s.batch_sampler()) for s in samplers]
    assert [len(next(p)) for p in passes] == [16, 16]
    for s in samplers:
        s.set_split([32, 0], after_draws=1)  # the third batch on
    assert [len(next(p)) for p in passes] == [16, 16]
    assert list(passes[1]) == [] and spare_calls == [(1, 0)]
    assert [len(b) for b in passes[0]] == [32, 4]  # the short step of 4 is all rank 0's
    for s in samplers:
        s.set_epoch(1)
    assert len(samplers[1].batch_sampler()) == 0 or samplers[1].local_batch_size == 0
    assert list(samplers[1].batch_sampler()) == [] and spare_calls == [(1, 0), (1, 1)]
    assert sum(len(b) for b in samplers[0].batch_sampler()) == 100
