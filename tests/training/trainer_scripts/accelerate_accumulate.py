"""An Accelerate user's accumulation loop, with kaitian's Accelerator and sampler.

15 micro-batches an epoch and gradient_accumulation_steps=2: stock Accelerate
steps at micro-batches 2, 4, ..., 14 and at the end of the loader (a window
of one). ``total=`` is the window's global sample count, so every step is the
exact mean over its window. Every micro-batch's indices are gathered with
gather_for_metrics (the ranks' batches differ: 24 and 8). Then an evaluation
loop with gather_for_metrics over a loader Accelerate shards, and one over a
kaitian loader of 33 samples whose last step is padded.
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import kaitian
from kaitian.accelerate import Accelerator
from common import BatchLog, make_dataset, make_model, parse_args, save_weights, shut_down

args = parse_args(__doc__)
accelerator = Accelerator(gradient_accumulation_steps=2)
dataset = make_dataset()
sampler = kaitian.DistributedSampler(dataset, batch_size=16, capabilities=args.capabilities)
loader = DataLoader(dataset, batch_sampler=sampler.batch_sampler())
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
log = BatchLog(args.log_batches, accelerator.process_index)
steps = accelerator.gradient_accumulation_steps
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    trained_on = []
    for i, (x, y, index) in enumerate(loader):
        window = min(steps, len(loader) - i // steps * steps)  # micro-batches in this window
        with accelerator.accumulate(model):
            log.add(index)
            total = kaitian.global_count(len(x)) * window
            accelerator.backward(F.mse_loss(model(x), y), count=len(x), total=total)
            optimizer.step()
            optimizer.zero_grad()
        trained_on.append(accelerator.gather_for_metrics(index))
        if accelerator.sync_gradients:
            log.step_done()
    if accelerator.is_main_process:
        print(f"epoch {epoch} gathered each sample once:",
              sorted(torch.cat(trained_on).tolist()) == list(range(len(dataset))), flush=True)
# evaluation as Accelerate users write it: a plain loader, sharded by Accelerate
# (480 samples in batches of 50 per rank: the last ones padded, then cut off again)
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
accelerator.end_training()
del accelerator, model, optimizer
shut_down()
sys.exit(0)
