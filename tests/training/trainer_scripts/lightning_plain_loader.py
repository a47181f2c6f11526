"""A Lightning user's script with a plain DataLoader; only the strategy is kaitian's.

``--package pytorch_lightning`` imports the Trainer from that package instead
of ``lightning``. ``devices="auto"``: the launcher decides the processes.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import kaitian
from common import BatchLog, make_dataset, make_model, parse_args, save_weights, shut_down

extra = argparse.ArgumentParser()
extra.add_argument("--package", default="lightning")
package = extra.parse_known_args()[0].package
if package == "pytorch_lightning":
    import pytorch_lightning as L
else:
    import lightning as L

from kaitian.lightning import KaitianStrategy  # noqa: E402

args = parse_args(__doc__)


class Regressor(L.LightningModule):
    def __init__(self, log: BatchLog) -> None:
        super().__init__()
        self.net = make_model()
        self.batch_log = log

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.batch_log.add(index)
        return F.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % args.accumulate == 0 or self.trainer.is_last_batch:  # the optimizer stepped
            self.batch_log.step_done()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=args.lr)


trainer = L.Trainer(
    strategy=KaitianStrategy(rebalance=not args.no_rebalance),
    accelerator=kaitian.device().type, devices="auto", precision="64-true",
    max_epochs=args.epochs, accumulate_grad_batches=args.accumulate,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
module = Regressor(BatchLog(args.log_batches, trainer.global_rank))
trainer.fit(module, DataLoader(make_dataset(), batch_size=args.batch_size, shuffle=True))
if trainer.global_rank == 0:
    save_weights(module.net, args.save)
del trainer, module
shut_down()
sys.exit(0)
