"""Worker: a GAN's two networks, each a kaitian.DistributedDataParallel, re-balanced, exact.

torchrun-style (environment, backend kaitian, JSON to ``KT_OUT``). fp64 critic ``D`` and generator ``G``;
per batch the critic's step (``D`` on the real batch and on ``G``'s detached samples: two forwards, one
backward), then the generator's (``D`` on ``G``'s samples, backward through both). Each sample's latent
comes with it from the dataset, so one process can replay the union of every step's batches. Rank 1's
critic costs ``--slow1`` s a sample a forward; ``kaitian.Rebalancer(sampler, D, optimizer=optD, state=[G,
optG])`` moves samples off it (``--no-balancer``: the split stays the sampler's, ``--capabilities``).
Every rank writes the indices it trained per (epoch, step), its splits, the re-balancer's history and
both networks' weights.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import kaitian
from support.worker_env import end_process_group


class Delay(torch.nn.Module):
    """A slower device: each forward takes ``per_sample`` s a sample longer."""

    def __init__(self, per_sample):
        super().__init__()
        self.per_sample = per_sample

    def forward(self, x):
        time.sleep(self.per_sample * len(x))
        return x


def networks(slow=0.0):
    """``(D, G)``, initialised alike on every rank and in the replay."""
    torch.manual_seed(1234)
    critic = torch.nn.Sequential(Delay(slow), torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    generator = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return critic.double(), generator.double()


def data(samples):
    """Real samples, each one's latent, and its index."""
    g = torch.Generator().manual_seed(0)
    x = 1.0 + 0.5 * torch.randn(samples, 4, generator=g, dtype=torch.float64)
    z = torch.randn(samples, 3, generator=g, dtype=torch.float64)
    return x, z


def gan_step(D, G, optD, optG, x, z):
    """One batch: the critic's step, then the generator's."""
    fake = G(z)
    optD.zero_grad()
    (F.softplus(-D(x)).mean() + F.softplus(D(fake.detach())).mean()).backward()
    optD.step()
    optG.zero_grad()
    F.softplus(-D(fake)).mean().backward()
    optG.step()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=240)
    p.add_argument("--slow1", type=float, default=0.002)
    p.add_argument("--every", type=int, default=6, help="the re-balancer's rounds: every this many critic steps")
    p.add_argument("--capabilities", default="1,1", help="the sampler's first split, as relative speeds")
    p.add_argument("--no-balancer", action="store_true")
    args, _ = p.parse_known_args()
    torch.set_num_threads(1)
    dist.init_process_group("kaitian")
    rank = dist.get_rank()
    x, z = data(args.samples)
    ds = TensorDataset(x, z, torch.arange(args.samples))
    capabilities = [float(c) for c in args.capabilities.split(",")]
    sampler = kaitian.DistributedSampler(ds, batch_size=16, capabilities=capabilities)
    critic, generator = networks(args.slow1 if rank == 1 else 0.0)
    D = kaitian.DistributedDataParallel(critic)
    G = kaitian.DistributedDataParallel(generator, sampler=sampler)
    optD = torch.optim.SGD(D.parameters(), lr=0.05, momentum=0.9)
    optG = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9)
    balancer = None
    if not args.no_balancer:
        balancer = kaitian.Rebalancer(sampler, D, every=args.every, optimizer=optD, state=[G, optG])
    loader = DataLoader(ds, batch_sampler=sampler.batch_sampler())
    trained, splits = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        splits.append(sampler.split)
        for step, (xb, zb, index) in enumerate(loader):
            gan_step(D, G, optD, optG, xb, zb)
            trained.append([epoch, step, index.tolist()])
    if balancer is not None:
        balancer.finish()
    with open(os.environ["KT_OUT"], "w") as f:
        json.dump({
            "rank": rank, "trained": trained, "splits": splits,
            "history": [[d.epoch, d.old, d.new] for d in (balancer.history if balancer else [])],
            "weights": [p.detach().reshape(-1).tolist() for net in (critic, generator) for p in net.parameters()],
        }, f)
    del D, G, balancer, optD, optG, loader
    end_process_group()


if __name__ == "__main__":
    main()
