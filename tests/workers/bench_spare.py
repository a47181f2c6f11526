"""Worker: a rank that does not pay is benched (a hot spare) and called back, exactly.

torchrun-style (environment, backend kaitian, JSON to ``KT_OUT``), on the rank's
device (a fake MLU: the state crosses between device and host both ways). fp64 MLP,
SGD with momentum and a per-batch LR schedule (handed to the spares with the
optimizer: ``state=``), a loader that draws two batches ahead (``--ahead``). Rank 1 has a
fixed cost of ``--slow1`` s a step (a sleep: the busy time the re-balancer
measures; with ``--busy`` CPU time this thread spends, which stretches with the
machine's load as the rank's real work does) and is benched; from epoch
``--turn`` on rank 0 costs ``--slow0`` s a step, so that rank 1 alone is faster: at
the next epoch start rank 1 is called back and rank 0 benched. With ``--per-sample`` both costs are per sample
instead: rank 1 is benched for the exchange it adds, and called back to train
beside rank 0 (their rounds must then stay in step, every ``--every`` steps). With
``--model-delay1 S`` rank 1's model itself takes S s a forward (what its probe sees while
benched) until epoch ``--speedup``; with ``--probe-fails1`` it raises in eval mode (a model
the probe cannot run). The model holds a buffer DDP leaves alone (``broadcast_buffers=False``,
so the spares' copies carry buffers too); ``--buffer1 N`` makes rank 1's N values where rank 0's
has 1 (a spare whose model differs); ``--schedule-not-in-state`` leaves the LR schedule out of ``state=``;
``--two-views`` adds the loss of a second view of each batch (two forwards, one backward);
``--sum-in-group`` sums each step's batch sizes in ``balancer.group`` after the optimizer step (a logged
loss, as the docs advise); ``--stop-at N``: the loops end once the job took N steps (``balancer.steps``,
a max_steps loop); ``--steps-per-epoch K``: each pass is left after its K-th step; ``--no-finish``: no
``balancer.finish()`` after the loops. With ``--die1 E`` rank 1 dies in epoch E's third step
(``--die-how``: it raises, or kills itself, so that no exit handler runs). Every rank
writes the indices it trained per (epoch, step), its shares and its final weights.
"""

import argparse
import collections
import itertools
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import kaitian
from support.worker_env import end_process_group


