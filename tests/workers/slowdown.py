"""Worker: one rank becomes 5x slower mid-epoch; the re-balancer's split must follow.

torchrun-style (environment, backend kaitian, JSON lines to ``KT_OUT``).
``--slow-from K``: from step K on, rank 1 runs its hidden layer 4 more times
per sample (real forward + backward work, multiplied by zero so the gradients
stay exact; no sleep): about 5x its compute. Every rank writes its per-step
batch sizes and the re-balancing history.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import kaitian
from support.worker_env import end_process_group
from rebalance_run import Net  # extra hidden-layer passes per sample: real, exact-gradient work


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--slow-from", type=int, default=80)
    p.add_argument("--every", default=None)
    args, _ = p.parse_known_args()
    torch.set_num_threads(1)
    dist.init_process_group("kaitian")
    rank = dist.get_rank()
    kaitian.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    n = 128 * args.steps
    ds = TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 4, (n,), generator=g))
    sampler = kaitian.DistributedSampler(ds, batch_size=64, capabilities=[1.0, 1.0])
    net = Net(0)
    model = kaitian.DistributedDataParallel(net)
    every = None if args.every is None else int(args.every)
    balancer = kaitian.Rebalancer(sampler, model, every=every)
    loader = DataLoader(ds, batch_sampler=sampler.batch_sampler())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sizes = []
    for step, (x, y) in enumerate(loader):  # one epoch: the change comes mid-epoch
        if rank == 1 and step == args.slow_from:
            net.extra = 4
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sizes.append(len(y))
    with open(os.environ["KT_OUT"], "w") as f:
        json.dump({
            "rank": rank, "sizes": sizes, "every": balancer.every, "seconds": balancer.seconds,
            "history": [[d.step, d.old, d.new, d.applied, [round(1e3 * c, 4) for c in d.fixed_s],
                         [round(1e3 * c, 4) for c in d.per_sample_s]] for d in balancer.history],
        }, f)
    del model, balancer, opt, loader
    end_process_group()


if __name__ == "__main__":
    main()
