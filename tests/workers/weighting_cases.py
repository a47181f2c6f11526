"""Worker: exact global-batch gradients in every case, both ways kaitian offers.

A torchrun-style worker (RANK / WORLD_SIZE / MASTER_* from the environment,
backend kaitian). For each case it trains an fp64 model on unequal per-rank
batches twice - with ``kaitian.DistributedDataParallel`` and with torch's own
DDP plus ``kaitian.scale_loss`` - and, on every rank, a reference model on the
union of all ranks' batches in one process. Each case's largest parameter
difference goes to ``KT_OUT`` as one JSON line per case and mode.
"""

import argparse
import gc
import warnings
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import kaitian
import kaitian.errors
from kaitian.errors import TrainingError
from support.worker_env import end_process_group

# per step, per rank, per micro-batch: batch sizes (2 ranks)
SIZES = {
    "unequal": [[[7], [3]], [[2], [8]], [[5], [5]], [[9], [1]]],
    "coupled": [[[7], [3]], [[2], [8]], [[6], [4]]],
    "eval_forward": [[[7], [3]], [[2], [8]], [[6], [4]]],
    "no_sync": [[[7, 6], [3, 4]], [[7, 2], [3, 4]], [[1, 5], [9, 2]]],
    "builtin_hook": [[[7], [3]], [[2], [8]], [[6], [4]]],
    "python_hook": [[[7], [3]], [[2], [8]]],
    "tokens": [[[7], [3]], [[2], [8]], [[6], [4]]],
    "join": [[[7], [3]], [[2], [8]], [[6], []]],  # rank 1 runs out of data in step 3
    "two_views": [[[7], [3]], [[2], [8]], [[6], [4]]],  # two forwards, one backward (siamese, a GAN's critic)
}


class GlobalBatchNorm(torch.nn.Module):
    """Batch norm over the global batch (what SyncBatchNorm does on GPUs): couples the ranks' forward."""

    def __init__(self, width, distributed):
        super().__init__()
        self.distributed = distributed
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.zeros(width, dtype=torch.float64))

    def forward(self, x):
        stats = torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([x.shape[0]])])
        if self.distributed:
            stats = dist_nn.all_reduce(stats)
        w = x.shape[1]
        n = stats[-1]
        mean = stats[:w] / n
        var = stats[w:2 * w] / n - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class Net(torch.nn.Module):
    def __init__(self, case, distributed):
        super().__init__()
        torch.manual_seed(1234)
        self.inp = torch.nn.Linear(5, 16).double()
        self.norm = GlobalBatchNorm(16, distributed) if case == "coupled" else torch.nn.Identity()
        self.out = torch.nn.Linear(16, 3).double()

    def forward(self, x, mask=None):
        return self.out(torch.tanh(self.norm(self.inp(x))))


def loss_of(case, model, x, y, mask):
    out = model(x, mask) if case == "tokens" else model(x)
    if case == "tokens":  # mean over real (unmasked) tokens, as language models do
        per_token = F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction="none")
        m = mask.reshape(-1)
        return (per_token * m).sum() / m.sum(), int(m.sum())
    if case == "two_views":  # the batch and a second view of it through the same model before the backward
        return F.cross_entropy(out, y) + F.cross_entropy(model(x.flip(1)), y), len(y)
    return F.cross_entropy(out, y), len(y)


def data_for(case, idx, x, y, lengths):
    if case != "tokens":
        return x[idx], y[idx], None
    xs = x[idx].unsqueeze(1).repeat(1, 4, 1) + torch.arange(4, dtype=torch.float64).view(1, 4, 1)
    ys = y[idx].unsqueeze(1).repeat(1, 4)
    mask = (torch.arange(4).view(1, 4) < lengths[idx].view(-1, 1)).double()
    return xs, ys, mask