class Delay(torch.nn.Module):
    """A device busy with something else: each forward takes ``seconds`` longer."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0
        self.fails_in_eval = False

    def forward(self, x):
        if self.fails_in_eval and not self.training:
            raise RuntimeError("this model cannot run in eval mode")
        time.sleep(self.seconds)
        return x


def spend(seconds, busy):
    """A scripted cost: a sleep, or (``busy``) this much of the thread's CPU time."""
    if not busy:
        time.sleep(seconds)
        return
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def drawing_ahead(loader, ahead=2):
    """The loader's batches, the next ``ahead`` always drawn already (as DataLoader workers do)."""
    it = iter(loader)
    queue = collections.deque(itertools.islice(it, ahead))
    for batch in it:
        queue.append(batch)
        yield queue.popleft()
    yield from queue


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=7)
    p.add_argument("--samples", type=int, default=200, help="the dataset's size")
    p.add_argument("--ahead", type=int, default=2, help="batches the loader draws ahead of the one trained")
    p.add_argument("--turn", type=int, default=2)
    p.add_argument("--slow0", type=float, default=0.3)
    p.add_argument("--slow1", type=float, default=0.05)
    p.add_argument("--per-sample", action="store_true", help="--slow0 and --slow1 are seconds per sample")
    p.add_argument("--busy", action="store_true", help="--slow0 and --slow1 are CPU time spent, not sleeps")
    p.add_argument("--every", type=int, default=25, help="the re-balancer's rounds: every this many steps")
    p.add_argument("--model-delay1", type=float, default=0.0, help="rank 1's model: seconds a forward ...")
    p.add_argument("--speedup", type=int, default=None, help="... until this epoch")
    p.add_argument("--probe-every", type=float, default=30.0, help="a benched rank's probe: every this many s")
    p.add_argument("--probe-fails1", action="store_true", help="rank 1's model raises in eval mode")
    p.add_argument("--buffer1", type=int, default=1, help="rank 1's model: a buffer of this many values (DDP leaves "
                   "it alone; rank 0's has 1)")
    p.add_argument("--die1", type=int, default=None, help="rank 1 dies in this epoch's third step ...")
    p.add_argument("--die-how", choices=["raises", "killed"], default="raises", help="... so")
    p.add_argument("--stop-at", type=int, default=None, help="leave the loops once the job took this many steps")
    p.add_argument("--steps-per-epoch", type=int, default=None, help="leave each pass after this many steps")
    p.add_argument("--no-finish", action="store_true", help="no balancer.finish() after the loops")
    p.add_argument("--sum-in-group", action="store_true", help="a collective in balancer.group after each step")
    p.add_argument("--skip-from", type=int, default=None, help="epoch 0's steps from this one skip the optimizer "
                   "step (as an AMP GradScaler does on an overflow); the schedule still steps")
    p.add_argument("--two-views", action="store_true", help="the loss adds the model's output on a second view of "
                   "the batch (its features reversed): two forwards, one backward")
    p.add_argument("--ema", action="store_true", help="an EMA of the weights updated after each optimizer step, "
                   "in state=; its sum at each epoch start is reported")
    p.add_argument("--schedule-not-in-state", action="store_true", help="the LR schedule is not handed to the "
                   "spares (state=[]): a rank called back would train with another learning rate")
    args, _ = p.parse_known_args()
    torch.set_num_threads(1)
    dist.init_process_group("kaitian")
    rank, device = dist.get_rank(), kaitian.device()
    kaitian.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 8, generator=g, dtype=torch.float64)
    y = torch.randn(args.samples, 1, generator=g, dtype=torch.float64)
    ds = TensorDataset(x, y, torch.arange(args.samples))
    sampler = kaitian.DistributedSampler(ds, batch_size=16, capabilities=[1.0, 1.0])  # 200: 6 steps of 32, one of 8
    torch.manual_seed(1234)
    delay = Delay()
    delay.seconds = args.model_delay1 if rank == 1 else 0.0
    delay.fails_in_eval = args.probe_fails1 and rank == 1
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), delay, torch.nn.Linear(32, 1))
    delay.register_buffer("extra", torch.zeros(args.buffer1 if rank == 1 else 1))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["2.extra"])
    net = net.double().to(device)
    model = kaitian.DistributedDataParallel(net, broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9)
    ema = torch.optim.swa_utils.AveragedModel(net, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    state = ([] if args.schedule_not_in_state else [schedule]) + ([ema] if args.ema else [])
    balancer = kaitian.Rebalancer(sampler, model, optimizer=opt, state=state, every=args.every,
                                  probe_every_s=args.probe_every)
    loader = DataLoader(ds, batch_sampler=sampler.batch_sampler())
    trained, shares, sums, ema_sums = [], [], [], []
    for epoch in range(args.epochs):
        if args.stop_at is not None and balancer.steps >= args.stop_at:
            break
        if epoch == args.speedup:
            delay.seconds = 0.0
        sampler.set_epoch(epoch)
        if args.ema:
            ema_sums.append([epoch, sum(p.detach().double().sum().item() for p in ema.module.parameters())])
        for step, (xb, yb, index) in enumerate(drawing_ahead(loader, args.ahead)):
            if step == 0:
                shares.append([epoch, sampler.split])
            if rank == 1 and epoch == args.die1 and step == 2:
                if args.die_how == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("rank 1 dies here (--die1)")
            slow = args.slow1 if rank == 1 else (args.slow0 if epoch >= args.turn else 0.0)
            slow *= len(xb) if args.per_sample else 1
            opt.zero_grad()
            out = model(xb.to(device))
            spend(slow, args.busy)
            loss = F.mse_loss(out, yb.to(device))
            if args.two_views:
                loss = loss + F.mse_loss(model(xb.flip(1).to(device)), yb.to(device))
            loss.backward()
            if args.skip_from is None or epoch > 0 or step < args.skip_from:
                opt.step()
                if args.ema:
                    ema.update_parameters(net)
            schedule.step()
            trained.append([epoch, step, index.tolist()])
            if args.sum_in_group:
                total = torch.tensor([len(xb)], dtype=torch.float64, device=device)
                dist.all_reduce(total, group=balancer.group)
                sums.append([epoch, step, total.item(), dist.get_process_group_ranks(balancer.group)])
            if (args.stop_at is not None and balancer.steps >= args.stop_at) or step + 1 == args.steps_per_epoch:
                break
    if not args.no_finish:
        balancer.finish()
    with open(os.environ["KT_OUT"], "w") as f:
        json.dump({
            "rank": rank, "trained": trained, "shares": shares, "sums": sums, "ema_sums": ema_sums,
            "steps": balancer.steps, "lr": opt.param_groups[0]["lr"],
            "device": device.type,
            "weights": [p.detach().cpu().reshape(-1).tolist() for p in net.parameters()],
            "history": [[d.step, d.epoch, d.old, d.new, [round(a, 4) for a in d.fixed_s],
                         [round(b, 5) for b in d.per_sample_s]] for d in balancer.history],
            "exchange": balancer.state_dict()["exchange_s"],
        }, f)
    del model, balancer, opt, loader
    end_process_group()


if __name__ == "__main__":
    main()
