"""Worker: re-balancing moves samples away from a rank made slower by real compute.

``rebalance_run.py BACKEND SLOW_RANK EXTRA OUT.json [EVERY] [slow-reduce]``: rank SLOW_RANK runs its
hidden layer EXTRA more times per sample (real forward + backward work,
multiplied by zero so the gradients stay exact - no sleep). Every rank writes
its re-balancing history; rank 0 writes all of them to OUT.json.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import kaitian
import kaitian.backend.stripes
from support.worker_env import end_process_group


class Net(torch.nn.Module):
    def __init__(self, extra):
        super().__init__()
        self.extra = extra
        self.inp = torch.nn.Linear(32, 512)
        self.hidden = torch.nn.Linear(512, 512)
        self.out = torch.nn.Linear(512, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        y = torch.relu(self.hidden(h))
        burn = 0.0
        for _ in range(self.extra):  # extra work proportional to the batch
            burn = burn + torch.relu(self.hidden(h)).sum()
        return self.out(y) + 0.0 * burn


def main():
    backend, slow_rank, extra, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    every = sys.argv[5] if len(sys.argv) > 5 else None
    every = int(every) if every not in (None, "epoch") else every
    if "slow-reduce" in sys.argv[6:]:  # rank SLOW_RANK reports a third of the host reduce speed
        import kaitian.training.rebalance as rebalance

        rebalance._reduce_speed = lambda group: 1e9 / (3 if dist.get_rank() == slow_rank else 1)
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    kaitian.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(2048, 32, generator=g), torch.randint(0, 4, (2048,), generator=g))
    sampler = kaitian.DistributedSampler(ds, batch_size=64, seed=1)
    model = kaitian.DistributedDataParallel(Net(extra if rank == slow_rank else 0))
    balancer = kaitian.Rebalancer(sampler, model, every=every, smoothing=0.7, min_gain=0.02)
    loader = DataLoader(ds, batch_sampler=sampler.batch_sampler())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    steps, sizes = [], []
    for epoch in range(5):
        sampler.set_epoch(epoch)
        n = 0
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            n += 1
            sizes.append(len(y))
        steps.append(n)
    report = {
        "rank": rank,
        "steps": steps,
        "final_split": sampler.split,
        "sizes": sizes,
        # each rank's fitted step at the equal split's 64 samples, then the split change
        "history": [[[a + b * 64 for a, b in zip(d.fixed_s, d.per_sample_s)], d.old, d.new, d.applied]
                    for d in balancer.history],
        "stripes": [d.stripes for d in balancer.history],
        "weights_in_use": kaitian.backend.stripes.stripe_weights(model.training_group),
        "comm_s": sum(t.comm_s for t in model.step_timings),
        "compute_s": sum(t.compute_s for t in model.step_timings),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    del model, balancer, opt, loader
    end_process_group()


if __name__ == "__main__":
    main()
