"""The monitor's report: communication vs imbalance wait, re-balancing rounds, the plot."""

import time

import matplotlib.figure
from matplotlib.backends.backend_agg import FigureCanvasAgg

from kaitian.monitor.agent import AgentMonitor, split_wait
from kaitian.training.ddp import StepTiming
from kaitian.training.rebalance import RebalanceDecision
from kaitian.monitor.records import StepRecorder


def test_wait_is_separated_from_communication_and_rounds_are_reported(tmp_path):
    start = time.time()
    for rank, comm in ((0, 0.030), (1, 0.005)):  # rank 1 is the slow one: it waits least
        rec = StepRecorder(str(tmp_path / f"rank-{rank}.jsonl"), rank, {"device": f"cpu:{rank}", "group": f"cpu{rank}"})
        for step in range(6):
            rec.record_step(StepTiming(step=step, samples=48 if rank == 0 else 16, global_samples=64,
                                       compute_s=0.05, comm_s=comm, step_s=0.1, end=start + 0.1 * step,
                                       wait_s=0.002))
        rec.record_rebalance(RebalanceDecision(step=3, epoch=0, per_sample_s=[1e-3, 3e-3],
                                               old=[32, 32], new=[48, 16], applied=True))
        rec.flush()
    mon = AgentMonitor(str(tmp_path))
    table = mon.report()
    waits = split_wait({0: [{"step": 0, "comm_s": 0.25}], 1: [{"step": 0, "comm_s": 0.125}]})
    assert waits == {0: [(0.125, 0.125)], 1: [(0.125, 0.0)]}
    rows = [line.split() for line in table.splitlines()[1:3]]
    # COMM MS is the allreduce itself (5 ms for both), WAIT MS the excess plus other collectives
    assert [r[9] for r in rows] == ["5.0", "5.0"]
    assert [r[10] for r in rows] == ["27.0", "2.0"]
    assert "1 re-balancing round(s), 1 changed the split (last: [48, 16] at step 3)" in table
    assert (tmp_path / "monitor.png").stat().st_size > 1000


def test_benched_ranks_and_the_predicted_step_are_reported(tmp_path, monkeypatch):
    """Rank 1 trains 4 steps, is benched at a round only rank 0 and it took part in; the table
    names it benched, shows the full step's batch (not a short last one), the last round's
    predicted and measured step and the gain over an equal split; the plot's title says what ran
    and that gain, and every legend is beside its plot, not over it."""
    start = time.time()
    round_ = RebalanceDecision(step=4, epoch=0, per_sample_s=[1e-4, 1e-3], old=[48, 16], new=[64, 0], applied=True,
                               fixed_s=[0.004, 0.05], exchange_s=0.01, predicted_s=0.0104, measured_s=0.066)
    for rank, steps in ((0, 8), (1, 4)):
        rec = StepRecorder(str(tmp_path / f"rank-{rank}.jsonl"), rank, {"device": f"cpu:{rank}", "group": f"cpu{rank}"})
        for step in range(steps):
            own = (48 if rank == 0 else 16) if step < 4 else 64
            last = step == steps - 1 and rank == 0
            rec.record_step(StepTiming(step=step, samples=20 if last else own, global_samples=20 if last else 64,
                                       compute_s=0.05, comm_s=0.01, step_s=0.1, end=start + 0.1 * step, wait_s=0.0))
        rec.record_rebalance(round_)
        rec.flush()
    figures = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k))[1])
    table = AgentMonitor(str(tmp_path), cpu_quotas={"cpu1": 0.25}).report()
    rows = [line.split() for line in table.splitlines()[1:3]]
    assert [r[5] for r in rows] == ["64", "benched"]
    assert "1 re-balancing round(s), 1 changed the split (last: [64, 0] at step 4)" in table
    assert "last round: predicted step 10.4 ms, measured 66.0 ms; benched (hot spares): rank 1" in table
    # an equal split, 32 each: rank 1's 50 + 32 ms and the 10 ms exchange, against the 10.4 ms predicted
    assert ("vs an equal split: 8.85x the throughput (the last round's step-cost model: 92.0 ms a step at "
            "an equal split)") in table
    assert (tmp_path / "monitor.png").stat().st_size > 1000
    fig, = figures
    assert fig.get_suptitle() == ("kaitian monitor: cpu0 (cpu:0) + cpu1 (cpu:1, 0.25 cores)\n"
                                  "gain over an equal split: 8.85x (step-cost model)")
    renderer = FigureCanvasAgg(fig).get_renderer()  # (the report closed the figure)
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend()]  # (no utilisation sampled here)
    assert len(legends) == 3
    for ax, legend in legends:
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


def test_each_run_starts_a_fresh_record(tmp_path):
    """A second run into the same directory moves the first one's files to previous/ (replacing
    what was kept there) instead of appending to them; other files stay."""
    (tmp_path / "notes.txt").write_text("mine")
    for run in ("first", "second"):
        mon = AgentMonitor(str(tmp_path), interval=60)
        mon.start()
        mon.stop()
        for name in ("rank-0.jsonl", "rank-1.jsonl", "utilisation.jsonl", "summary.txt", "monitor.png"):
            (tmp_path / name).write_text(run)
    mon = AgentMonitor(str(tmp_path), interval=60)
    mon.start()
    mon.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "previous"]
    kept = {p.name: p.read_text() for p in (tmp_path / "previous").iterdir()}
    assert kept == dict.fromkeys(("rank-0.jsonl", "rank-1.jsonl", "utilisation.jsonl", "summary.txt",
                                  "monitor.png"), "second")
