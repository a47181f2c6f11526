"""Resume without loss: a worker is killed mid-epoch, kaitianrun restarts the job, and it
continues from its torch.distributed.checkpoint checkpoint with the same split."""

import json
import os
import subprocess
import sys

import pytest

from support import repo_env, worker
from support.replay import (examples_common, global_batches, logged_batches, max_difference, replay_weights,
                            train_on_steps)


def test_killed_worker_resumes_mid_epoch_without_repeats_or_gaps(tmp_path):
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-per-node", "2", "--cpu-groups", "2",
           "--max-restarts", "1", worker("resume_dcp"), "--dir", str(tmp_path), "--kill-at", "11"]
    proc = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "exitcode: -9" in out  # the kill was real
    result = json.loads((tmp_path / "result.json").read_text())
    # killed at step 11 of epoch 0 (15 steps per epoch), restarted from the step-9 checkpoint
    assert result["attempt"] == 1 and result["resumed_at"] == 9 and result["steps"] == 30
    logs = logged_batches(str(tmp_path), 2)
    for epoch in range(2):  # every sample exactly once per epoch, across the restart
        seen = sorted(i for rank in logs for step in rank[15 * epoch:15 * (epoch + 1)] for i in step)
        assert seen == list(range(480))
    sizes = [[len(s) for s in rank] for rank in logs]
    # the split set at step 5 (first used by step 7) came back after the restart, not the 3:1 start
    assert [sizes[0][5], sizes[1][5]] == [24, 8]
    assert [s[9] for s in sizes] == [s[14] for s in sizes] == result["resumed_split"] == [20, 12]
    assert result["rounds"] >= 3  # the re-balancer ran (and its state was restored)
    trained = json.loads((tmp_path / "weights.json").read_text())
    assert max_difference(trained, replay_weights(str(tmp_path), 2, lr=0.1, momentum=0.9)) < 1e-9
    assert os.path.isdir(tmp_path / "step-9")


@pytest.mark.parametrize("kill_at, resumed_at", [(20, 18), (31, 30)])
def test_a_benched_rank_is_checkpointed_by_the_trainers_and_resumed_as_a_spare(tmp_path, kill_at, resumed_at):
    """Rank 1 pays 0.1 s a step more and is benched in epoch 0; the trainers checkpoint every 3 steps in
    ``balancer.group`` while it waits, rank 0 is killed, and the restarted job resumes with rank 1 still
    benched, within epoch 1 or at its end (15 steps an epoch): every sample once per epoch, and one
    process's weights."""
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-per-node", "2", "--cpu-groups", "2",
           "--max-restarts", "1", worker("resume_dcp"), "--dir", str(tmp_path), "--bench-slow", "0.1",
           "--epochs", "3", "--kill-at", str(kill_at)]
    proc = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "exitcode: -9" in out and "rank 1 benched" in out, out[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["attempt"] == 1 and result["resumed_at"] == resumed_at and result["steps"] == 45, result
    assert result["resumed_split"] == [32, 0], result  # the premise: the checkpoint held a spare
    trained = [list(map(json.loads, (tmp_path / f"rank-{r}.jsonl").read_text().splitlines())) for r in range(2)]
    assert sorted({(e, s) for rank in trained for e, s, _ in rank}) == [(e, s) for e in range(3) for s in range(15)]
    common = examples_common()
    x, y, _ = common.make_dataset().tensors
    replay = train_on_steps([global_batches(trained, epochs=3, samples=480)], x, y, common.make_model(), lr=0.1,
                            momentum=0.9)
    assert max_difference(json.loads((tmp_path / "weights.json").read_text()), replay) < 1e-9


def test_a_collective_of_the_whole_world_while_a_rank_is_benched_fails_at_once_naming_the_group_to_use(tmp_path):
    """The same job checkpointing in the default group: its first checkpoint after the bench would wait
    for the spare until the group's timeout (30 min); it fails at once, on both ranks, saying why."""
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-per-node", "2", "--cpu-groups", "2",
           worker("resume_dcp"), "--dir", str(tmp_path), "--bench-slow", "0.1", "--epochs", "3", "--kill-at", "-1",
           "--world-checkpoints"]
    proc = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank 1 benched:" in out, out[-4000:]
    why = ("rank 1 is benched by kaitian.Rebalancer (a hot spare: in no collective until the epoch's end), so this "
           "collective would wait for it; between steps, run collectives in the training ranks' group, balancer.group")
    assert f"[rank0]: RuntimeError: kaitian allgather: {why}" in out, out[-4000:]
    spare = out.split("[rank1]: torch.distributed.DistBackendError: kaitian message to a benched rank: ")[-1]
    assert spare.startswith("the process group is broken: rank 0's allgather") and why in spare, out[-4000:]
