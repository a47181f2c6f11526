"""A plain torch DDP loop with kaitian.scale_loss(loss, sampler=...) and no count=, under a
DataLoader whose two workers draw batches ahead (the original project's example uses
num_workers=2): each loss must still be weighted by its own batch."""

import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import kaitian
from common import BatchLog, make_dataset, make_model, parse_args, save_weights, schedule_resplit, shut_down

args = parse_args(__doc__)
torch.distributed.init_process_group("kaitian")
dataset = make_dataset(args.samples)
sampler = kaitian.DistributedSampler(dataset, batch_size=args.batch_size, capabilities=args.capabilities)
loader = DataLoader(dataset, batch_sampler=sampler.batch_sampler(), num_workers=2, prefetch_factor=2)
model = DistributedDataParallel(make_model())
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
log = BatchLog(args.log_batches, torch.distributed.get_rank())
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for step, (x, y, index) in enumerate(loader):
        if epoch == step == 0:
            schedule_resplit(sampler, args)
        log.add(index)
        optimizer.zero_grad()
        kaitian.scale_loss(F.mse_loss(model(x), y), sampler=sampler).backward()
        optimizer.step()
        log.step_done()
if torch.distributed.get_rank() == 0:
    save_weights(model.module, args.save)
del model, optimizer
shut_down()
sys.exit(0)
