"""Worker: train with kaitian.elastic.Trainer and lose workers at chosen points.

Run by ``kaitianrun --on-failure continue``. ``--fail SPEC`` (repeatable)
makes the worker of launch rank R fail at a point of the first step after N
steps were applied in which every launch worker is back (any world with
``--fail-any-world``), whatever its incarnation, once per spec (a marker file
in ``--out`` says it fired):

- ``forward@N:R``: SIGKILL inside the forward;
- ``allreduce@N:R``: SIGKILL in backward, once DDP's last gradient bucket
  was handed to the all-reduce (a comm hook);
- ``optimizer@N:R``: SIGKILL after the all-reduce and the commit, before
  the optimizer step;
- ``applied@N:R``: SIGKILL once the step is applied, before the script's
  own work after it (an LR schedule's step);
- ``stop@N:R``: SIGSTOP in the forward (the others time out; its agent
  kills it when the survivors leave it out);
- ``lost@N:R`` / ``agreed@N:R``: SIGKILL while handling the first loss
  after N steps once the in-step specs up to N fired: when the trainer
  reports it, or once the next generation's decision is made (a second loss
  while the first is handled);
- ``full@N:R``: no failure, only the marker, once every other spec fired:
  every launch worker was back.

``--spare-dies N:R``: the worker of launch rank R SIGKILLs itself while it is
benched (a hot spare, away from every step) once a member applied N steps.

Each member logs its applied steps (``steps-<member>.jsonl``: applied, epoch,
step, rank, world, generation, indices, split) and its events; the member at
rank 0 at the end writes the weights. While a spec has not fired and the
world is smaller than at launch, each step sleeps ``--degraded-sleep`` s, so
a restarted worker has time to come back.
"""

import argparse
import glob
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kaitian  # noqa: F401  (registers the backend)
from kaitian.elastic import Trainer

from support import REPO

sys.path.insert(0, os.path.join(REPO, "examples"))
from common import make_dataset, make_model, save_weights  # noqa: E402


