#!/usr/bin/env python3
"""Checks device discovery and placement on a real GPU host (no launcher, no containers).

1. Discovery without torch: NVML, ``nvidia-smi`` and PCI sysfs must agree on
   every GPU's physical index, UUID and bus id.
2. Planning: ``node_workers`` for ``USE_CUDA=<last>`` and for a host
   ``CUDA_VISIBLE_DEVICES=<last GPU's UUID>`` carries that GPU's physical index
   and UUID.
3. Landing: a worker started with the planned ``KAITIAN_DEVICE_*`` variables
   (and the host visibility variable, as a local worker gets it) computes on
   a device whose UUID (``torch.cuda.get_device_properties(i).uuid``) is the
   planned one.

Usage, from the repository root on the GPU machine::

    python scripts/devices_check.py      # one line per check, exit status 0 when all pass

Prints the inventory first. A host without GPUs fails check 1 with a message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kaitian.devices import inventory  # noqa: E402
from kaitian.devices.vendors import nvidia  # noqa: E402
from kaitian.launcher.workers import node_workers  # noqa: E402
from kaitian.settings import Settings  # noqa: E402

_LAND = r"""
import json, os, torch, kaitian
dev = kaitian.device()
uuid = str(torch.cuda.get_device_properties(dev.index).uuid)
print(json.dumps({"device": str(dev), "uuid": uuid, "count": torch.cuda.device_count()}))
"""

failures = 0


def check(name: str, ok: bool, detail: str) -> None:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def _same_uuid(a: str, b: str) -> bool:
    strip = lambda u: u.lower().removeprefix("gpu-")  # noqa: E731  (torch prints the UUID bare)
    return bool(a) and bool(b) and strip(a) == strip(b)


def main() -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "USE_CUDA")}
    found = [d for d in inventory.discover(env=env) if d.type == "cuda"]
    print(inventory.format_table(found))
    with nvidia.nvml() as nv:
        via_nvml = nvidia.from_nvml(nv) if nv is not None else []
    smi = nvidia.run_tool(["nvidia-smi", f"--query-gpu={nvidia.SMI_QUERY}", "--format=csv,noheader,nounits"])
    via_smi = nvidia.from_smi(smi) if smi else []
    via_sysfs = nvidia.from_sysfs()
    ids = lambda ds: [(d.index, d.uuid, d.bus_id) for d in ds]  # noqa: E731
    check("discovery", bool(via_nvml) and ids(via_nvml) == ids(via_smi),
          f"NVML {ids(via_nvml)} vs nvidia-smi {ids(via_smi)}")
    check("sysfs", [(d.index, d.bus_id) for d in via_sysfs] == [(d.index, d.bus_id) for d in via_nvml],
          f"sysfs {[(d.index, d.bus_id) for d in via_sysfs]}")
    if not via_nvml:
        return 1
    last = via_nvml[-1]
    for label, extra in (("USE_CUDA", {"USE_CUDA": str(last.index)}),
                         ("CUDA_VISIBLE_DEVICES=uuid", {"CUDA_VISIBLE_DEVICES": last.uuid or ""})):
        workers = node_workers(nproc_auto=True, nproc_per_node=None, env={**env, **extra}).workers
        got = [(w.device.index, w.device.uuid) for w in workers]
        check(f"plan {label}", got == [(last.index, last.uuid)], f"{got}")
        worker_env = {**env, **extra, **Settings.for_device(workers[0].device).to_env(), "LOCAL_RANK": "0"}
        out = subprocess.run([sys.executable, "-c", _LAND], env=worker_env, capture_output=True, text=True)
        if out.returncode != 0:
            check(f"lands {label}", False, out.stderr.strip().splitlines()[-1] if out.stderr else "failed")
            continue
        seen = json.loads(out.stdout.strip().splitlines()[-1])
        check(f"lands {label}", _same_uuid(seen["uuid"], last.uuid or ""), f"{seen} (planned {last.uuid})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
