"""Training that keeps going when a device is lost: ``kaitian.elastic.Trainer``.

Run it under ``kaitianrun --on-failure continue`` (two simulated vendor
groups of different speed here)::

    kaitianrun --nproc-per-node 3 --cpu-groups 2 --cpu-quota 1,0.5 \\
        --on-failure continue --max-restarts 3 examples/elastic_train.py --epochs 20

Kill any worker while it trains (``kill -9 PID``): the others re-form within
a second, redo the step that was in flight with the same global batch, and go
on; kaitianrun starts the lost worker again and it rejoins with the live state.
The model, optimizer and data are built the same way on every worker; the
trainer creates the process group (backend ``kaitian``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F

import kaitian  # noqa: F401  (registers the "kaitian" backend)
from kaitian.elastic import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_dataset, make_model, parse_args, save_weights  # noqa: E402


def step(model, batch):
    """One step's loss: the mean over this rank's share of the global batch."""
    x, y, _ = batch
    return F.mse_loss(model(x), y)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    model = make_model().to(kaitian.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = Trainer(model, optimizer, make_dataset(args.samples), batch_size=args.batch_size,
                      capabilities=args.capabilities, rebalance=None if args.no_rebalance else True)

    def on_step(info):
        if args.log_batches:  # which samples each rank trained, per step (the tests replay them)
            with open(os.path.join(args.log_batches, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"applied": info.applied, "indices": info.indices}) + "\n")

    def on_event(event):
        if event.kind == "reformed":
            print(f"generation {event.generation}: {len(event.members)} workers", flush=True)

    if trainer.fit(step, args.epochs, on_step=on_step, on_event=on_event) and trainer.rank == 0:
        save_weights(model, args.save)
        print(f"done: {trainer.applied} steps, {trainer.world} workers", flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
