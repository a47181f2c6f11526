"""Hugging Face Accelerate across vendors: ``kaitian.accelerate.Accelerator`` with kaitian's sampler.

Run under kaitianrun (two simulated vendor groups on CPU here)::

    kaitianrun --nproc-per-node 2 --cpu-groups 2 examples/accelerate_train.py

A plain Accelerate loop; the kaitian touches are the Accelerator class (which
accepts backend "kaitian", keeps kaitian's loader and weights the loss in
``backward``) and the sampler.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader

import kaitian
from kaitian.accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    BatchLog, make_dataset, make_model, parse_args, save_weights, schedule_resplit, shut_down)


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    caps = args.capabilities

    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="kaitian")])
    dataset = make_dataset(args.samples)
    sampler = kaitian.DistributedSampler(dataset, batch_size=args.batch_size, capabilities=caps)
    loader = DataLoader(dataset, batch_sampler=sampler.batch_sampler())
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    log = BatchLog(args.log_batches, accelerator.process_index)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for step, (x, y, index) in enumerate(loader):
            if epoch == step == 0:
                schedule_resplit(sampler, args)  # --resplit: a split change mid-epoch (the tests')
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            log.add(index)
            optimizer.zero_grad()
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            log.step_done()
    if accelerator.is_main_process:
        save_weights(accelerator.unwrap_model(model), args.save)
    accelerator.end_training()
    del accelerator, model, optimizer
    shut_down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
