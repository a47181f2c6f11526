"""Allreduces for SECONDS of wall time, then records the world it ran in (membership-change test)."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

out, seconds = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo")
start = time.monotonic()
t = torch.ones(1)
while time.monotonic() - start < seconds:
    dist.all_reduce(t)
    t.fill_(1)
    time.sleep(0.05)
dist.all_reduce(t)
info = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                                     "KAITIAN_GROUP")}
info["sum"] = t.item()
name = f"done.{os.environ['GROUP_RANK']}.{os.environ['LOCAL_RANK']}.{os.getpid()}.json"
with open(os.path.join(out, name), "w") as f:
    json.dump(info, f)
dist.destroy_process_group()
