"""Cambricon: MLUs through ``cnmon``, else their device nodes (``/dev/cambricon_dev<N>``), else PCI sysfs.

None of these needs torch or ``torch_mlu``. A card's index is the number in
its device node, which is also ``cnmon``'s card number.

``KAITIAN_FAKE_ACCELERATOR=mlu:N`` puts N fake MLUs
(:mod:`kaitian.testing.fake_accelerator`) in their place on a host without a
real ``torch_mlu``: discovery lists them, near the host's first NUMA node's
cores, and every process that imports kaitian gets them as ``torch.mlu``. A
real ``torch_mlu`` wins over the variable.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
from typing import Dict, Iterable, List, Optional, Sequence

from kaitian.devices.device import ContainerDevices, Device, WorkerDevice
from kaitian.devices.vendors.cpu import numa_nodes
from kaitian.devices.vendors.pci import PCI_ROOT, find_function, normalise_bus_id, pci_functions
from kaitian.devices.vendors.tools import run_tool
from kaitian.errors import DeviceSelectionError
from kaitian.settings import fake_accelerator

__all__ = [
    "PCI_VENDOR", "SOURCES", "FAKE_SOURCE", "probe", "utilisation", "container_devices", "count",
    "set_device", "fake_count", "install_fake", "load_torch_mlu",
]

PCI_VENDOR = 0xCABC
_PCI_CLASSES = (0x12, 0x0B, 0x03)  # processing accelerator, co-processor, display
SOURCES = "cnmon, /dev/cambricon_dev*, /sys/bus/pci, KAITIAN_FAKE_ACCELERATOR"
DEV_ROOT = "/dev"
FAKE_SOURCE = "KAITIAN_FAKE_ACCELERATOR"


# --- fake MLUs -------------------------------------------------------------------


def _real_torch_mlu() -> bool:
    return importlib.util.find_spec("torch_mlu") is not None


def fake_count() -> int:
    """N for ``KAITIAN_FAKE_ACCELERATOR=mlu:N``; 0 when unset or a real ``torch_mlu`` is installed."""
    fake = fake_accelerator()
    return 0 if fake is None or _real_torch_mlu() else fake[1]


def install_fake() -> None:
    """What ``import kaitian`` does with ``KAITIAN_FAKE_ACCELERATOR``: installs the
    fake MLUs, or says in one line that a real ``torch_mlu`` makes it ignored.

    Raises:
        SettingError: the variable is malformed.
        ImportError: the fake accelerator is not built for this torch.
    """
    fake = fake_accelerator()
    if fake is None:
        return
    if _real_torch_mlu():
        print("kaitian: KAITIAN_FAKE_ACCELERATOR is ignored: a real torch_mlu is installed", file=sys.stderr)
        return
    from kaitian.testing import fake_accelerator as fake_module

    fake_module.install(*fake)


def load_torch_mlu() -> None:
    """Imports ``torch_mlu``, or installs the fake MLUs that stand in for it."""
    if fake_count():
        install_fake()
    else:
        import torch_mlu  # noqa: F401  (registers torch.mlu)


# --- discovery ---------------------------------------------------------------


def from_cnmon(out: str, sys_root: str = PCI_ROOT) -> List[Device]:
    """``cnmon info`` (cards with product name, memory, PCI and UUID sections) -> devices."""
    devices: List[Device] = []
    current: Optional[Device] = None
    for line in out.splitlines():
        m = re.match(r"\s*Card\s*:?\s*(\d+)\s*$", line, re.IGNORECASE)
        if m:
            current = Device("mlu", int(m.group(1)), "MLU", source="cnmon")
            devices.append(current)
            continue
        if current is None or ":" not in line:
            continue
        key, _, value = (s.strip() for s in line.partition(":"))
        key = key.lower()
        if key in ("product name", "card name") and value:
            current.name = value
        elif key in ("total", "physical memory total") and current.memory_bytes is None:
            m = re.match(r"(\d+)\s*MiB", value)
            if m:
                current.memory_bytes = int(m.group(1)) * (1 << 20)
        elif key in ("bus id", "bdf", "pci bus id") and value and current.bus_id is None:
            current.bus_id = normalise_bus_id(value)
        elif key == "uuid" and value and current.uuid is None:
            current.uuid = value
    for d in devices:
        function = find_function(d.bus_id, sys_root)
        d.cpus = function.cpus if function else ()
    return devices


def from_nodes(dev_root: str = DEV_ROOT) -> List[Device]:
    """One MLU per ``cambricon_dev<N>`` node."""
    indices = sorted(
        int(m.group(1))
        for p in glob.glob(os.path.join(dev_root, "cambricon_dev*"))
        if (m := re.fullmatch(r"cambricon_dev(\d+)", os.path.basename(p)))
    )
    return [Device("mlu", i, "MLU", source="device node") for i in indices]


def from_sysfs(sys_root: str = PCI_ROOT) -> List[Device]:
    """Cambricon functions in PCI sysfs, numbered in bus order."""
    return [
        Device("mlu", i, f"Cambricon device {f.device_id}", bus_id=f.bus_id, cpus=f.cpus, source="sysfs")
        for i, f in enumerate(pci_functions(PCI_VENDOR, _PCI_CLASSES, sys_root))
    ]


def probe(sys_root: Optional[str] = None, dev_root: Optional[str] = None) -> List[Device]:
    """This host's MLUs: the fake ones if asked for, else ``cnmon``, else device nodes, else PCI sysfs."""
    fakes = fake_count()
    if fakes:
        nodes = numa_nodes()
        near = tuple(nodes[min(nodes)])
        return [Device("mlu", i, "fake MLU", cpus=near, source=FAKE_SOURCE) for i in range(fakes)]
    sys_root, dev_root = sys_root or PCI_ROOT, dev_root or DEV_ROOT
    out = run_tool(["cnmon", "info"])
    if out is not None:
        found = from_cnmon(out, sys_root)
        if found:
            return found
    return from_nodes(dev_root) or from_sysfs(sys_root)


