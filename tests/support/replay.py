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

__all__ = ["examples_common", "replay_weights", "train_on_steps", "logged_batches", "logged_micro_batches",
           "global_batches", "max_difference"]


def examples_common():
    """The examples' shared module (dataset, model)."""
    spec = importlib.util.spec_from_file_location("examples_common", os.path.join(REPO, "examples", "common.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay_weights(log_dir: str, world: int, lr: float, momentum: float = 0.0,
                   accumulation=None, samples: int = 480) -> List[List[float]]:
    """The weights after SGD on the union of the ranks' logged batches, step by step.

    ``accumulation=k``: each step is what a trainer that divides every
    micro-batch loss by ``k`` gives in one process (Lightning's
    ``accumulate_grad_batches``, Accelerate's ``gradient_accumulation_steps``):
    the sum over the step's micro-batches of each one's global mean, over ``k``.
    Without it, each step is the mean over its whole window.
    """
    common = examples_common()
    x, y, _ = common.make_dataset(samples).tensors
    logs = logged_micro_batches(log_dir, world)
    assert len({len(log) for log in logs}) == 1, [len(log) for log in logs]
    return train_on_steps(logs, x, y, common.make_model(), lr, momentum, accumulation)


def logged_micro_batches(log_dir: str, world: int) -> List[List[List[List[int]]]]:
    """Per rank, per step, per micro-batch: the sample indices the run logged."""
    logs = []
    for rank in range(world):
        with open(os.path.join(log_dir, f"rank-{rank}.jsonl"), encoding="utf-8") as f:
            logs.append([_micro_batches(json.loads(line)) for line in f if line.strip()])
    return logs


def _micro_batches(step: list) -> List[List[int]]:
    """A step as a list of micro-batches (a flat list of indices is one)."""
    return step if step and isinstance(step[0], list) else [step]


def logged_batches(log_dir: str, world: int) -> List[List[List[int]]]:
    """Per rank, per step: the sample indices the run logged (its micro-batches in order)."""
    return [[[i for micro in step for i in micro] for step in rank]
            for rank in logged_micro_batches(log_dir, world)]


def global_batches(trained_by_rank, epochs: int, samples: int) -> List[List[int]]:
    """Each ``(epoch, step)``'s union of the ranks' ``(epoch, step, indices)`` records, in order; checks that
    every sample was trained once an epoch, whoever trained it (a spare's epochs have no records)."""
    steps = {}
    for trained in trained_by_rank:
        for epoch, step, indices in trained:
            steps.setdefault((epoch, step), []).extend(indices)
    for epoch in range(epochs):
        assert sorted(i for (e, _), part in steps.items() if e == epoch for i in part) == list(range(samples))
    return [steps[key] for key in sorted(steps)]


def train_on_steps(logs, x, y, model, lr, momentum=0.0, accumulation=None, step_lr=None):
    """SGD on each step's union of the ranks' batches (``logs``: per rank, per step, per
    micro-batch or flat; ``accumulation``: as in :func:`replay_weights`; ``step_lr``: a
    per-step ``StepLR``'s ``(step_size, gamma)``)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    schedule = torch.optim.lr_scheduler.StepLR(opt, *step_lr) if step_lr else None
    for step in zip(*logs):
        step = [_micro_batches(micros) for micros in step]
        assert len({len(micros) for micros in step}) == 1, step  # every rank the same micro-batches
        opt.zero_grad()
        if accumulation is None:
            union = [i for micros in step for micro in micros for i in micro]
            F.mse_loss(model(x[union]), y[union]).backward()
        else:
            for micro in zip(*step):
                union = [i for part in micro for i in part]
                (F.mse_loss(model(x[union]), y[union]) / accumulation).backward()
        opt.step()
        if schedule is not None:
            schedule.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def max_difference(a: List[List[float]], b: List[List[float]]) -> float:
    assert [len(p) for p in a] == [len(p) for p in b]
    return max(abs(u - v) for p, q in zip(a, b) for u, v in zip(p, q))
