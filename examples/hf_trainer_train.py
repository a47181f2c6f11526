"""The Hugging Face Trainer across vendors: ``kaitian.transformers.KaitianTrainer``.

Run under kaitianrun (two simulated vendor groups on CPU here)::

    kaitianrun --nproc-per-node 2 --cpu-groups 2 examples/hf_trainer_train.py

A ``Trainer`` setup with ``KaitianTrainer`` in place of ``Trainer``; the model
returns its loss as Hugging Face models do.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from transformers import TrainerCallback, TrainingArguments

from kaitian.transformers import KaitianTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BatchLog, Rows, make_model, parse_args, save_weights, shut_down  # noqa: E402


class Regression(torch.nn.Module):
    """Returns ``{"loss": ...}`` like a Hugging Face model; logs each batch's indices."""

    def __init__(self, log: BatchLog) -> None:
        super().__init__()
        self.net = make_model()
        self.batch_log = log

    def forward(self, x, labels, index):
        self.batch_log.add(index)
        return {"loss": F.mse_loss(self.net(x), labels)}


class StepDone(TrainerCallback):
    def __init__(self, log: BatchLog) -> None:
        self.log = log

    def on_step_end(self, args, state, control, **kwargs):
        self.log.step_done()


def main(argv=None) -> int:
    parsed = parse_args(__doc__.splitlines()[0], argv)
    caps = parsed.capabilities
    log = BatchLog(parsed.log_batches, int(os.environ.get("RANK", "0")))
    model = Regression(log)
    args = TrainingArguments(
        output_dir=os.path.join(os.getcwd(), "hf-trainer-out"), per_device_train_batch_size=parsed.batch_size,
        num_train_epochs=parsed.epochs, learning_rate=parsed.lr, lr_scheduler_type="constant",
        max_grad_norm=0.0, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=parsed.lr)
    trainer = KaitianTrainer(model=model, args=args, train_dataset=Rows(parsed.samples), capabilities=caps,
                             optimizers=(optimizer, None), callbacks=[StepDone(log)])
    trainer.train()
    if trainer.is_world_process_zero():
        save_weights(model.net, parsed.save)
    del trainer
    shut_down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
