"""``kaitianrun --on-failure continue`` with kaitian.elastic.Trainer, end to end.

Real workers on two simulated vendor groups (``--cpu-groups 2``, the second
slower: ``--cpu-quota``) train the examples' fp64 MLP; the worker script
(``workers/elastic_train.py``) kills (SIGKILL) or stops (SIGSTOP) itself at a
chosen point of a chosen step. Whatever is lost, the run must apply every
global batch exactly once, in order, and end with the weights of one process
trained on them (``support.elastic.check_exact``).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from support import REPO, repo_env
from support.elastic import assert_one_process_weights, check_exact, expected_batches, run_elastic

GLOBAL_BATCH = 48  # 3 workers x 16: 10 steps per epoch of 480 samples
# Enough steps that every restarted worker is back before the run ends on a loaded machine: a
# restart takes 10-30 s there, and while one is pending each step sleeps --degraded-sleep (1 s);
# steps with every worker back take milliseconds, so the margin costs next to nothing.
EPOCHS = 16


def _by_kind(run, kind):
    return [e for e in run.events() if e["kind"] == kind]


def _generation_of(steps, applied):
    """The generation that applied step ``applied`` (1-based)."""
    return steps[applied - 1][0]["generation"]


def _members_of(steps, applied):
    return {r["member"] for r in steps[applied - 1]}


def _failures(run):
    """(point, steps applied before it, launch rank, incarnation) of each failure the workers caused."""
    found = re.findall(r"test: \S+/(\d+)/(\d+) fails \((\w+)\) at step (\d+)", run.output)
    return sorted((where, int(step), int(rank), int(inc)) for rank, inc, where, step in found)


def test_sigkill_in_forward_allreduce_and_optimizer_step_each_rejoins(tmp_path):
    """A loss at each point of a step; a lost worker restarts and rejoins with the live state (the
    next loss waits until it is back)."""
    run = run_elastic(
        tmp_path,
        ["--nproc-per-node", "3", "--cpu-groups", "2", "--cpu-quota", "1,0.5", "--max-restarts", "3"],
        ["--epochs", str(EPOCHS), "--fail", "forward@3:1", "--fail", "allreduce@11:2", "--fail", "optimizer@19:0",
         "--degraded-sleep", "1"],
    )
    assert run.returncode == 0, run.output[-6000:]
    steps = check_exact(run, epochs=EPOCHS, global_batch=GLOBAL_BATCH)
    failures = _failures(run)
    assert [(w, r, i) for w, _, r, i in failures] == [("allreduce", 2, 0), ("forward", 1, 0), ("optimizer", 0, 0)]
    for where, done, victim, _ in failures:
        first = run.member(victim, 0)
        if where == "optimizer":
            # killed after the commit: the others applied the step (the victim's share included,
            # not logged by it), and the next step is the first without it
            assert first in _members_of(steps, done) and first not in _members_of(steps, done + 1)
            assert len(steps[done]) == steps[done][0]["world"] - 1
            assert _generation_of(steps, done + 2) > _generation_of(steps, done + 1)
        else:
            # the step in flight was discarded everywhere and redone by the survivors, re-split
            assert first in _members_of(steps, done) and first not in _members_of(steps, done + 1)
            assert _generation_of(steps, done + 1) > _generation_of(steps, done)
            assert steps[done][0]["world"] == len(steps[done])
        if where != "optimizer":  # the next failure waited for it: it came back
            assert any(e["kind"] == "joined" and e["member"] == run.member(victim, 1) for e in run.events())


def test_last_rank_of_a_vendor_then_all_but_one_lost_with_torch_ddp(tmp_path):
    """The only rank of cpu1 is lost, then another: the last survivor trains alone to the end
    (no restarts left: the job of one goes on and succeeds). torch's DDP with scale_loss, whose
    count the trainer passes: 473 samples end each epoch with a short step of 41 (9 full steps)."""
    run = run_elastic(
        tmp_path,
        ["--nproc-per-node", "3", "--cpu-groups", "2", "--max-restarts", "0"],
        ["--ddp", "torch", "--fail", "forward@3:2", "--fail", "forward@8:1", "--fail-any-world",
         "--degraded-sleep", "0", "--samples", "473"],
    )
    assert run.returncode == 0, run.output[-6000:]
    steps = check_exact(run, epochs=2, global_batch=GLOBAL_BATCH, samples=473)
    assert [r["split"] for r in steps[3]] == [[24, 24]] * 2  # cpu1 gone: cpu0's two ranks
    assert [r["split"] for r in steps[8]] == [[48]]  # then one rank holds the whole global batch
    assert {r["member"] for r in steps[-1]} == {run.member(0, 0)}
    assert "the others go on without it" in run.output


def test_without_torch_sharing_its_store_rank_0_is_lost_and_the_others_go_on(tmp_path):
    """torch before 2.5 (and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 after) has worker rank 0 host the
    workers' store, which would die with it: node 0's agent serves the store itself, from the first
    start, and rank 0 is lost without taking the job's store along."""
    run = run_elastic(
        tmp_path,
        ["--nproc-per-node", "3", "--cpu-groups", "2", "--max-restarts", "0"],
        ["--fail", "forward@3:0", "--fail-any-world", "--degraded-sleep", "0"],
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    assert run.returncode == 0, run.output[-6000:]
    steps = check_exact(run, epochs=2, global_batch=GLOBAL_BATCH)
    assert run.member(0, 0) not in {r["member"] for r in steps[3]}
    assert len(steps[3]) == 2 and {r["member"] for r in steps[-1]} == {run.member(1, 0), run.member(2, 0)}


def test_whole_vendor_group_then_sigstop_with_two_more_losses_while_it_is_handled(tmp_path):
    """Four workers, cpu0 x2 and cpu1 x2, re-balancing: both cpu1 ranks die at once; once they are
    back, rank 1 stops (SIGSTOP): the others time out, and while they agree, rank 3 dies, and rank 2
    dies once the decision that still counts it is made. Rank 0 goes on alone; the stopped worker is
    left out, killed by its agent and restarted; everyone rejoins."""
    # Five restarts are planned; three to spare, so that a member a starved machine times out
    # once more (4 s) still comes back, and the last planned loss with it.
    run = run_elastic(
        tmp_path,
        ["--nproc-per-node", "4", "--cpu-groups", "2", "--cpu-quota", "1,0.5", "--max-restarts", "8"],
        ["--epochs", str(EPOCHS), "--rebalance", "--fail", "forward@3:2", "--fail", "forward@3:3",
         "--fail", "stop@8:1", "--fail", "lost@8:3", "--fail", "agreed@8:2", "--fail", "full@9:0",
         "--degraded-sleep", "1"],
    )
    assert run.returncode == 0, run.output[-6000:]
    steps = check_exact(run, epochs=EPOCHS, global_batch=64)
    failures = _failures(run)
    assert [(w, r) for w, _, r, _ in failures] == [("agreed", 2), ("forward", 2), ("forward", 3), ("lost", 3),
                                                  ("stop", 1)], failures
    cut = next(done for where, done, _, _ in failures if where == "forward")
    assert {r["member"].rsplit("_", 2)[1] for r in steps[cut]} == {"0", "1"}  # only cpu0 left, one group
    stop = next(done for where, done, _, _ in failures if where == "stop")
    after = steps[stop]  # the stopped step, redone
    assert [r["member"] for r in after] == [run.member(0, 0)] and after[0]["world"] == 1
    assert "was left out of generation" in run.output  # its agent killed the stopped worker
    events = run.events()
    lost = [e for e in events if e["kind"] == "lost" and e["member"] == run.member(0, 0)]
    assert any("timed out" in e["detail"] for e in lost), lost  # the stop: noticed after the group timeout
    assert any(e["detail"].endswith("was forming") and "left while generation" in e["detail"] for e in lost)
    assert (tmp_path / "out" / "fired-full-9-0").exists(), run.output[-6000:]  # all four came back, the stopped one too
    assert any(e["kind"] == "joined" and e["member"] == run.member(1, 1) for e in events)  # the stopped one's next


@pytest.mark.parametrize("slow", ["0.3", "0.8"])
def test_a_benched_rank_is_called_back_when_a_training_rank_is_lost(tmp_path, slow):
    """Every sample costs 5 ms; launch rank 2 (cpu1) costs 0.3 s more a step and is benched (a hot
    spare, in no step's collective). Rank 1 is lost in epoch 1: the spare trains in the next
    generation with the same global batch, from rank 0's live state (or, when a busy machine had
    rank 0 benched too, from the spares' copy of the epoch's end: those steps are redone), and the
    run is exact. At 0.8 s the new generation's first round (its pass began mid-epoch, at step 5)
    benches it again at the epoch's last step: the epoch start's round, in the group both ranks are
    still in, does it (a switch made there, with one rank deciding alone, had them apart)."""
    run = run_elastic(
        tmp_path,
        ["--nproc-per-node", "3", "--cpu-groups", "2", "--max-restarts", "0"],
        ["--epochs", "3", "--rebalance", "--sample-sleep", "0.005", "--slow", f"2:{slow}", "--fail",
         "forward@15:1", "--degraded-sleep", "0"],
    )
    assert run.returncode == 0, run.output[-6000:]
    assert {e["generation"] for e in _by_kind(run, "lost")} == {0}, run.output[-6000:]  # rank 1's loss only
    check_exact(run, epochs=3, global_batch=GLOBAL_BATCH)
    spare, records = run.member(2, 0), [r for recs in run.steps().values() for r in recs]
    before = {(r["applied"], r["member"]) for r in records if r["generation"] == 0}
    assert any((applied, spare) not in before for applied, _ in before)  # benched before the loss
    assert "rank 2 benched: the step is predicted" in run.output, run.output[-4000:]
    after = [r for r in records if r["generation"] > 0]
    assert after and {r["member"] for r in after} >= {spare}  # called back: it trains in the next generation
    assert run.member(1, 0) not in {r["member"] for r in after}


def test_a_lone_trainer_learns_of_the_next_generation_a_spare_announced(tmp_path):
    """Launch ranks 1 and 2 cost 0.4 s more a step: both are benched, and rank 0 trains alone, in no
    collective with anyone until the epoch ends. Spare 2 dies in epoch 2; spare 1 learns it (its agent
    says so) and announces the next generation. Rank 0 learns of it within a step, not at the epoch's
    end, after the quorum deadline (3 s) that would leave it out: it is in the next generation, goes
    on from its live state, and the run is exact."""
    run = run_elastic(
        tmp_path,
        ["--nproc-per-node", "3", "--cpu-groups", "2", "--max-restarts", "0"],
        ["--epochs", "4", "--rebalance", "--step-sleep", "0.5", "--slow", "1:0.4,2:0.4", "--spare-dies", "21:2",
         "--degraded-sleep", "0"],
    )
    assert run.returncode == 0, run.output[-6000:]
    assert "dies as a spare" in run.output, run.output[-6000:]
    agreed = [[m.replace(":", "_").replace("/", "_") for m in e["members"]]
              for e in _by_kind(run, "agreed") if e["generation"] == 1]
    assert agreed and all(run.member(0, 0) in members and run.member(2, 0) not in members for members in agreed)
    assert "was left out" not in run.output, run.output[-6000:]
    check_exact(run, epochs=4, global_batch=GLOBAL_BATCH)


@pytest.mark.parametrize("fails,goes_on_after", [(["applied@10:1"], 10), (["forward@15:0", "forward@15:1"], 10)],
                         ids=["a-trainer-as-the-epoch-ends", "every-trainer-within-the-next"])
def test_a_spare_called_back_trains_on_with_the_live_schedule(tmp_path, fails, goes_on_after):
    """As above, with a per-step LR schedule stepped after each optimizer step. The spare's copy of
    epoch 0's end left the optimizer step before the schedule's step, which the trainers' word at
    epoch 1's start brings. A trainer lost after epoch 0's last optimizer step, before that word:
    the spare, as far as the trainers, takes a surviving trainer's live state; every trainer lost
    within epoch 1: the spare goes on from its copy of epoch 0's end, complete. Either way, not a
    schedule step behind (the ranks' weights silently apart, or off one process's)."""
    run = run_elastic(
        tmp_path,
        ["--nproc-per-node", "3", "--cpu-groups", "2", "--max-restarts", "0"],
        ["--epochs", "2", "--rebalance", "--sample-sleep", "0.005", "--slow", "2:0.3", "--degraded-sleep", "0",
         "--step-lr", "3:0.5", *(f"--fail={spec}" for spec in fails)],
    )
    assert run.returncode == 0, run.output[-6000:]
    spare, records = run.member(2, 0), [r for recs in run.steps().values() for r in recs]
    assert {r["applied"] for r in records if r["member"] == spare and r["generation"] == 0} < set(range(1, 11))
    after = [r for r in records if r["generation"] > 0]
    assert spare in {r["member"] for r in after}  # benched in epoch 0, called back
    assert min(r["applied"] for r in after) == goes_on_after + 1, run.output[-6000:]
    check_exact(run, epochs=2, global_batch=GLOBAL_BATCH, step_lr=(3, 0.5))


def test_example_goes_on_when_a_worker_is_killed_from_outside(tmp_path):
    """examples/elastic_train.py as the README runs it; a worker is SIGKILLed (by the test) mid-training."""
    logs = tmp_path / "batches"
    logs.mkdir()
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--standalone", "--nproc-per-node", "3", "--cpu-groups",
           "2", "--on-failure", "continue", "--max-restarts", "1", os.path.join(REPO, "examples", "elastic_train.py"),
           "--epochs", "30", "--log-batches", str(logs), "--save", str(tmp_path / "w.json")]
    proc = subprocess.Popen(cmd, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len([p for p in logs.iterdir() if p.stat().st_size > 200]) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
            time.sleep(0.02)
        victim = max(int(p.stem) for p in logs.iterdir())
        os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    assert "generation 1: 2 workers" in output and "done: 300 steps" in output
    batches = expected_batches(30, GLOBAL_BATCH)
    trained = {}
    for path in logs.iterdir():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            trained.setdefault(rec["applied"], []).extend(rec["indices"])
    assert sorted(trained) == list(range(1, 301))
    for applied, indices in trained.items():  # a rank killed after the commit logs nothing for its last step
        assert set(indices) <= set(batches[applied - 1]) and len(indices) == len(set(indices))
    assert_one_process_weights(str(tmp_path / "w.json"), batches)


def test_an_lr_schedule_a_joiner_would_not_receive_fails_every_worker_before_its_first_step(tmp_path):
    """A per-step LR schedule made after the trainer and left out of ``stateful=``: a worker that
    joins or comes back takes the model and the optimizer from the others, but its schedule would
    start again and step with another learning rate (the weights silently apart). Every worker
    fails before its first step, saying what to pass."""
    run = run_elastic(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "0"], ["--schedule-not-stateful"],
                      timeout=120)
    assert run.returncode != 0 and not run.steps(), run.output[-4000:]
    line = ("TrainingError: kaitian.elastic.Trainer: the optimizer has an LR scheduler that stateful= does not hold; "
            "a worker that joins or comes back")
    assert run.output.count(line) == 2, run.output[-4000:]


def test_a_script_without_the_trainer_is_restarted_as_under_restart(tmp_path):
    """Continue mode needs kaitian.elastic.Trainer; a plain script that loses a worker is restarted whole."""
    proc = subprocess.run(
        [sys.executable, "-m", "kaitian.launcher.cli", "--standalone", "--nproc-per-node", "2", "--on-failure",
         "continue", "--max-restarts", "1", os.path.join(REPO, "tests", "workers", "crash_once.py"), str(tmp_path)],
        env=repo_env(), capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "never formed a kaitian.elastic job" in proc.stderr
    assert sorted(p.read_text() for p in tmp_path.glob("ok.*")) == ["1 3.0", "1 3.0"]  # both ran again
