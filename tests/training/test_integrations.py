"""Lightning, Accelerate and the HF Trainer with kaitian: the examples under kaitianrun.

Each example runs with 2 ranks in 2 simulated vendor groups (backend kaitian)
on an unequal 3:1 split and logs every rank's batches; one process then trains
on the same global batches, and the weights must agree (fp64, 1e-9).
"""

import json
import os
import subprocess
import sys

import pytest

from support import REPO, repo_env
from support.replay import logged_batches, max_difference, replay_weights


def _run_example(tmp_path, script, *args, timeout=240):
    logs = tmp_path / "batches"
    logs.mkdir()
    weights = tmp_path / "weights.json"
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-per-node", "2", "--cpu-groups", "2",
           os.path.join(REPO, "examples", script), "--capabilities", "3,1",
           "--log-batches", str(logs), "--save", str(weights), *args]
    proc = subprocess.run(cmd, env=repo_env(), capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    sizes = [[len(json.loads(line)) for line in (logs / f"rank-{r}.jsonl").read_text().splitlines()]
             for r in range(2)]
    assert sizes[0][0] == 3 * sizes[1][0], sizes  # the 3:1 split, not re-sharded
    return json.loads(weights.read_text()), str(logs), out


def test_lightning_strategy_matches_one_process(tmp_path):
    pytest.importorskip("lightning")
    trained, logs, _ = _run_example(tmp_path, "lightning_train.py")
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1)) < 1e-9


def test_lightning_gradient_accumulation_matches_one_process(tmp_path):
    """accumulate_grad_batches=3: each optimizer step is the exact mean over its
    window's samples on every rank (15 micro-batches an epoch: no partial window)."""
    pytest.importorskip("lightning")
    trained, logs, _ = _run_example(tmp_path, "lightning_train.py", "--accumulate", "3")
    assert [len(steps) for steps in logged_batches(logs, 2)] == [10, 10]  # 2 epochs x 5 windows
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1)) < 1e-9


def test_accelerate_matches_one_process(tmp_path):
    pytest.importorskip("accelerate")
    trained, logs, _ = _run_example(tmp_path, "accelerate_train.py")
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1)) < 1e-9


def test_hf_trainer_matches_one_process(tmp_path):
    pytest.importorskip("transformers")
    trained, logs, _ = _run_example(tmp_path, "hf_trainer_train.py")
    assert max_difference(trained, replay_weights(logs, 2, lr=0.1)) < 1e-9
