"""Resume without loss: a worker is killed mid-epoch, kaitianrun restarts the job, and it
continues from its torch.distributed.checkpoint checkpoint with the same split."""

import json
import os
import subprocess
import sys

from support import repo_env, worker
from support.replay import logged_batches, max_difference, replay_weights


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