def die_as_spare(trainer, out, after):
    """SIGKILLs this worker once it is benched and some member applied ``after`` steps."""
    while True:
        time.sleep(0.05)
        applied = [json.loads(line)["applied"] for path in glob.glob(os.path.join(out, "steps-*.jsonl"))
                   for line in open(path).read().splitlines() if line.strip()]
        sampler = trainer.sampler
        if max(applied, default=0) >= after and sampler is not None and sampler.local_batch_size == 0:
            print(f"test: {os.environ['KAITIAN_ELASTIC_ID']} dies as a spare after step {max(applied)}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--fail", action="append", default=[])
    p.add_argument("--fail-any-world", action="store_true")
    p.add_argument("--degraded-sleep", type=float, default=0.2)
    p.add_argument("--step-sleep", type=float, default=0.0, help="every step sleeps this long (a slower model)")
    p.add_argument("--timeout", type=float, default=4.0)
    p.add_argument("--quorum-timeout", type=float, default=3.0)
    p.add_argument("--rebalance", action="store_true")
    p.add_argument("--sample-sleep", type=float, default=0.0, help="every step sleeps this long per sample")
    p.add_argument("--slow", default="", help="RANK:SECONDS[,RANK:SECONDS]: the worker of that launch rank sleeps "
                                             "this long every step (a fixed cost: the re-balancer benches it)")
    p.add_argument("--spare-dies", default="", help="N:R (see above)")
    p.add_argument("--samples", type=int, default=480, help="dataset size")
    p.add_argument("--ddp", default="kaitian")
    p.add_argument("--schedule-not-stateful", action="store_true", help="a per-step LR schedule made after the "
                   "trainer and left out of stateful=: a joiner would start it again")
    p.add_argument("--step-lr", default="", help="STEPS:GAMMA: a per-step StepLR in stateful=, stepped after each "
                   "applied step")
    args = p.parse_args()
    member = os.environ["KAITIAN_ELASTIC_ID"]
    tag = member.replace("/", "_").replace(":", "_")
    launch_rank, launch_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    slow_s = dict(spec.split(":") for spec in args.slow.split(",") if spec).get(str(launch_rank), 0.0)
    fails, markers, in_step_markers = {}, [], []
    for spec in args.fail:
        where, rest = spec.split("@")
        step, rank = map(int, rest.split(":"))
        markers.append(os.path.join(args.out, f"fired-{where}-{step}-{rank}"))
        if where not in ("lost", "agreed", "full"):
            in_step_markers.append((step, markers[-1]))
        if rank == launch_rank:
            fails[(where, step)] = markers[-1]

    def fail_here(where, in_step=True):
        due = [(n, m) for (w, n), m in fails.items()
               if w == where and trainer.applied >= n and not os.path.exists(m)]
        if not due or in_step and trainer.world < launch_world and not args.fail_any_world:
            return
        step, marker = due[0]
        if where == "full" and not all(os.path.exists(m) for m in markers if m != marker):
            return
        if not in_step and not all(os.path.exists(m) for n, m in in_step_markers if n <= step):
            return
        open(marker, "w").close()
        if where == "full":
            return
        print(f"test: {member} fails ({where}) at step {trainer.applied}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if where == "stop" else signal.SIGKILL)

    class SGD(torch.optim.SGD):
        def step(self, *a, **k):
            fail_here("optimizer")
            return super().step(*a, **k)

    def hook(state, bucket):
        buffer = bucket.buffer().div_(dist.get_world_size())
        fut = dist.all_reduce(buffer, async_op=True).get_future()
        if bucket.is_last():
            fail_here("allreduce")
        return fut.then(lambda f: f.value()[0])

    def step_fn(model, batch):
        x, y, _ = batch
        fail_here("forward")
        fail_here("stop")
        fail_here("full")
        if trainer.world < launch_world and not all(os.path.exists(m) for m in markers):
            time.sleep(args.degraded_sleep)
        time.sleep(args.step_sleep + args.sample_sleep * len(x) + float(slow_s))
        return F.mse_loss(model(x), y)

    dataset = make_dataset(args.samples)
    net = make_model()
    opt = SGD(net.parameters(), lr=0.1, momentum=0.9)
    step_lr = None
    if args.step_lr:
        every, gamma = args.step_lr.split(":")
        step_lr = torch.optim.lr_scheduler.StepLR(opt, int(every), float(gamma))
    trainer = Trainer(
        net, opt, dataset, batch_size=args.batch_size, capabilities=None, ddp=args.ddp,
        ddp_kwargs={"bucket_cap_mb": 0.001} if args.ddp == "kaitian" else {},
        comm_hook=(None, hook) if any(f.startswith("allreduce@") for f in args.fail) else None,  # on every rank
        rebalance={"every": 4} if args.rebalance else None,
        timeout=args.timeout, quorum_timeout=args.quorum_timeout, stateful={"step_lr": step_lr} if step_lr else None,
    )
    schedule = torch.optim.lr_scheduler.StepLR(opt, 7, 0.9) if args.schedule_not_stateful else None
    with open(os.path.join(args.out, f"start-{tag}.json"), "w") as f:  # where the workers' store is
        json.dump({"store": os.environ["MASTER_ADDR"], "launch_rank": launch_rank}, f)
    steps = open(os.path.join(args.out, f"steps-{tag}.jsonl"), "a")
    events = open(os.path.join(args.out, f"events-{tag}.jsonl"), "a")

    def on_step(info):
        fail_here("applied")
        for s in (schedule, step_lr):
            if s is not None:
                s.step()
        steps.write(json.dumps({"applied": info.applied, "epoch": info.epoch, "step": info.step,
                                "rank": info.rank, "world": info.world, "generation": info.generation,
                                "indices": info.indices, "split": info.split, "time": time.time()}) + "\n")
        steps.flush()

    def on_event(event):
        events.write(json.dumps({"kind": event.kind, "generation": event.generation, "time": event.time,
                                 "members": event.members, "redone": event.redone,
                                 "transferred": event.transferred, "detail": event.detail[:300]}) + "\n")
        events.flush()
        fail_here(event.kind, in_step=False)

    if args.spare_dies and int(args.spare_dies.split(":")[1]) == launch_rank:
        threading.Thread(target=die_as_spare, args=(trainer, args.out, int(args.spare_dies.split(":")[0])),
                         daemon=True).start()
    trained = trainer.fit(step_fn, args.epochs, on_step=on_step, on_event=on_event)
    if trained and trainer.rank == 0:
        save_weights(net, os.path.join(args.out, "weights.json"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"world": trainer.world, "generation": trainer.generation, "applied": trainer.applied,
                       "split": trainer.sampler.split}, f)
    trainer.close()


if __name__ == "__main__":
    main()
