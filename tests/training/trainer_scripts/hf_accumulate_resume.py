"""A Hugging Face Trainer user's script: TrainingArguments first, then the Trainer.

gradient_accumulation_steps=2 over 15 micro-batches an epoch (windows of 2 and a
last one of 1), max_steps, and a second Trainer resuming from the first one's
checkpoint: 4 steps, then steps 5 to 10 (across the epoch end) after resuming.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import TrainerCallback, TrainingArguments

from kaitian.transformers import KaitianTrainer
from common import BatchLog, Rows, make_model, parse_args, save_weights, shut_down

parsed = parse_args(__doc__)
log = BatchLog(parsed.log_batches, int(os.environ["RANK"]))


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x, labels, index):
        log.add(index)
        return {"loss": F.mse_loss(self.net(x), labels)}


class StepDone(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        log.step_done()


def train(max_steps: int, resume: bool) -> torch.nn.Module:
    args = TrainingArguments(
        output_dir="hf-out", per_device_train_batch_size=16, gradient_accumulation_steps=2,
        max_steps=max_steps, learning_rate=parsed.lr, lr_scheduler_type="constant", optim="sgd",
        weight_decay=0.0, max_grad_norm=0.0, save_strategy="steps", save_steps=4, save_only_model=False,
        report_to="none", logging_strategy="no", disable_tqdm=True, use_cpu=True,
    )
    model = Regression()
    trainer = KaitianTrainer(model=model, args=args, train_dataset=Rows(), callbacks=[StepDone()])
    print(f"rank {dist.get_rank()} backend {dist.get_backend()}", flush=True)
    trainer.train(resume_from_checkpoint=resume or None)
    del trainer
    return model


train(4, resume=False)
model = train(10, resume=True)
if int(os.environ["RANK"]) == 0:
    save_weights(model.net, parsed.save)
shut_down()
sys.exit(0)
