"""PyTorch Lightning across vendors: ``KaitianStrategy`` with kaitian's sampler.

Run under kaitianrun (two simulated vendor groups on CPU here)::

    kaitianrun --nproc-per-node 2 --cpu-groups 2 examples/lightning_train.py

The only kaitian touches are the sampler (and its batch sampler in the
DataLoader) and ``strategy=KaitianStrategy()``; the LightningModule is plain.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import kaitian
from kaitian.lightning import KaitianStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BatchLog, make_dataset, make_model, save_weights  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self, lr: float, log: BatchLog) -> None:
        super().__init__()
        self.net = make_model()
        self.lr = lr
        self.batch_log = log

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.batch_log.add(index)
        return F.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.batch_log.step_done()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per-rank batch of an equal split")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--capabilities", default=None, help="e.g. 3,1 (default: kaitian init's)")
    p.add_argument("--no-rebalance", action="store_true")
    p.add_argument("--log-batches", default=None, help="directory for each rank's batch log")
    p.add_argument("--save", default=None, help="rank 0 writes the trained weights here (JSON)")
    args, _ = p.parse_known_args(argv)
    caps = [float(c) for c in args.capabilities.split(",")] if args.capabilities else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    strategy = KaitianStrategy(rebalance=not args.no_rebalance)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=local, num_nodes=world // local,
        precision="64-true", max_epochs=args.epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    dataset = make_dataset()
    module = Regressor(args.lr, BatchLog(args.log_batches, rank))
    # Lightning sets up the process group in fit(); the sampler needs the world
    # size now, so it is built in the module's train_dataloader hook.
    module.train_dataloader = lambda: DataLoader(
        dataset, batch_sampler=kaitian.DistributedSampler(
            dataset, batch_size=args.batch_size, capabilities=caps).batch_sampler())
    trainer.fit(module)
    if trainer.global_rank == 0:
        save_weights(module.net, args.save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
