"""One collective where rank 1's call differs from rank 0's (KT_CASE):
``bad_gather``: rank 1 passes a wrong-sized output list to all_gather and
catches the error; ``empty_allreduce``: rank 0 all-reduces no elements, rank 1
one; ``both_empty``: both all-reduce no elements (nothing differs). Each rank records the error of that call and of the next collective, and
how long the first took, in KT_OUT."""
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import kaitian  # noqa: F401


def first_line(call):
    try:
        call()
        return None
    except Exception as e:  # noqa: BLE001 (the test checks the message)
        return str(e).splitlines()[0]


dist.init_process_group("kaitian", timeout=timedelta(seconds=30))
rank, case = dist.get_rank(), os.environ["KT_CASE"]
if case == "bad_gather":
    outputs = [torch.zeros(2) for _ in range(3 if rank == 1 else 2)]
    call = lambda: dist.all_gather(outputs, torch.ones(2))  # noqa: E731
elif case == "empty_allreduce":
    call = lambda: dist.all_reduce(torch.ones(0 if rank == 0 else 1))  # noqa: E731
else:  # both_empty: the control, nothing differs
    call = lambda: dist.all_reduce(torch.ones(0))  # noqa: E731
start = time.monotonic()
error = first_line(call)
seconds = time.monotonic() - start
after = first_line(lambda: dist.all_reduce(torch.ones(1)))
with open(os.environ["KT_OUT"], "w") as f:
    json.dump({"error": error, "seconds": seconds, "after": after}, f)
