"""Worker: train, checkpoint with torch.distributed.checkpoint, get killed, resume mid-epoch.

torchrun-style, run by ``kaitianrun --max-restarts 1``. Every ``--every``
steps the ranks save model, optimizer (SGD with momentum), sampler and
re-balancer state. On the first attempt rank 1 kills itself with SIGKILL at
step ``--kill-at``; kaitianrun restarts both ranks, which load the latest
checkpoint and continue mid-epoch. Each rank logs its batches per step (the
log is cut back to the checkpoint on resume, as the training is), and rank 0
saves the final weights, so the test can replay the global batches in one
process.

``--bench-slow S``: rank 1 spends S seconds more per step and the
re-balancer may bench it (``optimizer=``, a round every 3 steps); the ranks
checkpoint between steps in ``balancer.group`` (the ranks that train), rank 0
is the one killed, and each log line is ``[epoch, step, indices]`` (a
benched rank trains fewer steps; the job's step count comes from the
sampler).
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader

import kaitian

from support import REPO
from support.worker_env import end_process_group

sys.path.insert(0, os.path.join(REPO, "examples"))
from common import make_dataset, make_model, save_weights  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--kill-at", type=int, default=11)
    p.add_argument("--bench-slow", type=float, default=None)
    p.add_argument("--world-checkpoints", action="store_true", help="checkpoint in the whole world's group")
    args, _ = p.parse_known_args()
    dist.init_process_group("kaitian")
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dataset = make_dataset()
    sampler = kaitian.DistributedSampler(dataset, batch_size=16, capabilities=[3.0, 1.0])
    model = kaitian.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    benching = args.bench_slow is not None
    if benching:
        balancer = kaitian.Rebalancer(sampler, model, every=3, optimizer=opt)
    else:
        # rounds run (their state is checkpointed) but keep the split; the split is
        # changed by hand at step 5, so a restart that lost it would show
        balancer = kaitian.Rebalancer(sampler, model, every=4, min_gain=0.99)
    killed = 0 if benching else 1
    loader = DataLoader(dataset, batch_sampler=sampler.batch_sampler())
    log_path = os.path.join(args.dir, f"rank-{rank}.jsonl")
    latest = os.path.join(args.dir, "latest")
    steps = 0
    resumed_at = resumed_split = None
    if os.path.exists(latest):
        with open(latest) as f:
            checkpoint = f.read().strip()
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state, "sampler": sampler.state_dict(),
                 "rebalancer": balancer.state_dict(), "steps": 0}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sampler.load_state_dict(state["sampler"])
        resumed_split = sampler.split_at_pass_start
        balancer.load_state_dict(state["rebalancer"])
        steps = resumed_at = int(state["steps"])
        at = [state["sampler"]["epoch"], state["sampler"]["step"]]
        with open(log_path) as f:  # the batches trained after the checkpoint are lost with it
            kept = [line for line in f if json.loads(line)[:2] < at] if benching else f.readlines()[:steps]
        with open(log_path, "w") as f:
            f.writelines(kept)
    for epoch in range(sampler.epoch, args.epochs):
        sampler.set_epoch(epoch)  # after load_state_dict: continues at the saved step
        for x, y, index in loader:
            if attempt == 0 and rank == killed and steps == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if steps == 5 and not benching:
                sampler.set_split([20, 12], after_draws=0)
            entry = [int(i) for i in index]
            if benching:
                entry = [epoch, sampler.state_dict()["step"] - 1, entry]
                if rank == 1:
                    time.sleep(args.bench_slow)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            # a rank called back from the bench has trained fewer steps: the job's step comes from the sampler
            steps = epoch * sampler.num_steps + entry[1] + 1 if benching else steps + 1
            with open(log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
            if steps % args.every == 0:
                # the ranks that train (a benched one waits for the epoch's end)
                group = None if args.world_checkpoints else balancer.group
                model_state, optim_state = get_state_dict(model, opt)
                path = os.path.join(args.dir, f"step-{steps}")
                dcp.save({"model": model_state, "optim": optim_state, "sampler": sampler.state_dict(),
                          "rebalancer": balancer.state_dict(), "steps": steps}, checkpoint_id=path,
                         process_group=group)
                dist.barrier(group=group)
                if rank == 0:
                    with open(latest + ".tmp", "w") as f:
                        f.write(path)
                    os.replace(latest + ".tmp", latest)
                dist.barrier(group=group)
    balancer.wait_sent()
    if rank == 0:
        save_weights(model.module, os.path.join(args.dir, "weights.json"))
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump({"attempt": attempt, "resumed_at": resumed_at, "steps": steps,
                       "split": sampler.split, "resumed_split": resumed_split,
                       "rounds": len(balancer.history)}, f)
    del model, balancer, opt, loader
    end_process_group()


if __name__ == "__main__":
    main()
