"""What the integration examples share: a synthetic regression task and a batch log.

Each example trains the same small fp64 MLP on the same data, so its test can
replay the logged global batches in one process and compare the weights.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional

import torch
from torch.utils.data import TensorDataset

__all__ = ["parse_args", "schedule_resplit", "make_dataset", "Rows", "make_model", "BatchLog", "save_weights"]


def parse_args(description: str, argv=None) -> argparse.Namespace:
    """The examples' options; ``capabilities`` comes back as a list or ``None``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per-rank batch of an equal split")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--capabilities", default=None, help="e.g. 3,1 (default: kaitian init's)")
    p.add_argument("--no-rebalance", action="store_true", help="keep the capability split")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--samples", type=int, default=480, help="dataset size")
    p.add_argument("--resplit", default=None,
                   help="DRAWS:SPLIT, e.g. 7:20,12: that split from the first epoch's batch DRAWS on (a change "
                        "mid-epoch, for the scripts that build their own sampler)")
    p.add_argument("--log-batches", default=None, help="directory for each rank's batch log")
    p.add_argument("--save", default=None, help="rank 0 writes the trained weights here (JSON)")
    args, _ = p.parse_known_args(argv)
    args.capabilities = [float(c) for c in args.capabilities.split(",")] if args.capabilities else None
    return args


def schedule_resplit(sampler, args: argparse.Namespace) -> None:
    """Applies ``--resplit DRAWS:SPLIT`` to a kaitian sampler; call it once the first epoch's first
    batch is in hand (a change set before an epoch starts takes effect at its start)."""
    if args.resplit:
        draws, split = args.resplit.split(":")
        handed_out = sampler.state_dict()["step"]  # the loader may have drawn ahead
        sampler.set_split([int(b) for b in split.split(",")], after_draws=int(draws) - handed_out)


def make_dataset(n: int = 480, seed: int = 0) -> TensorDataset:
    """``(x, y, index)``: y is a noisy smooth function of x; index lets a run log its batches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2] * x[:, 2:3] + 0.05 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, y, torch.arange(n))


class Rows(torch.utils.data.Dataset):
    """The shared dataset as dict rows (what the Trainer's collator expects)."""

    def __init__(self, n: int = 480) -> None:
        self.x, self.y, self.index = make_dataset(n).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i], "index": self.index[i]}


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()


class BatchLog:
    """Appends each optimizer step's sample indices of this rank to ``DIR/rank-R.jsonl``, a list
    per micro-batch (with gradient accumulation: every micro-batch of the step's window)."""

    def __init__(self, directory: Optional[str], rank: int) -> None:
        self.path = os.path.join(directory, f"rank-{rank}.jsonl") if directory else None
        self._step: List[List[int]] = []

    def add(self, index: torch.Tensor) -> None:
        """Logs one micro-batch."""
        self._step.append([int(i) for i in index])

    def step_done(self) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(self._step) + "\n")
        self._step = []


def save_weights(model: torch.nn.Module, path: Optional[str]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump([p.detach().cpu().reshape(-1).tolist() for p in model.parameters()], f)


def shut_down() -> None:
    """Ends the job's process group after the trainer is done with it.

    torch 2.13 + gloo can abort at exit ("terminate called without an active
    exception") when a DDP object outlives the process group; dropping the
    trainer's objects first and destroying the group explicitly avoids that.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()

