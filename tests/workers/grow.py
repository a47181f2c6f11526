"""Allreduces until the world has TARGET ranks (plus 2 s), then records it (membership-change test).

A world smaller than TARGET keeps going until the agent restarts it into a
bigger one (at most 180 s, so a broken run cannot hang forever).
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

out, target = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
start = time.monotonic()
world = dist.get_world_size()
while time.monotonic() - start < 180:
    done = torch.tensor([1.0 if world >= target and time.monotonic() - start > 2 else 0.0])
    dist.all_reduce(done, op=dist.ReduceOp.MAX)
    if done.item():
        break
    time.sleep(0.05)
t = torch.ones(1)
dist.all_reduce(t)
info = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                                     "KAITIAN_GROUP")}
info["sum"] = t.item()
name = f"done.{os.environ['GROUP_RANK']}.{os.environ['LOCAL_RANK']}.{os.getpid()}.json"
with open(os.path.join(out, name), "w") as f:
    json.dump(info, f)
dist.destroy_process_group()
