"""Rank 1 crashes on the first attempt; on a restart every rank allreduces and records the count.

On the first attempt rank 0 waits to be stopped instead of meeting rank 1 in a collective: that
collective would fail too, and in the same second (error files time failures in whole seconds)
torch's summary names the lower rank as the root cause.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    if restart == 0 and dist.get_rank() == 1:
        raise RuntimeError("planned crash on the first attempt")
    if restart == 0:
        time.sleep(120)  # the agent stops it once it sees rank 1's failure
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    with open(os.path.join(sys.argv[1], f"ok.{dist.get_rank()}"), "w") as f:
        f.write(f"{restart} {t.item()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
