"""Benched ranks (hot spares) in a real 2-rank job: exact, and called back when they pay.

Two simulated vendor groups, backend kaitian, ``kaitian.Rebalancer(...,
optimizer=, state=)``; see ``workers/bench_spare.py``. Whoever trains, every
rank ends with the weights of one process trained on the same global batches
(fp64, SGD with momentum and a per-batch LR schedule, 1e-9).
"""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from support import worker
from support.ranks import Layout, cleanup, run_ranks, tail
from support.replay import global_batches


def _replay(trained_by_rank, epochs, samples=200, skipped=(), ema_sums=None, two_views=False):
    """One process on the union of each (epoch, step)'s batches: the same model, optimizer, schedule
    (``skipped``: the steps, counted over the run, without an optimizer step; ``ema_sums``: a list
    that gets the sum of an EMA of the weights, as bench_spare --ema keeps, before each step;
    ``two_views``: as bench_spare --two-views)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=g, dtype=torch.float64)
    y = torch.randn(samples, 1, generator=g, dtype=torch.float64)
    torch.manual_seed(1234)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    ema = torch.optim.swa_utils.AveragedModel(net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    for step, batch in enumerate(global_batches(trained_by_rank, epochs, samples)):
        if ema_sums is not None:
            ema_sums.append(sum(p.detach().sum().item() for p in ema.module.parameters()))
        opt.zero_grad()
        loss = F.mse_loss(net(x[batch]), y[batch])
        if two_views:
            loss = loss + F.mse_loss(net(x[batch].flip(1)), y[batch])
        loss.backward()
        if step not in skipped:
            opt.step()
            ema.update_parameters(net)
        schedule.step()
    return [p.detach().reshape(-1).tolist() for p in net.parameters()], opt.param_groups[0]["lr"]


def _run_bench_spare(layout, *flags, logs_of=0):
    """Runs workers/bench_spare.py on ``layout``; returns both ranks' reports and rank ``logs_of``'s log."""
    run = run_ranks(layout, [worker("bench_spare"), *flags], timeout=180)
    try:
        assert run.returncodes == [0, 0] and not run.timed_out, tail(run.logs[0]) + tail(run.logs[1])
        if "--probe-fails1" not in flags:
            for log in run.logs:  # a spare's probe runs on its device (the fake MLU's streams included)
                assert "cannot probe its own speed" not in open(log).read(), tail(log)
        r0, r1 = (json.load(open(out)) for out in run.outs)
        return r0, r1, tail(run.logs[logs_of], 1000)
    finally:
        cleanup(run)


def _against_the_script(history, turn=2, batch=32):
    """The rounds whose measured costs (of a full batch) order the ranks against bench_spare's script:
    rank 0 the cheaper in the rounds that measured epochs before ``turn``, rank 1 in those after."""
    against = []
    for step, epoch, old, new, fixed, per_sample in history:
        if not fixed:  # a spare's record of a round
            continue
        cost0, cost1 = (a + b * batch for a, b in zip(fixed, per_sample))
        if (cost0 > cost1) if epoch <= turn else (cost1 > cost0):
            against.append([step, epoch, old, new, fixed, per_sample])
    return against


@pytest.mark.parametrize("devices", [("cpu", "cpu"), ("mlu", "cpu")], ids=["cpu+cpu", "fake-mlu+cpu"])
def test_a_rank_that_does_not_pay_is_benched_called_back_and_every_rank_stays_exact(devices):
    """On a fake MLU rank 0's state goes to the CPU spare from the device, and comes back to the
    device when rank 0 is benched in turn (the fake accelerator punishes a missing stream wait).
    An EMA of the weights, updated after each optimizer step, is in ``state=``: every rank's, the
    spare's included, is one process's at every epoch start (the copy of the epoch's end left the
    optimizer step before the last update; the epoch start's word brings it)."""
    if "mlu" in devices:
        pytest.importorskip("kaitian.testing._fake_accelerator", reason="the fake accelerator needs torch 2.13+")
    for attempt in (1, 2, 3):  # the scripted costs are CPU time (--busy), so they stretch with load as the rest
        r0, r1, log0 = _run_bench_spare(Layout("1+1", devices=devices), "--busy", "--ema")
        assert [r0["device"], r1["device"]] == list(devices)
        ema_sums = []
        weights, lr = _replay([r0["trained"], r1["trained"]], epochs=7, ema_sums=ema_sums)
        for r in (r0, r1):  # the spare's copy too: it received the state at each epoch's end
            assert max(abs(a - b) for p, q in zip(r["weights"], weights) for a, b in zip(p, q)) < 1e-9
            assert abs(r["lr"] - lr) < 1e-15
            for epoch, ema_sum in r["ema_sums"]:
                steps_before = len({(e, s) for q in (r0, r1) for e, s, _ in q["trained"] if e < epoch})
                assert abs(ema_sum - ema_sums[steps_before]) < 1e-9, (r["rank"], epoch, ema_sum, ema_sums)
        # The premise: the ranks measure as scripted. With every core of a CI machine busy, the fake MLU's
        # first steps once measured 400 ms, and rank 1 (then a 50 ms sleep a step) alone once 356 ms: the
        # re-balancer rightly followed, and such a run shows nothing about benching and calling back, so it
        # runs again (CI once measured the fake MLU's 16-sample step at 174 ms against rank 1's 136, a sleep
        # that did not stretch, in all three runs: hence --busy).
        # Both ranks' rounds: while rank 0 is benched only rank 1 records their costs (ci71 benched rank 1
        # again in epoch 6, a decision rank 0 recorded without costs, and the run was not retried)
        contradicted = _against_the_script(r0["history"] + r1["history"])
        if not contradicted:
            break
    assert not contradicted, f"the ranks measured against the script in all three runs: {contradicted}"
    epochs_of = lambda r: {epoch for epoch, _, _ in r["trained"]}  # noqa: E731
    # rank 1 (50 ms a step) is benched for a whole epoch soon, and trains again at the end, once
    # rank 0 costs 300 ms a step (from epoch 2)
    assert not {1, 2} <= epochs_of(r1) and 6 in epochs_of(r1), json.dumps([r0["history"], r1["history"]])
    assert "rank 1 benched: the step is predicted" in log0 and "rank 1 called back with" in log0, log0


def test_a_spare_called_back_to_train_beside_the_others_keeps_the_rounds_in_step():
    """Per-sample costs: rank 1 (6 ms a sample) is benched for the exchange it adds while rank 0
    is fast, and called back to train beside it once rank 0 costs 6 ms a sample too (from epoch 2).
    The called-back rank took fewer steps than rank 0; rounds every 5 steps and rank 0's time
    votes must still come at the same steps on both (a round on one rank only breaks the group).
    Both at 6 ms: either alone would take twice the step of both (with 4 ms on rank 1, a busy CI
    machine's exchange of 50 ms once made rank 1 alone look faster, and the call-back swapped them)."""
    r0, r1, log0 = _run_bench_spare(Layout("1+1"), "--per-sample", "--slow0", "0.006", "--slow1", "0.006",
                                    "--every", "5", "--epochs", "9")
    weights, lr = _replay([r0["trained"], r1["trained"]], epochs=9)
    for r in (r0, r1):
        assert max(abs(a - b) for p, q in zip(r["weights"], weights) for a, b in zip(p, q)) < 1e-9
    assert "rank 1 benched: the step is predicted" in log0 and "rank 1 called back with" in log0, log0
    # both train from the call-back on, for several epochs of rounds every 5 steps (on a busy CI machine a
    # load spike near the end may bench a rank again: that is the re-balancer's call, not the rounds')
    after = [epoch for epoch, split in r0["shares"][1:] if min(split) > 0]
    assert len(after) >= 4 and after == list(range(after[0], after[0] + len(after))), r0["shares"]


def test_a_spare_whose_device_gets_faster_while_benched_is_called_back_by_its_probe():
    """Rank 1's model takes 0.6 s a forward (its device busy with something else), so it is
    benched; from epoch 3 on it is fast, which nothing but its own probe can see: the probe
    (every 0.2 s while it waits) publishes the new cost and an epoch start soon calls it back
    to train beside rank 0 (4 ms a sample); every rank stays exact. A spare probes only while it
    waits, and one starved on a loaded machine lags the trainers and seldom waits: rank 0's epochs
    are long enough (about 1 s) and many enough after the speedup for it to."""
    r0, r1, log0 = _run_bench_spare(Layout("1+1"), "--per-sample", "--slow0", "0.004", "--slow1", "0",
                                    "--model-delay1", "0.6", "--speedup", "3", "--probe-every", "0.2",
                                    "--epochs", "12")
    weights, lr = _replay([r0["trained"], r1["trained"]], epochs=12)
    for r in (r0, r1):
        assert max(abs(a - b) for p, q in zip(r["weights"], weights) for a, b in zip(p, q)) < 1e-9
    epochs_of_1 = {epoch for epoch, _, _ in r1["trained"]}
    assert not {1, 2, 3} & epochs_of_1, r0["history"]  # benched while slow (epoch 3's round came first)
    assert epochs_of_1 & set(range(4, 12)), r0["history"]  # called back once its probe saw it fast
    assert "rank 1 benched: the step is predicted" in log0 and "rank 1 called back with" in log0, log0


@pytest.mark.parametrize("ahead,skip_from,views", [(0, None, 1), (2, None, 1), (2, 3, 1), (2, None, 2)],
                         ids=["0", "2", "2-skipping-steps", "2-two-views"])
def test_a_rank_benched_within_an_epoch_trains_what_it_drew_and_then_waits_for_the_state(ahead, skip_from, views):
    """Rank 1 (0.4 s a forward) is benched by a round within epoch 0 (21 steps, a round every 3).
    Before its wait for the epoch's end, it trains beside rank 0 every batch its loader drew: with
    ``ahead`` 2 it is benched at a draw two steps before the trainers leave it (it waited there,
    and rank 0's next step hung). 641 samples: 20 steps of 32 and a short one, which two ranks pad
    to 2 and rank 0 alone trains as 1; the trainer counted the epoch's end against the padded size,
    so the state never came and the job hung. Each step ends with a collective in ``balancer.group``
    (a logged loss): rank 1 waits for the state in its last optimizer step, so the trainers' collective
    of that step hung on it with a loader that draws ahead; from there it is out of the group. Epoch
    0's steps from ``skip_from`` on skip the optimizer step (an AMP GradScaler's overflow): rank 1 then
    never left the group nor waited, and took the next epoch's word for the state. With two views of each
    batch (two forwards, one backward) the trainer counted the epoch's samples twice, ended its pass halfway
    and sent the spare a state that the rest of the epoch left behind."""
    skipping = [] if skip_from is None else ["--skip-from", str(skip_from)]
    skipping += ["--two-views"] if views == 2 else []
    # 0.4 s: its fit, from batches of one size, puts the forward's fixed delay on each sample; at 0.2 s, epoch
    # 1's round on a loaded CI machine once called it back with 5 samples, against this test's premise
    r0, r1, _ = _run_bench_spare(Layout("1+1"), "--per-sample", "--slow0", "0.002", "--slow1", "0",
                                 "--model-delay1", "0.4", "--epochs", "2", "--every", "3", "--samples", "641",
                                 "--ahead", str(ahead), "--sum-in-group", *skipping)
    steps_of_1 = {(epoch, step) for epoch, step, _ in r1["trained"]}  # the premise: benched within epoch 0
    assert (0, 0) in steps_of_1 and (0, 20) not in steps_of_1 and all(e == 0 for e, _ in steps_of_1), r0["history"]
    samples = {(rank, epoch, step): len(index)
               for rank, r in enumerate((r0, r1)) for epoch, step, index in r["trained"]}
    for rank, r in enumerate((r0, r1)):  # each step's sum over the group the rank was in: nobody paired wrongly
        for epoch, step, total, members in r["sums"]:
            assert total == sum(samples[(m, epoch, step)] for m in members), (rank, epoch, step, members)
    # its last step's collective: in its own group, or (its optimizer step skipped) still in the old one
    last_group = [1] if skip_from is None else [0, 1]
    assert {tuple(m) for *_, m in r0["sums"]} == {(0, 1), (0,)} and r1["sums"][-1][3] == last_group, r1["sums"]
    skipped = range(skip_from, 21) if skip_from is not None else ()
    weights, lr = _replay([r0["trained"], r1["trained"]], epochs=2, samples=641, skipped=skipped,
                          two_views=views == 2)
    for r in (r0, r1):
        assert max(abs(a - b) for p, q in zip(r["weights"], weights) for a, b in zip(p, q)) < 1e-9


@pytest.mark.parametrize("leave", [["--stop-at", "30"], ["--steps-per-epoch", "15", "--epochs", "3"]],
                         ids=["max_steps", "steps_per_epoch"])
def test_trainers_that_leave_a_pass_within_an_epoch_hand_the_spare_their_state(leave):
    """Rank 1 is benched within epoch 0 (21 steps); the loops leave a pass early: at the job's 30th step
    (``balancer.steps``, epoch 1 step 9) then ``balancer.finish()``, or after 15 steps of every epoch.
    The spare, waiting for the end of the pass, takes the state there (the finish, or the next epoch's
    start) instead of waiting for an epoch's end that never comes: both ranks end with the steps and
    the weights of one process trained on the same global batches."""
    r0, r1, _ = _run_bench_spare(Layout("1+1"), "--per-sample", "--slow0", "0.002", "--slow1", "0",
                                 "--model-delay1", "0.2", "--epochs", "2", "--every", "3", "--samples", "641", *leave)
    steps_of_1 = {(epoch, step) for epoch, step, _ in r1["trained"]}  # the premise: benched within epoch 0's pass
    assert (0, 0) in steps_of_1 and (0, 14) not in steps_of_1 and all(e == 0 for e, _ in steps_of_1), r0["history"]
    expected = 30 if "--stop-at" in leave else 45
    assert r0["steps"] == r1["steps"] == len(r0["trained"]) == expected, (r0["steps"], r1["steps"])
    weights, lr = _replay([r0["trained"], r1["trained"]], epochs=0, samples=641)
    assert r0["lr"] == r1["lr"] == lr
    for r in (r0, r1):
        assert max(abs(a - b) for p, q in zip(r["weights"], weights) for a, b in zip(p, q)) < 1e-9


def test_a_loop_left_within_an_epoch_without_finish_leaves_the_spare_failing_with_a_line_that_says_so():
    """The same max_steps loop without ``balancer.finish()``: the spare waits for epoch 1's end, which never
    comes; rank 0 ends normally. The spare fails at once (not at the group's timeout), saying what to do."""
    run = run_ranks(Layout("1+1"), [worker("bench_spare"), "--per-sample", "--slow0", "0.002", "--slow1", "0",
                                    "--model-delay1", "0.2", "--epochs", "2", "--every", "3", "--samples", "641",
                                    "--stop-at", "30", "--no-finish"], timeout=180)
    try:
        assert run.returncodes[0] == 0 and run.returncodes[1] == 1 and not run.timed_out, tail(run.logs[0])
        log = open(run.logs[1]).read()
        assert "kaitian message to a benched rank: rank 0 failed or exited" in log, tail(log)
        assert "a loop the trainers leave within an epoch (max_steps, a step limit) ends with balancer.finish()" in log
    finally:
        cleanup(run)


def test_a_spare_whose_model_the_probe_cannot_run_says_so_once_and_stays_benched_exactly():
    """The same run, but rank 1's model raises in eval mode: its first probe fails, it warns
    once and stops probing (its cost stays as last measured), so it is never called back;
    training goes on and every rank stays exact."""
    # 0.6 s a forward, as above, far above rank 0's step: at 0.2 s, rank 0 once measured 0.27 s a step on a
    # loaded CI machine and was benched for the spare's stale 0.21 s, against this test's premise
    r0, r1, log1 = _run_bench_spare(Layout("1+1"), "--per-sample", "--slow0", "0.002", "--slow1", "0",
                                    "--model-delay1", "0.6", "--speedup", "3", "--probe-every", "0.2",
                                    "--epochs", "9", "--probe-fails1", logs_of=1)
    weights, _ = _replay([r0["trained"], r1["trained"]], epochs=9)
    for r in (r0, r1):
        assert max(abs(a - b) for p, q in zip(r["weights"], weights) for a, b in zip(p, q)) < 1e-9
    assert not {epoch for epoch, _, _ in r1["trained"]} & set(range(3, 9)), r0["history"]
    assert log1.count("cannot probe its own speed while benched (RuntimeError: this model cannot run") == 1, log1


# shm tells a closed group from an exited pid; on TCP both close the connection
@pytest.mark.parametrize("bridge,how", [("shm", "raises"), ("shm", "killed"), ("tcp", "killed")])
def test_a_spare_whose_trainer_dies_fails_naming_it_instead_of_waiting_forever(bridge, how):
    """Rank 0 is slow from the start, so it is benched and rank 1 trains alone; in epoch 2 rank 1
    dies (it raises, or is killed: no exit handler closes its group). Rank 0, a spare waiting for
    the epoch's end, fails within seconds naming rank 1, instead of waiting for a message that
    cannot come (rank 0 holds the store, so the store alone cannot tell it). Rank 1 may die after it
    counted its epoch-start message but before the spare took its bytes: the spare's receive then
    names it."""
    layout = Layout("1+1", env=(("KAITIAN_BRIDGE", bridge),))
    run = run_ranks(layout, [worker("bench_spare"), "--turn", "0", "--die1", "2", "--die-how", how], timeout=90)
    try:
        log0 = open(run.logs[0]).read()
        assert not run.timed_out and run.returncodes[0] != 0 and run.returncodes[1] != 0, tail(run.logs[0])
        assert "rank 0 benched" in log0 or "rank 0 benched" in open(run.logs[1]).read(), tail(run.logs[1])
        assert re.search(r"rank 1 (\(pid \d+\) exited|failed or exited)[^;]* while this rank waited for its "
                         r"(message to a benched rank|send)", log0), tail(run.logs[0])
    finally:
        cleanup(run)


def test_an_lr_schedule_the_spares_would_not_receive_fails_at_the_first_round_on_every_rank():
    """The worker's per-batch LR schedule left out of ``state=``: a benched rank runs no step, so its
    schedule would stand still, and once called back it would train with another learning rate than
    the others (the weights silently apart). Every rank fails at the first round, before any bench,
    saying what to pass."""
    run = run_ranks(Layout("1+1"), [worker("bench_spare"), "--slow1", "0.05", "--schedule-not-in-state"],
                    timeout=120)
    try:
        logs = [open(log).read() for log in run.logs]
        assert not run.timed_out and min(run.returncodes) != 0, tail(run.logs[0]) + tail(run.logs[1])
        for log in logs:
            assert ("TrainingError: kaitian.Rebalancer: the optimizer has an LR scheduler that state= does "
                    "not hold") in log and "benched" not in log.split("TrainingError")[0], log[-3000:]
    finally:
        cleanup(run)


def test_a_spare_whose_model_differs_from_the_trainers_fails_with_one_clear_line():
    """Rank 1's model holds a buffer of 9 values where rank 0's holds 1 (DDP leaves it alone): the
    state rank 0 packs for it does not fit, and the spare says so instead of taking a part of it;
    rank 0's next message to it fails, naming rank 1."""
    run = run_ranks(Layout("1+1"), [worker("bench_spare"), "--buffer1", "9"], timeout=180)
    try:
        log0, log1 = (open(log).read() for log in run.logs)
        assert min(run.returncodes) != 0 and not run.timed_out, tail(run.logs[0]) + tail(run.logs[1])
        sent = re.search(r"TrainingError: re-balancer: rank 0 sent (\d+) bytes of tensors to a benched rank whose "
                         r"model and optimizer state take (\d+) \(a different model\?\)", log1)
        assert sent and int(sent[2]) - int(sent[1]) == 8 * 8, tail(run.logs[1])  # 8 more float64 values
        assert "rank 1 failed or exited" in log0, tail(run.logs[0])
    finally:
        cleanup(run)
