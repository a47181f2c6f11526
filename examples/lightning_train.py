"""PyTorch Lightning across vendors: ``KaitianStrategy`` with kaitian's sampler.

Run under kaitianrun (two simulated vendor groups on CPU here)::

    kaitianrun --nproc-per-node 2 --cpu-groups 2 examples/lightning_train.py

The only kaitian touches are the sampler (and its batch sampler in the
DataLoader) and ``strategy=KaitianStrategy()``; the LightningModule is plain.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import kaitian
from kaitian.lightning import KaitianStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BatchLog, make_dataset, make_model, parse_args, save_weights, shut_down  # noqa: E402


class Regressor(L.LightningModule):
    def __init__(self, lr: float, log: BatchLog, accumulate: int) -> None:
        super().__init__()
        self.net = make_model()
        self.lr = lr
        self.batch_log = log
        self.accumulate = accumulate

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.batch_log.add(index)
        return F.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.accumulate == 0 or self.trainer.is_last_batch:  # the optimizer stepped
            self.batch_log.step_done()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    caps = args.capabilities
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    strategy = KaitianStrategy(rebalance=not args.no_rebalance)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=local, num_nodes=world // local,
        precision="64-true", max_epochs=args.epochs, accumulate_grad_batches=args.accumulate,
        logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    dataset = make_dataset(args.samples)
    module = Regressor(args.lr, BatchLog(args.log_batches, rank), args.accumulate)
    # Lightning sets up the process group in fit(); the sampler needs the world
    # size now, so it is built in the module's train_dataloader hook.
    module.train_dataloader = lambda: DataLoader(
        dataset, batch_sampler=kaitian.DistributedSampler(
            dataset, batch_size=args.batch_size, capabilities=caps).batch_sampler())
    trainer.fit(module)
    if trainer.global_rank == 0:
        save_weights(module.net, args.save)
    del trainer, strategy, module
    shut_down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
