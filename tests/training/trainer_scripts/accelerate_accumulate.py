"""An Accelerate user's accumulation loop, with kaitian's Accelerator and sampler.

473 samples, a global batch of 32 (15 micro-batches an epoch, the last one of
25) and gradient_accumulation_steps=2: stock Accelerate steps at micro-batches
2, 4, ..., 14 and at the end of the loader (a window of one). ``--resplit``
changes the split mid-epoch. Two models train on the same batches, one per
rule: with ``backward(loss, total="window")`` every step is the exact mean over
its window (saved to ``--save``); with ``backward(loss)`` every micro-batch is
its own global mean divided by the steps, as Accelerate does in one process
(saved to ``--save`` + ``.micro``). Every micro-batch's indices
are gathered with gather_for_metrics (the ranks' batches differ). Then an
evaluation loop with gather_for_metrics over a loader Accelerate shards, and
one over a kaitian loader of 33 samples whose last step is padded.
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import kaitian
from kaitian.accelerate import Accelerator
from common import BatchLog, make_dataset, make_model, parse_args, save_weights, schedule_resplit, shut_down

args = parse_args(__doc__)
accelerator = Accelerator(gradient_accumulation_steps=2)
dataset = make_dataset(args.samples)
sampler = kaitian.DistributedSampler(dataset, batch_size=16, capabilities=args.capabilities)
loader = DataLoader(dataset, batch_sampler=sampler.batch_sampler())
model, micro_model = make_model(), make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
micro_optimizer = torch.optim.SGD(micro_model.parameters(), lr=args.lr)
model, optimizer, micro_model, micro_optimizer, loader = accelerator.prepare(
    model, optimizer, micro_model, micro_optimizer, loader)
log = BatchLog(args.log_batches, accelerator.process_index)
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    trained_on = []
    for step, (x, y, index) in enumerate(loader):
        if epoch == step == 0:
            schedule_resplit(sampler, args)
        with accelerator.accumulate(model, micro_model):
            log.add(index)
            accelerator.backward(F.mse_loss(model(x), y), total="window")
            accelerator.backward(F.mse_loss(micro_model(x), y))
            for opt in (optimizer, micro_optimizer):
                opt.step()
                opt.zero_grad()
        trained_on.append(accelerator.gather_for_metrics(index))
        if accelerator.sync_gradients:
            log.step_done()
    if accelerator.is_main_process:
        print(f"epoch {epoch} gathered each sample once:",
              sorted(torch.cat(trained_on).tolist()) == list(range(len(dataset))), flush=True)
# evaluation as Accelerate users write it: a plain loader, sharded by Accelerate
# (batches of 50 per rank: the last ones padded, then cut off again)
evaluation = accelerator.prepare(DataLoader(dataset, batch_size=50))
seen = torch.cat([accelerator.gather_for_metrics(index) for _, _, index in evaluation])
# a kaitian loader whose last step is padded (33 samples, a global batch of 32: one repeated)
small = kaitian.DistributedSampler(Subset(dataset, range(33)), batch_size=16, capabilities=args.capabilities)
small_loader = accelerator.prepare(DataLoader(small.dataset, batch_sampler=small.batch_sampler()))
padded = torch.cat([accelerator.gather_for_metrics(index) for _, _, index in small_loader])
if accelerator.is_main_process:
    print("evaluated each sample once:", sorted(seen.tolist()) == list(range(len(dataset))), flush=True)
    print("padded loader gathered each sample once:", sorted(padded.tolist()) == list(range(33)), flush=True)
    save_weights(accelerator.unwrap_model(model), args.save)
    save_weights(accelerator.unwrap_model(micro_model), args.save and args.save + ".micro")
accelerator.end_training()
del accelerator, model, optimizer, micro_model, micro_optimizer
shut_down()
sys.exit(0)
