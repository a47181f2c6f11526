"""Worker: kaitian DDP on unequal batches vs single-process training on their union.

Run under a launcher (torchrun / kaitianrun) with 2-3 ranks:
``exact_grad.py BACKEND OUT.json``. Every rank trains the same fp64 model with
kaitian.DistributedDataParallel on its capability-sized batches and, locally, a
reference model on the union of all ranks' batches of each step; rank 0 writes
the largest parameter difference seen and the timings to OUT.json.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import kaitian
from support.worker_env import end_process_group


def make_model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    ).double()


def run_case(n_samples, caps, batch_size, epochs, user_hook, rank, world):
    g = torch.Generator().manual_seed(n_samples)
    x = torch.randn(n_samples, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n_samples,), generator=g)
    dataset = list(range(n_samples))
    samplers = [
        kaitian.DistributedSampler(dataset, batch_size=batch_size, num_replicas=world, rank=q,
                                   capabilities=caps, seed=7)
        for q in range(world)
    ]
    mine = kaitian.DistributedSampler(dataset, batch_size=batch_size, capabilities=caps, seed=7)
    assert mine.split == samplers[rank].split
    model = kaitian.DistributedDataParallel(make_model())
    if user_hook:
        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    ref = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    worst, steps, sizes = 0.0, 0, set()
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        mine.set_epoch(epoch)
        per_rank = [list(s.epoch_batches()) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1, "unequal step counts"
        for step, idx in enumerate(mine.epoch_batches()):
            assert idx == per_rank[rank][step]
            sizes.add(tuple(len(per_rank[q][step]) for q in range(world)))
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            union = [i for q in range(world) for i in per_rank[q][step]]
            ref_opt.zero_grad()
            F.cross_entropy(ref(x[union]), y[union]).backward()
            ref_opt.step()
            for p, r in zip(model.module.parameters(), ref.parameters()):
                worst = max(worst, (p.detach() - r.detach()).abs().max().item())
            steps += 1
    timings = list(model.step_timings)
    return {
        "worst": worst,
        "steps": steps,
        "sizes": sorted(sizes),
        "timed_steps": len(timings),
        "compute_positive": all(t.compute_s > 0 for t in timings),
        "global_samples": sorted({t.global_samples for t in timings}),
    }


def main():
    backend, out = sys.argv[1], sys.argv[2]
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    caps = [3.0, 2.0, 1.0, 1.5][:world]
    results = {
        "short_last": run_case(53, caps, 4, 2, False, rank, world),
        "padded_last": run_case(4 * world * 4 + 1, caps, 4, 1, False, rank, world),
        "user_hook": run_case(53, caps, 4, 1, True, rank, world),
    }
    group = os.environ.get("KAITIAN_GROUP", "")
    # capabilities from each rank's KAITIAN_CAPABILITY, exchanged through the group
    os.environ["KAITIAN_CAPABILITY"] = str(10.0 * (rank + 1))
    results["env_split"] = kaitian.DistributedSampler(range(100), batch_size=10).split
    results["optimize_batch_size"] = kaitian.optimize_batch_size(10)  # the same split, from the same values
    del os.environ["KAITIAN_CAPABILITY"]
    gathered = [None] * world
    dist.all_gather_object(gathered, {"group": group, **results})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    end_process_group()


if __name__ == "__main__":
    main()
