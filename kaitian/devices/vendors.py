"""The vendor table: everything kaitian knows about a device type.

The C++ backend never links a vendor library; what differs between vendors
lives here. Adding a vendor is one ``Vendor`` entry in ``VENDORS``.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional
from kaitian.errors import UnknownVendorError

__all__ = ["Vendor", "VENDORS", "vendor", "vendor_names", "UnknownVendorError"]


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _mlu_count() -> int:
    try:
        import torch_mlu  # noqa: F401  (registers torch.mlu)
        import torch
    except ImportError:
        return 0
    return torch.mlu.device_count() if torch.mlu.is_available() else 0


def _cpu_count() -> int:
    # CPU "devices" are slots of cores; the launcher decides how many. A plain
    # process always has one.
    return 1


def _cuda_pin(ptr: int, nbytes: int) -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    # cudaHostRegisterPortable (1): pinned for every CUDA context in this process.
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)) == 0


def _cuda_unpin(ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)


def _cuda_set_device(index: int) -> None:
    import torch

    torch.cuda.set_device(index)


def _mlu_set_device(index: int) -> None:
    import torch
    import torch_mlu  # noqa: F401

    torch.mlu.set_device(index)


@dataclass(frozen=True)
class Vendor:
    """One device type and how to drive it.

    Attributes:
        name: device type, as in ``torch.device(name)`` and ``KAITIAN_DEVICE_TYPE``.
        selector_env: the variable that selects devices (``USE_CUDA``).
        intra_backend: torch distributed backend used inside a group of this type.
        visible_env: the vendor's visibility variable, or ``None``.
        module: extra module that must be imported to use the device type.
        image: default container image for ``--runtime docker``.
        count: number of devices of this type on this host.
        set_device: makes a device index current for the process.
        pin_host: registers host memory as pinned (DMA-able) with the vendor
            runtime; returns whether it did.
        unpin_host: undoes ``pin_host``.
    """

    name: str
    selector_env: str
    intra_backend: str
    visible_env: Optional[str]
    module: Optional[str]
    image: str
    count: Callable[[], int]
    set_device: Optional[Callable[[int], None]] = None
    pin_host: Optional[Callable[[int, int], bool]] = None
    unpin_host: Optional[Callable[[int], None]] = None
    aliases: tuple = field(default=())

    def torch_device(self, index: Optional[int] = None) -> str:
        """The torch device string for ``index`` (``cuda:1``, ``cpu``)."""
        if self.name == "cpu" or index is None:
            return self.name
        return f"{self.name}:{index}"

    def import_module(self) -> None:
        """Imports the vendor's torch plug-in (``torch_mlu``) if it needs one."""
        if self.module:
            importlib.import_module(self.module)


VENDORS: Dict[str, Vendor] = {
    v.name: v
    for v in (
        Vendor(
            name="cuda",
            selector_env="USE_CUDA",
            intra_backend="nccl",
            visible_env="CUDA_VISIBLE_DEVICES",
            module=None,
            image="kaitian:cuda",
            count=_cuda_count,
            set_device=_cuda_set_device,
            pin_host=_cuda_pin,
            unpin_host=_cuda_unpin,
        ),
        Vendor(
            name="mlu",
            selector_env="USE_MLU",
            intra_backend="cncl",
            visible_env="MLU_VISIBLE_DEVICES",
            module="torch_mlu",
            image="kaitian:mlu",
            count=_mlu_count,
            set_device=_mlu_set_device,
        ),
        Vendor(
            name="cpu",
            selector_env="USE_CPU",
            intra_backend="gloo",
            visible_env=None,
            module=None,
            image="kaitian:cpu",
            count=_cpu_count,
        ),
    )
}


def vendor(name: str) -> Vendor:
    """Looks a device type up in the table.

    Raises:
        UnknownVendorError: the name is not a known device type.
    """
    try:
        return VENDORS[name]
    except KeyError:
        raise UnknownVendorError(
            f"unknown device type {name!r}; known: {', '.join(VENDORS)}"
        ) from None


def vendor_names() -> List[str]:
    """Device types in layout order (accelerators first, CPU last)."""
    return list(VENDORS)


def has_tool(name: str) -> bool:
    """Whether a vendor command-line tool (``nvidia-smi``, ``cnmon``) is on PATH."""
    return shutil.which(name) is not None


def run_tool(argv: List[str], timeout: float = 10.0) -> Optional[str]:
    """Runs a vendor tool and returns its stdout, or ``None`` if it failed."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout
