"""Hugging Face Accelerate across vendors: ``kaitian.accelerate.Accelerator`` with kaitian's sampler.

Run under kaitianrun (two simulated vendor groups on CPU here)::

    kaitianrun --nproc-per-node 2 --cpu-groups 2 examples/accelerate_train.py

A plain Accelerate loop; the kaitian touches are the Accelerator class (which
accepts backend "kaitian", keeps kaitian's loader and weights the loss in
``backward``) and the sampler.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader

import kaitian
from kaitian.accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BatchLog, make_dataset, make_model, save_weights  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per-rank batch of an equal split")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--capabilities", default=None, help="e.g. 3,1 (default: kaitian init's)")
    p.add_argument("--log-batches", default=None, help="directory for each rank's batch log")
    p.add_argument("--save", default=None, help="rank 0 writes the trained weights here (JSON)")
    args, _ = p.parse_known_args(argv)
    caps = [float(c) for c in args.capabilities.split(",")] if args.capabilities else None

    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="kaitian")])
    dataset = make_dataset()
    sampler = kaitian.DistributedSampler(dataset, batch_size=args.batch_size, capabilities=caps)
    loader = DataLoader(dataset, batch_sampler=sampler.batch_sampler())
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    log = BatchLog(args.log_batches, accelerator.process_index)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y, index in loader:
            x, y = x.to(accelerator.device), y.to(accelerator.device)
            log.add(index)
            optimizer.zero_grad()
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            log.step_done()
    if accelerator.is_main_process:
        save_weights(accelerator.unwrap_model(model), args.save)
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
