"""A worker for the docker runtime tests; what it does is chosen by DOCKER_TEST_MODE."""

import json
import os
import signal
import subprocess
import sys
import time

mode = os.environ.get("DOCKER_TEST_MODE", "env")
rank = int(os.environ.get("RANK", "0"))
out_dir = os.environ["DOCKER_TEST_OUT"]


def dump(name, data):
    path = os.path.join(out_dir, f"{name}.{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


if mode == "env":
    dump("env", {
        "env": dict(os.environ),
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "uid": os.getuid(),
        "prefix": sys.prefix,
        "executable": sys.executable,
        "affinity": sorted(os.sched_getaffinity(0)),
        "cwd": os.getcwd(),
        "hostname_ns": os.readlink("/proc/self/ns/net"),
        "ipc_ns": os.readlink("/proc/self/ns/ipc"),
        "mnt_ns": os.readlink("/proc/self/ns/mnt"),
        "cgroup": open("/proc/self/cgroup").read(),
    })
    print(f"hello from rank {rank}", flush=True)
    print(f"warning from rank {rank}", file=sys.stderr, flush=True)
elif mode == "checkpoint":  # what a training script writes where it runs
    import torch

    torch.save({"step": 1}, os.path.join(os.getcwd(), f"checkpoint.{rank}.pt"))
    dump("env", {"uid": os.getuid(), "gid": os.getgid(), "cwd": os.getcwd()})
elif mode == "fail":
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if rank == 1:
            raise ValueError(f"deliberate failure on rank {rank}")

    main()
elif mode == "segment":
    # A bridge segment named as the backend names it, left behind as by a
    # worker killed while its process group was being built.
    from multiprocessing import resource_tracker, shared_memory

    from kaitian.backend.shm_gc import segment_name

    seg = shared_memory.SharedMemory(name=segment_name("feedbeef", rank), create=True, size=64)
    resource_tracker.unregister(seg._name, "shared_memory")
    dump("segment", {"name": seg._name.lstrip("/")})
    seg.close()
    time.sleep(300)
elif mode in ("sleep", "ignore-term"):
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen(["sleep", "300"])
    dump("sleep", {"pid": os.getpid(), "child": child.pid})
    time.sleep(300)
elif mode == "shm":
    # Host IPC: a segment made in one container is seen in the other.
    from multiprocessing import shared_memory

    name = os.environ["DOCKER_TEST_SHM"]
    if rank == 0:
        seg = shared_memory.SharedMemory(name=name, create=True, size=16)
        seg.buf[:5] = b"hello"
        deadline = time.time() + 30
        while bytes(seg.buf[5:10]) != b"world" and time.time() < deadline:
            time.sleep(0.01)
        ok = bytes(seg.buf[5:10]) == b"world"
        seg.close()
        seg.unlink()
    else:
        deadline = time.time() + 30
        seg = None
        while seg is None and time.time() < deadline:
            try:
                seg = shared_memory.SharedMemory(name=name)
            except (FileNotFoundError, ValueError):  # not there yet, or not yet sized (empty)
                time.sleep(0.01)
        while bytes(seg.buf[:5]) != b"hello" and time.time() < deadline:
            time.sleep(0.01)
        seg.buf[5:10] = b"world"
        ok = True
        seg.close()
        from multiprocessing import resource_tracker
        resource_tracker.unregister(seg._name, "shared_memory")  # rank 0 owns it
    dump("shm", {"ok": ok})
elif mode == "gloo":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dump("gloo", {"sum": t.tolist(), "world": dist.get_world_size()})
    dist.destroy_process_group()
