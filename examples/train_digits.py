"""Heterogeneous data-parallel training on scikit-learn's digits (8x8 images, 10 classes).

A normal torchrun-style script with the kaitian touches: the ``kaitian``
backend, ``kaitian.device()``, a capability-aware ``DistributedSampler``,
``kaitian.DistributedDataParallel`` (exact gradients for unequal batches) and
online re-balancing. The data ship with scikit-learn; nothing is downloaded.

Run it with ``examples/run_demo.sh`` (two simulated vendor groups of different
speed), or directly::

    kaitianrun --nproc-auto --cpu-slots 2 --cpu-groups 2 --cpu-quota 1,0.33 \\
        examples/train_digits.py --epochs 25
    torchrun --nproc-per-node 2 examples/train_digits.py --backend gloo

Rank 0 prints, per epoch, each group's batch size, its throughput in the job
and its own speed (samples per second of its compute: in lock-step every
group's throughput follows the slowest, its speed does not), and at the end
the test accuracy; the exit code is 1 if it is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import kaitian  # registers the "kaitian" backend
from kaitian.settings import settings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="kaitian", help="process-group backend (kaitian, gloo)")
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=32,
                   help="per-rank batch of an equal split; the global batch is this x world size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-rebalance", action="store_true", help="keep the initial split")
    p.add_argument("--rebalance-every", default=None,
                   help="re-balance every K steps, or 'epoch' (default: every 25 steps or 10 s)")
    p.add_argument("--min-accuracy", type=float, default=0.95,
                   help="exit 1 if the final test accuracy is lower")
    return p.parse_args(argv)


def load_digits_split(seed: int):
    """The digits data set as tensors: 80 % train, 20 % test, standardised."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    to_x = lambda a: torch.tensor((a - mean) / std, dtype=torch.float32)  # noqa: E731
    to_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return TensorDataset(to_x(x_train), to_y(y_train)), TensorDataset(to_x(x_test), to_y(y_test))


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def gather_floats(values, device) -> list:
    """Every rank's list of floats (same length everywhere), via one allreduce."""
    world, rank = dist.get_world_size(), dist.get_rank()
    slots = torch.zeros(world, len(values), dtype=torch.float64, device=device)
    slots[rank] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(slots)
    return slots.cpu().tolist()


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    kaitian.set_device()
    device = kaitian.device()
    kaitian.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    group = settings().group or device.type
    groups = [None] * world
    dist.all_gather_object(groups, group)

    train_set, test_set = load_digits_split(args.seed)
    sampler = kaitian.DistributedSampler(train_set, batch_size=args.batch_size, seed=args.seed)
    model = kaitian.DistributedDataParallel(make_model(args.hidden).to(device), sampler=sampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if not args.no_rebalance:
        every = args.rebalance_every
        # with the optimizer, a rank whose step does not pay is benched (a hot spare)
        kaitian.Rebalancer(sampler, model, every=int(every) if every not in (None, "epoch") else every,
                           optimizer=optimizer)
    # batch_sampler= follows the split when the re-balancer changes it.
    loader = DataLoader(train_set, batch_sampler=sampler.batch_sampler())
    busy = [0, 0.0]  # this epoch's samples and compute seconds on this rank: its own speed

    def on_step(timing) -> None:
        busy[0] += timing.samples
        busy[1] += timing.compute_s

    model.add_step_listener(on_step)

    if rank == 0:
        print(f"kaitian digits: {world} ranks in groups {groups}, backend {args.backend}, "
              f"{len(train_set)} train / {len(test_set)} test samples, global batch "
              f"{sampler.global_batch_size}, {sampler.num_steps} steps/epoch, "
              f"re-balancing {'off' if args.no_rebalance else 'on'}\n"
              "per epoch and group: its batch, its samples/s in the job, and its speed (samples per "
              "second of its own compute)", flush=True)

    job_start = time.perf_counter()
    total_samples = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # reshuffle
        model.train()
        start = time.perf_counter()
        seen, loss_sum = 0, 0.0
        busy[:] = [0, 0.0]
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            seen += len(y)
            loss_sum += loss.item() * len(y)
        elapsed = time.perf_counter() - start
        stats = gather_floats([sampler.local_batch_size, seen, elapsed, loss_sum, *busy], device)
        total_samples += sum(s[1] for s in stats)
        if rank == 0:
            epoch_time = max(s[2] for s in stats)
            loss = sum(s[3] for s in stats) / sum(s[1] for s in stats)
            parts = []
            for name in dict.fromkeys(groups):
                members = [r for r in range(world) if groups[r] == name]
                batch = "+".join(str(int(stats[r][0])) if stats[r][0] else "benched" for r in members)
                rate = sum(stats[r][1] for r in members) / epoch_time
                speed = sum(stats[r][4] / stats[r][5] for r in members if stats[r][5] > 0)
                speed_text = f"{speed:.0f}/s" if speed else "-"
                parts.append(f"{name}: batch {batch:>7} {rate:7.0f}/s (speed {speed_text:>8})")
            total = sum(s[1] for s in stats) / epoch_time
            print(f"epoch {epoch + 1:3d}  loss {loss:.4f}  " + "  |  ".join(parts)
                  + f"  |  total {total:7.0f} samples/s", flush=True)

    job_time = time.perf_counter() - job_start
    accuracy = evaluate(model.module, test_set, device)
    if rank == 0:
        print(f"trained {args.epochs} epochs in {job_time:.1f} s "
              f"({total_samples / job_time:.0f} samples/s overall)")
        print(f"final test accuracy: {accuracy:.4f} ({len(test_set)} held-out digits)", flush=True)
    # Free DDP before the process group (torch + gloo may abort at exit otherwise).
    del model, optimizer, loader
    gc.collect()
    dist.destroy_process_group()
    return 0 if accuracy >= args.min_accuracy else 1


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: TensorDataset, device: torch.device) -> float:
    """Accuracy on the held-out set (the replicas are identical after training)."""
    model.eval()
    x, y = dataset.tensors
    predicted = model(x.to(device)).argmax(1).cpu()
    return (predicted == y).float().mean().item()


if __name__ == "__main__":
    sys.exit(main())