# --- utilisation ---------------------------------------------------------------


def utilisation() -> Dict[int, float]:
    """Card -> MLU utilisation in percent, from ``cnmon info -u`` (empty when unavailable)."""
    out = run_tool(["cnmon", "info", "-u"], 5.0) or ""
    found: Dict[int, float] = {}
    card = None
    for line in out.splitlines():
        m = re.match(r"\s*Card\s*:?\s*(\d+)", line, re.IGNORECASE)
        if m:
            card = int(m.group(1))
            continue
        m = re.search(r"MLU Average\s*:\s*([\d.]+)\s*%", line)
        if m and card is not None:
            found[card] = float(m.group(1))
    return found


# --- containers ------------------------------------------------------------------


def _present(dev_root: str = DEV_ROOT) -> List[str]:
    return glob.glob(os.path.join(dev_root, "cambricon*")) + glob.glob(os.path.join(dev_root, "ipcm*"))


def container_devices(devices: Sequence[WorkerDevice], present_nodes: Optional[Iterable[str]] = None) -> ContainerDevices:
    """The device nodes of exactly these MLUs (control node, cards, IPC nodes) and the container's view.

    The MLU runtime numbers the cards a container holds from 0 in host order;
    ``MLU_VISIBLE_DEVICES`` is renumbered to match.

    Raises:
        DeviceSelectionError: the control node or a card's node is missing.
    """
    indices = sorted({d.index for d in devices})
    if not indices:
        return ContainerDevices()
    present = set(_present() if present_nodes is None else present_nodes)
    wanted = ["/dev/cambricon_ctl"]
    for i in indices:
        wanted += [f"/dev/cambricon_dev{i}", f"/dev/cambricon_ipcm{i}", f"/dev/ipcm{i}"]
    missing = [p for p in ["/dev/cambricon_ctl"] + [f"/dev/cambricon_dev{i}" for i in indices] if p not in present]
    if missing:
        raise DeviceSelectionError(
            f"MLU device node(s) {', '.join(missing)} not found on this host; "
            "check the Cambricon driver (cnmon) or select other MLUs with USE_MLU"
        )
    return ContainerDevices(
        device_nodes=tuple(f"{p}:{p}:rwm" for p in wanted if p in present),
        env={"MLU_VISIBLE_DEVICES": ",".join(str(k) for k in range(len(indices)))},
        index_map={i: k for k, i in enumerate(indices)},
    )


# --- the worker side (torch_mlu) ---------------------------------------------------------


def count() -> int:
    """MLUs ``torch_mlu`` (or the fake) sees in this process (0 without it)."""
    try:
        load_torch_mlu()
        import torch
    except ImportError:
        return 0
    return torch.mlu.device_count() if torch.mlu.is_available() else 0


def set_device(index: int) -> None:
    import torch

    load_torch_mlu()
    torch.mlu.set_device(index)
