"""Worker script for the kaitianrun --runtime docker end-to-end tests.

DOCKER_E2E_MODE=train: a few DDP steps with a fixed seed on backend
DOCKER_E2E_BACKEND; rank 0 saves the parameters. Every rank records which
container (cgroup) and Python environment it ran in.
DOCKER_E2E_MODE=restart: on the first attempt each rank records its pid and
waits (the test kills one inside its container); on a restart it succeeds.
DOCKER_E2E_MODE=wait: records its pid and waits to be stopped.
DOCKER_E2E_MODE=crash: prints a line; rank 1 exits with 3 once rank 0 has printed (ok: every rank exits 0).
"""

import json
import os
import sys
import time

out = os.environ["DOCKER_E2E_OUT"]
mode = os.environ.get("DOCKER_E2E_MODE", "train")
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record(name, data):
    path = os.path.join(out, f"{name}.{rank}.{attempt}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def container_id():
    """The docker container this process runs in ('' on the host): the last part
    of its cgroup path when that is a 64-hex container id."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            last = line.strip().rsplit("/", 1)[-1]
            if len(last) == 64 and all(c in "0123456789abcdef" for c in last):
                return last
    return ""


record("where", {"pid": os.getpid(), "container": container_id(), "group": os.environ.get("KAITIAN_GROUP"),
                 "mnt": os.readlink("/proc/self/ns/mnt"), "executable": sys.executable, "prefix": sys.prefix,
                 "conda_prefix": os.environ.get("CONDA_PREFIX")})

if mode == "train":
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import logging

    import kaitian  # noqa: F401  (registers the "kaitian" backend)

    # The backend logs which inter-group bridge it chose; keep that line.
    setup_lines = []
    handler = logging.Handler()
    handler.emit = lambda r: setup_lines.append(r.getMessage())
    backend_log = logging.getLogger("kaitian.backend")
    backend_log.addHandler(handler)
    backend_log.setLevel(logging.DEBUG)
    dist.init_process_group(os.environ.get("DOCKER_E2E_BACKEND", "kaitian"))
    backend_log.removeHandler(handler)
    record("setup", {"lines": setup_lines})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(10):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(out, "params.pt"))
    dist.barrier()
    dist.destroy_process_group()
elif mode == "ok":
    print(f"ok-log from rank {rank}", flush=True)
elif mode == "crash":
    print(f"crash-log from rank {rank}", flush=True)
    record("printed", {})
    # Rank 1's failure stops rank 0: not before rank 0 has printed too.
    rank0 = os.path.join(out, f"printed.0.{attempt}.json")
    deadline = time.monotonic() + 120
    while rank == 1 and not os.path.exists(rank0) and time.monotonic() < deadline:
        time.sleep(0.05)
    raise SystemExit(3 if rank == 1 else 0)
elif mode == "restart" and attempt > 0:
    pass  # the restarted group succeeds
else:
    time.sleep(600)
