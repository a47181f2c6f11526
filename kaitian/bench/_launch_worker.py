"""Worker of ``kaitian bench launch``: init, one allreduce, record when it completed.

Usage: _launch_worker.py OUT_DIR start|recover BACKEND

``recover``: on the first attempt the workers keep allreducing until the
benchmark kills one of them; after the restart they record again and exit.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

out, mode, backend = sys.argv[1], sys.argv[2], sys.argv[3]
if backend == "kaitian":
    import kaitian  # noqa: F401
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group(backend)
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
done = time.time()
with open(os.path.join(out, f"pid.{restart}.{rank}"), "w") as f:
    f.write(str(os.getpid()))
with open(os.path.join(out, f"first.{restart}.{rank}.tmp"), "w") as f:
    f.write(repr(done))
os.replace(os.path.join(out, f"first.{restart}.{rank}.tmp"), os.path.join(out, f"first.{restart}.{rank}"))
if mode == "recover" and restart == 0:
    while True:  # until a peer is killed: the allreduce then fails and the agent restarts us
        dist.all_reduce(t)
        time.sleep(0.02)
dist.destroy_process_group()
