"""Replays an integration example's logged global batches in one process.

The examples in ``examples/`` log every rank's sample indices per optimizer
step; training the same model on the union of each step's batches in one
process is what the distributed run must reproduce.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import List

import torch
import torch.nn.functional as F

from support import REPO

__all__ = ["examples_common", "replay_weights", "train_on_steps", "logged_batches", "max_difference"]


def examples_common():
    """The examples' shared module (dataset, model)."""
    spec = importlib.util.spec_from_file_location("examples_common", os.path.join(REPO, "examples", "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay_weights(log_dir: str, world: int, lr: float, momentum: float = 0.0,
                   lightning_window=None) -> List[List[float]]:
    """The weights after SGD on the union of the ranks' logged batches, step by step.

    ``lightning_window=(micro_batch, accumulate)``: each step is what Lightning's
    ``accumulate_grad_batches`` gives in one process on global micro-batches of
    ``micro_batch`` samples: every micro-batch loss divided by ``accumulate``,
    so a short last window of m micro-batches is the window mean times m / accumulate.
    """
    common = examples_common()
    x, y, _ = common.make_dataset().tensors
    logs = logged_batches(log_dir, world)
    assert len({len(log) for log in logs}) == 1, [len(log) for log in logs]
    return train_on_steps(logs, x, y, common.make_model(), lr, momentum, lightning_window)


def logged_batches(log_dir: str, world: int) -> List[List[List[int]]]:
    """Per rank, per step: the sample indices the run logged."""
    logs = []
    for rank in range(world):
        with open(os.path.join(log_dir, f"rank-{rank}.jsonl"), encoding="utf-8") as f:
            logs.append([json.loads(line) for line in f if line.strip()])
    return logs


def train_on_steps(logs, x, y, model, lr, momentum=0.0, lightning_window=None):
    """SGD on each step's union of the ranks' batches (``logs``: per rank, per step)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in zip(*logs):
        union = [i for part in step for i in part]
        scale = 1.0
        if lightning_window is not None:
            micro_batch, accumulate = lightning_window
            assert len(union) % micro_batch == 0, (len(union), micro_batch)
            scale = len(union) // micro_batch / accumulate
        opt.zero_grad()
        (F.mse_loss(model(x[union]), y[union]) * scale).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def max_difference(a: List[List[float]], b: List[List[float]]) -> float:
    assert [len(p) for p in a] == [len(p) for p in b]
    return max(abs(u - v) for p, q in zip(a, b) for u, v in zip(p, q))