def run(case, mode, rank, world):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(400, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (400,), generator=g)
    lengths = torch.randint(1, 5, (400,), generator=g)
    net = Net(case, distributed=True)
    ref = Net(case, distributed=False)
    if mode.startswith("kaitian"):
        count = (lambda inputs, kwargs: int(inputs[1].sum())) if case == "tokens" else None
        # kaitian-copy: torch's default of copying gradients out of the buckets
        extra = {"gradient_as_bucket_view": False} if mode == "kaitian-copy" else {}
        model = kaitian.DistributedDataParallel(net, count_samples=count, **extra)
    else:
        model = TorchDDP(net)
    if case == "builtin_hook":
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
    if case == "python_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    worst, cursor = 0.0, 0
    if case == "join":
        if mode == "kaitian":
            try:
                model.join()
            except TrainingError as exc:
                return {"refused": str(exc)[:80]}
            return {"refused": False}
        context = model.join()
    else:
        context = None
    steps = SIZES[case]
    if context is not None:
        context.__enter__()
    for step in steps:
        # every rank's micro-batches of this step, drawn in the same order everywhere
        micro = []
        for r in range(world):
            sizes = step[r]
            micro.append([])
            for n in sizes:
                micro[r].append(list(range(cursor, cursor + n)))
                cursor += n
        mine = micro[rank]
        if not mine:
            break  # out of data: torch's join shadows the remaining steps
        all_counts = [[loss_of(case, ref, *data_for(case, i, x, y, lengths))[1] for i in m] for m in micro]
        window_total = sum(sum(c) for c in all_counts)
        opt.zero_grad()
        if case == "eval_forward":  # validation with grad enabled and no backward
            model.eval()
            model(x[300:300 + 3 + rank * 5])
            model.train()
        for k, idx in enumerate(mine):
            last = k == len(mine) - 1
            ctx = model.no_sync() if not last else _null()
            with ctx:
                loss, n = loss_of(case, model, *data_for(case, idx, x, y, lengths))
                if mode == "torch":
                    total = window_total if case in ("no_sync", "join") else None
                    kaitian.scale_loss(loss, count=n, total=total).backward()
                else:  # the usual accumulation convention: kaitian's DDP weights it
                    # itself; "plain" is torch's DDP alone, the control that must be off
                    (loss / len(mine)).backward()
        opt.step()
        union = [i for m in micro for part in m for i in part]
        ref_opt.zero_grad()
        loss, _ = loss_of(case, ref, *data_for(case, union, x, y, lengths))
        loss.backward()
        ref_opt.step()
        for p, q in zip(net.parameters(), ref.parameters()):
            worst = max(worst, (p.detach() - q.detach()).abs().max().item())
    if context is not None:
        context.__exit__(None, None, None)
    timed = [[t.samples, t.global_samples] for t in getattr(model, "step_timings", [])]
    return {"worst": worst, "steps": len(steps), "timed": timed,
            "bucket_view": bool(getattr(model, "gradient_as_bucket_view", False)),
            "alone": bool(getattr(model, "_kt_solo", False))}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class TwoHeads(torch.nn.Module):
    """A trunk and two heads, one per forward: each forward trains part of the model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.trunk = torch.nn.Linear(5, 4).double()
        self.heads = torch.nn.ModuleList([torch.nn.Linear(4, 1).double() for _ in range(2)])

    def forward(self, x, head):
        return self.heads[head](torch.tanh(self.trunk(x)))


def hardening(rank, world):
    """Ranks at different steps are named, a DataLoader batch_size that is not the rank's share is
    refused at the first step, and BatchNorm raises the sampler's minimum batch: through the sampler
    given to kaitian's DDP and to scale_loss."""
    result = {"case": "hardening"}
    try:  # the pre-torch-order call DistributedSampler(ds, 64) meant batch_size=64
        kaitian.DistributedSampler(range(100), 64)
        result["positional"] = "accepted"
    except kaitian.errors.SplitError as exc:
        result["positional"] = str(exc)
    sampler = kaitian.DistributedSampler(range(37), batch_size=8, capabilities=[7.0, 1.0])

    def batch_norm_model():
        net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4)).double()
        return kaitian.DistributedDataParallel(net, sampler=sampler)

    def step(mode, model, x):
        loss = model(x).pow(2).mean()
        if mode == "torch":
            kaitian.scale_loss(loss, count=len(x), sampler=sampler)
        else:
            loss.backward()

    model = batch_norm_model()
    result["min_batch"] = sampler.min_batch_size
    result["sizes"] = [len(b) for b in sampler.epoch_batches()]
    for mode in ("torch", "kaitian"):
        steps = 3 if rank == 0 else 2  # rank 1's loader is one batch short
        try:
            for epoch in range(2):
                sampler.set_epoch(epoch)
                for _ in range(steps):
                    step(mode, model, torch.randn(4, 5, dtype=torch.float64))
            result[mode] = "not caught"
        except TrainingError as exc:
            result[mode] = str(exc)
        model = batch_norm_model()
    data = torch.utils.data.TensorDataset(torch.randn(37, 5, dtype=torch.float64))
    for mode in ("torch", "kaitian"):
        sampler.set_epoch(2)
        result[f"loader {mode} steps"] = 0
        try:  # the torch habit: batch_size=8 on every rank, not the rank's share
            for (x,) in torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler):
                step(mode, model, x)
                result[f"loader {mode} steps"] += 1
            result[f"loader {mode}"] = "not caught"
        except TrainingError as exc:
            result[f"loader {mode}"] = str(exc)
        model = batch_norm_model()
    # one head per forward, summed into one loss, one bucket per parameter: the first bucket is ready
    # before the other forward's outputs got their gradient, so the count exchange missed its samples
    heads = kaitian.DistributedDataParallel(TwoHeads(), bucket_cap_mb=1e-6)
    result["late forward"] = "not caught"
    try:
        for _ in range(3):  # DDP orders its buckets by the gradients' arrival after the first step
            x = torch.randn(4 + rank, 5, dtype=torch.float64)
            (heads(x, 0).pow(2).mean() + heads(x, 1).pow(2).mean()).backward()
    except TrainingError as exc:
        result["late forward"] = str(exc)
    return result


def main():
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.nn's notice
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(SIZES))
    p.add_argument("--backend", default="kaitian")
    args, _ = p.parse_known_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world in (1, 2), "the cases are written for 2 ranks (a world of one trains rank 0's batches)"
    out = open(os.environ["KT_OUT"], "w")
    if args.cases == "hardening":
        out.write(json.dumps(hardening(rank, world)) + "\n")
        out.close()
        end_process_group()
        return
    for case in args.cases.split(","):
        for mode in ("kaitian", "kaitian-copy", "torch", "plain"):
            if mode in ("plain", "kaitian-copy") and case not in ("unequal", "coupled", "no_sync"):
                continue
            result = run(case, mode, rank, world)
            out.write(json.dumps({"case": case, "mode": mode, **result}) + "\n")
            out.flush()
            gc.collect()
            dist.barrier()
    out.close()
    end_process_group()


if __name__ == "__main__":
    main()
