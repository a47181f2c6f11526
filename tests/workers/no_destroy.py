"""Ends without destroy_process_group(), as most training scripts do: one
all_reduce, then the interpreter exits and tears the backend down."""
import torch
import torch.distributed as dist

import kaitian  # noqa: F401

dist.init_process_group("kaitian")
t = torch.ones(4)
dist.all_reduce(t)
assert t.tolist() == [float(dist.get_world_size())] * 4
