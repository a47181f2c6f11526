"""Ranks that close a group right after an op in it, as a job does at its end
(tests/backend/test_faults.py).

Under kaitianrun; ``KT_ROUNDS`` times: a new two-rank group, one op in it, the
group destroyed at once. ``KT_OP=all_reduce`` (default): a rank that is
throttled (``--cpu-quota``) may still be waiting for what its peer published
in that all_reduce when the peer has already closed the group.
``KT_OP=isend``: rank 0 sends 4 MiB with ``isend`` and closes the group without
waiting for it; rank 1 receives it. Each rank writes ``{"rounds", "error"}`` to ``KT_OUT.<rank>``.
"""
import json
import os

import torch
import torch.distributed as dist

import kaitian  # noqa: F401

dist.init_process_group("kaitian")
rank, rounds, error, done = dist.get_rank(), int(os.environ["KT_ROUNDS"]), None, 0
op = os.environ.get("KT_OP", "all_reduce")
for i in range(rounds):
    group = dist.new_group([0, 1])
    try:
        if op == "isend":
            t = torch.full((1 << 20,), float(i if rank == 0 else -1))
            if rank == 0:
                dist.isend(t, 1, group=group)  # not waited for: closing the group delivers it
            else:
                dist.recv(t, 0, group=group)
                assert t[0].item() == i and t[-1].item() == i, t
        else:
            t = torch.full((1 << 16,), float(rank + i))
            dist.all_reduce(t, group=group)
            assert t[0].item() == 2 * i + 1 and t[-1].item() == 2 * i + 1, t
    except Exception as e:  # noqa: BLE001 (the test reports it)
        error = str(e).splitlines()[0]
    dist.destroy_process_group(group)
    failed = torch.tensor([float(error is not None)])
    dist.all_reduce(failed)  # both ranks stop at the first failure of either
    if failed.item():
        break
    done += 1
with open(f"{os.environ['KT_OUT']}.{rank}", "w") as f:
    json.dump({"rounds": done, "error": error}, f)
dist.destroy_process_group()
