"""What the integration examples share: a synthetic regression task and a batch log.

Each example trains the same small fp64 MLP on the same data, so its test can
replay the logged global batches in one process and compare the weights.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional

import torch
from torch.utils.data import TensorDataset

__all__ = ["make_dataset", "make_model", "BatchLog", "save_weights"]


def make_dataset(n: int = 480, seed: int = 0) -> TensorDataset:
    """``(x, y, index)``: y is a noisy smooth function of x; index lets a run log its batches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2] * x[:, 2:3] + 0.05 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, y, torch.arange(n))


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


class BatchLog:
    """Appends each optimizer step's sample indices of this rank to ``DIR/rank-R.jsonl``."""

    def __init__(self, directory: Optional[str], rank: int) -> None:
        self.path = os.path.join(directory, f"rank-{rank}.jsonl") if directory else None
        self._step: List[int] = []

    def add(self, index: torch.Tensor) -> None:
        self._step.extend(int(i) for i in index)

    def step_done(self) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(self._step) + "\n")
        self._step = []


def save_weights(model: torch.nn.Module, path: Optional[str]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump([p.detach().cpu().reshape(-1).tolist() for p in model.parameters()], f)
