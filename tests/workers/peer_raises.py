"""Rank 1 raises right after init (an exception in the user's script); rank 0
all-reduces and records the error it gets in KT_OUT."""
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import kaitian  # noqa: F401

dist.init_process_group("kaitian", timeout=timedelta(seconds=20))
if dist.get_rank() == 1:
    raise RuntimeError("user code failed on rank 1")
try:
    dist.all_reduce(torch.ones(4))
    error = None
except Exception as e:  # noqa: BLE001 (the test checks the message)
    error = str(e).splitlines()[0]
with open(os.environ["KT_OUT"], "w") as f:
    json.dump({"error": error}, f)
