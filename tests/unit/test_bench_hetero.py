"""``kaitian bench hetero``'s schedule of phases and how it reads them (pure functions)."""

import statistics

import pytest

from kaitian.bench.hetero import _phases, _steady_state, lockstep_share


def test_alone_rebalancing_local_and_solo_take_turns_and_every_part_takes_every_position():
    turn = ("alone", "rebalance", "local", "solo")
    assert _phases(0, 2) == ["capabilities", "equal", "static", *turn * 2]  # the ranks measured first
    assert _phases(1, 1) == ["static", "rebalance", "local", "solo", "alone", "equal"]
    assert _phases(2, 1) == ["local", "solo", "alone", "rebalance", "equal", "static"]
    assert "capabilities" not in _phases(3, 1)
    firsts = [[m for m in _phases(c, 1) if m != "capabilities"][0] for c in range(3)]
    assert firsts[:2] == ["equal", "static"] and firsts[2] in turn
    leads = {next(m for m in _phases(c, 1) if m in turn) for c in range(4)}
    assert leads == set(turn)


def test_the_factors_pair_epochs_run_back_to_back():
    # the machine halves its speed in cycle 3: medians of each mode mix fast and slow epochs,
    # the turns do not; cycles 0 and 1 (converging) are left out
    history = {
        "equal": [(c, 10.0) for c in range(4)],
        "static": [(c, 20.0) for c in range(4)],
        "alone": [(0, 100.0), (1, 100.0), (2, 100.0), (2, 100.0), (3, 50.0), (3, 50.0)],
        "local": [(0, 100.0), (1, 100.0), (2, 102.0), (2, 104.0), (3, 52.0), (3, 51.0)],
        "solo": [(0, 90.0), (1, 90.0), (2, 110.0), (2, 100.0), (3, 50.0), (3, 60.0)],
        "rebalance": [(0, 10.0), (1, 10.0), (2, 99.0), (2, 101.0), (3, 49.0), (3, 51.0)],
        "lockstep": [(0, 0.9), (1, 0.9), (2, 0.9), (2, 1.0), (3, 0.95), (3, 0.9)],
    }
    steady, paired = _steady_state(history, cycles=4)
    assert steady["alone"] == 75.0 and steady["rebalance"] == 75.0
    assert steady["equal"] == 10.0
    assert paired["alone"] == 1.0  # ratios 0.99, 1.01, 0.98, 1.02
    assert 0.96 < paired["local"] < 0.98  # ratios 0.97, 0.971, 0.942, 1.0
    # each turn's ideal is its higher of solo and local: 110, 104, 52, 60
    assert paired["ideal"] == statistics.median([99 / 110, 101 / 104, 49 / 52, 51 / 60])
    # and over what a lock-step job reaches of it: the higher of local and the solos' share of
    # their sum (99, 100, 47.5, 54): 102, 104, 52, 54
    assert paired["lockstep"] == statistics.median([99 / 102, 101 / 104, 49 / 52, 51 / 54])
    assert paired["lockstep_share"] == statistics.median([0.9, 1.0, 0.95, 0.9])


def test_the_lock_step_share_is_what_waiting_for_the_slowest_rank_leaves():
    assert lockstep_share([[1.0, 1.0], [3.0, 3.0, 3.0]]) == 1.0  # steady steps: nothing lost
    assert lockstep_share([[2.0]]) == 1.0  # one rank waits for nobody
    # rank 0 steady; rank 1 at 0.8 or 1.2 of its mean: the step is 1.0 or 1.2 of the balanced one
    assert lockstep_share([[5.0, 5.0], [0.8, 1.2]]) == pytest.approx(1 / 1.1)
    # both vary by 0.8 / 1.2: of four combinations, one is 0.8 and three 1.2 (mean 1.1)
    assert lockstep_share([[0.8, 1.2], [8.0, 12.0]]) == pytest.approx(1 / 1.1)
    # more ranks, more waiting
    assert lockstep_share([[0.8, 1.2]] * 3) < lockstep_share([[0.8, 1.2]] * 2)
