"""``kaitian bench hetero``'s schedule of phases and how it reads them (pure functions)."""

import statistics

from kaitian.bench.hetero import _phases, _steady_state


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
    }
    steady, paired = _steady_state(history, cycles=4)
    assert steady["alone"] == 75.0 and steady["rebalance"] == 75.0
    assert steady["equal"] == 10.0
    assert paired["alone"] == 1.0  # ratios 0.99, 1.01, 0.98, 1.02
    assert 0.96 < paired["local"] < 0.98  # ratios 0.97, 0.971, 0.942, 1.0
    # each turn's ideal is its higher of solo and local: 110, 104, 52, 60
    assert paired["ideal"] == statistics.median([99 / 110, 101 / 104, 49 / 52, 51 / 60])
