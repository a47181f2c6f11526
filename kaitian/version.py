"""What every node and every worker of one job must share: kaitian's version and
the bridge protocol its C++ extension speaks."""

from __future__ import annotations

__all__ = ["__version__", "bridge_protocol", "versions"]

__version__ = "0.1.0"


def bridge_protocol() -> int:
    """The bridge protocol version of this install's workers (``kaitian._C.BRIDGE_PROTOCOL``,
    the C++ bridge's own constant; 0 when the extension is not built)."""
    try:
        from kaitian import _C
    except ImportError:
        return 0
    return int(_C.BRIDGE_PROTOCOL)


def versions() -> str:
    """``<kaitian version>/<bridge protocol>``, as the agent hands it to its workers."""
    return f"{__version__}/{bridge_protocol()}"
