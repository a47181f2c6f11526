"""Stand-ins for the vendors' tools, so kaitian finds GPUs / MLUs on a host that has none.

kaitian discovers devices without torch (NVML, else ``nvidia-smi``; ``cnmon``);
on a machine without the vendor libraries, a script on ``PATH`` printing what
the real tool prints is what discovery reads. Workers on such a host must not
use the devices (they record their environment).
"""

from __future__ import annotations

__all__ = ["stand_in_tools"]


def stand_in_tools(bin_dir, vendor: str, count: int) -> None:
    """Writes into ``bin_dir`` a ``nvidia-smi`` (vendor ``cuda``) or ``cnmon`` (``mlu``) that answers
    for ``count`` devices as the real tool prints them; put ``bin_dir`` first on ``PATH``."""
    bin_dir.mkdir()
    if vendor == "cuda":
        rows = [f"{i}, NVIDIA H100 80GB HBM3, 81559, 00000000:{0x19 + i:02X}:00.0, 5, 16, GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd"
                for i in range(count)]
        name = "nvidia-smi"
    else:
        rows = []
        for i in range(count):
            rows += [f"Card {i}", "Product Name                   : MLU370-X8",
                     f"UUID                           : MLU-{i:02d}a1b2c3d4e5f6", "PCIe info",
                     f"    Bus Id                     : 0000:{0x1a + i:02x}:00.0", "Physical Memory Usage",
                     "    Total                      : 24576 MiB"]
        name = "cnmon"
    (bin_dir / "out.txt").write_text("\n".join(rows) + "\n")
    tool = bin_dir / name
    tool.write_text(f"#!/bin/sh\nexec /bin/cat {bin_dir / 'out.txt'}\n")
    tool.chmod(0o755)
