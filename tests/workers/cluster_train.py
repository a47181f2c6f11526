"""Worker: elastic training across hosts with backend kaitian and kaitian.DistributedDataParallel.

``cluster_train.py --steps N [--step-sleep S] [--crash GROUP_RANK:STEP] [--hold WORLD:STEP]``, results as
JSON lines in ``KT_OUT`` (one per rank, at the end); its directory DIR holds
the checkpoint, a ``progress`` log and a ``started.*`` marker per worker.

Every step trains on one fixed global batch of ``GLOBAL_BATCH`` samples, split
unequally across the ranks (rank r's weight is 1 + r % 3); kaitian's DDP
weights the gradients by batch size, so every step equals a single-process
step on the whole global batch, whatever the world. Rank 0 checkpoints after
each step in DIR (atomically); a restarted or re-formed world resumes from the
checkpoint, so the final weights equal :func:`reference` for any sequence of
worlds. ``--crash`` makes
local rank 0 of that node fail once in the job, at that step (its agent may
restart it for the other host's new round before it sees the failure: the
restarted worker must not crash again);
``--hold`` makes a world smaller than WORLD wait at STEP until the agents
restart it into a bigger one (at most 180 s).
"""

import argparse
import json
import os
import socket
import sys
import time

import torch

GLOBAL_BATCH = 24
FEATURES = 6
LR = 0.1


def data(steps):
    g = torch.Generator().manual_seed(77)
    x = torch.randn(steps * GLOBAL_BATCH, FEATURES, generator=g, dtype=torch.float64)
    w = torch.arange(1, FEATURES + 1, dtype=torch.float64).unsqueeze(1)
    return x, x @ w + 0.5


def make_model():
    torch.manual_seed(5)
    return torch.nn.Linear(FEATURES, 1).double()


def reference(steps):
    """The weights of one process training on the whole global batch each step."""
    x, y = data(steps)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--crash", default=None)
    parser.add_argument("--hold", default=None)
    args, _ = parser.parse_known_args()
    results = os.environ["KT_OUT"]
    out = os.path.dirname(results)

    marker = f"started.{os.environ.get('GROUP_RANK')}.{os.environ.get('LOCAL_RANK')}.{os.getpid()}"
    open(os.path.join(out, marker), "w").close()

    import torch.distributed as dist

    import kaitian
    from kaitian.training.split import proportional_split

    dist.init_process_group("kaitian")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt = os.path.join(out, "ckpt.pt")

    model = make_model()
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        start = state["step"]
    ddp = kaitian.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    sizes = proportional_split(GLOBAL_BATCH, [1 + r % 3 for r in range(world)])
    offset = sum(sizes[:rank])
    x, y = data(args.steps)
    crash = None
    if args.crash:
        node, at = args.crash.split(":")
        if os.environ["GROUP_RANK"] == node and os.environ["LOCAL_RANK"] == "0" and not os.path.exists(
                os.path.join(out, "crashed")):
            crash = int(at)
    hold_world, hold_step = map(int, args.hold.split(":")) if args.hold else (0, -1)
    for step in range(start, args.steps):
        if step == hold_step and world < hold_world:
            time.sleep(180)  # the agents restart this world into a bigger one
            sys.exit(f"no world of {hold_world} after 180 s")
        if step == crash:
            open(os.path.join(out, "crashed"), "w").close()
            print(f"planned crash at step {step}", flush=True)
            sys.exit(3)
        base = step * GLOBAL_BATCH + offset
        xb, yb = x[base:base + sizes[rank]], y[base:base + sizes[rank]]
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xb), yb).backward()
        opt.step()
        if rank == 0:
            tmp = f"{ckpt}.{os.getpid()}"
            torch.save({"model": model.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
            with open(os.path.join(out, "progress"), "a") as f:
                f.write(f"{step + 1} {world} {restart} {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\n")
        time.sleep(args.step_sleep)
    info = {k: os.environ.get(k) for k in (
        "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "KAITIAN_GROUP",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")}
    info.update(host=socket.gethostname(), start_step=start, world=world,
                params=[p.detach().flatten().tolist() for p in model.parameters()])
    with open(results, "a") as f:
        f.write(json.dumps(info) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
