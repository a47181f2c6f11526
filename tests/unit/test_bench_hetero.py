"""``kaitian bench hetero``'s schedule of phases and how it reads them (pure functions)."""

from kaitian.bench.hetero import _phases, _steady_state


def test_alone_rebalancing_and_local_take_turns_and_every_part_takes_every_position():
    assert _phases(0, 2) == ["solo", "equal", "static", *["alone", "rebalance", "local"] * 2]
    assert _phases(1, 1) == ["solo", "static", "rebalance", "local", "alone", "equal"]
    assert _phases(2, 1) == ["solo", "local", "alone", "rebalance", "equal", "static"]
    firsts = {_phases(c, 1)[1] for c in range(3)}
    assert firsts == {"equal", "static", "local"}
    leads = {next(m for m in _phases(c, 1) if m in ("alone", "rebalance", "local")) for c in range(3)}
    assert leads == {"alone", "rebalance", "local"}


def test_the_factors_pair_epochs_run_back_to_back():
    # the machine halves its speed in cycle 3: medians of each mode mix fast and slow epochs,
    # the pairs do not; cycles 0 and 1 (converging) are left out
    history = {
        "solo": [(c, 1.0) for c in range(4)],
        "equal": [(c, 10.0) for c in range(4)],
        "static": [(c, 20.0) for c in range(4)],
        "alone": [(0, 100.0), (1, 100.0), (2, 100.0), (2, 100.0), (3, 50.0), (3, 50.0)],
        "local": [(0, 100.0), (1, 100.0), (2, 102.0), (2, 104.0), (3, 52.0), (3, 51.0)],
        "rebalance": [(0, 10.0), (1, 10.0), (2, 99.0), (2, 101.0), (3, 49.0), (3, 51.0)],
    }
    steady, paired = _steady_state(history, cycles=4)
    assert steady["alone"] == 75.0 and steady["rebalance"] == 75.0
    assert steady["equal"] == 10.0
    assert paired["alone"] == 1.0  # ratios 0.99, 1.01, 0.98, 1.02
    assert 0.96 < paired["local"] < 0.98  # ratios 0.97, 0.971, 0.942, 1.0
