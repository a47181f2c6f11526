"""One kaitianrun worker on a CPU-only host with fake MLUs: which device it got, and an all_reduce over kaitian.

Writes ``OUT_DIR/rank.<RANK>.json``: its device variables, ``kaitian.device()``,
``torch.mlu.current_device()`` / ``device_count()`` and the all_reduce result.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import kaitian  # installs the fake MLUs (KAITIAN_FAKE_ACCELERATOR) and registers backend kaitian

dist.init_process_group("kaitian")
device = kaitian.set_device()
x = torch.full((1000,), float(dist.get_rank() + 1), device=device)
dist.all_reduce(x)
record = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "KAITIAN_DEVICE_TYPE", "KAITIAN_DEVICE_INDEX",
                                         "MLU_VISIBLE_DEVICES")}
record.update(device=str(device), mlu_count=torch.mlu.device_count(), values=sorted(set(x.cpu().tolist())),
              current=torch.mlu.current_device() if device.type == "mlu" else None)
with open(os.path.join(sys.argv[1], f"rank.{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
