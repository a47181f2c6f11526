"""Trains a tiny linear model with DDP on the given backend; rank 0 writes the final parameters.

Usage: train_tiny.py BACKEND OUT_DIR
Every rank sees the same data (seeded by rank), so the result can be compared
with a single-process run; each rank also records its kaitian environment.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from support.worker_env import end_process_group


def train(rank: int) -> list:
    """Five DDP steps on this rank's data; the final parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(5):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


@record
def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    if backend == "kaitian":
        import kaitian  # noqa: F401  registers the backend
    dist.init_process_group(backend)
    rank = dist.get_rank()
    info = {k: os.environ.get(k) for k in (
        "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "KAITIAN_GROUP", "KAITIAN_DEVICE_TYPE",
        "KAITIAN_DEVICE_INDEX", "TORCHELASTIC_RUN_ID", "KAITIAN_JOB_KEY")}
    info["params"] = train(rank)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)
    dist.barrier()
    end_process_group()


if __name__ == "__main__":
    main()
