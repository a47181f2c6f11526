"""Running a vendor's command-line tool (``nvidia-smi``, ``cnmon``) without ever failing."""

from __future__ import annotations

import shutil
import subprocess
from typing import List, Optional

__all__ = ["has_tool", "run_tool"]


def has_tool(name: str) -> bool:
    """Whether a vendor command-line tool (``nvidia-smi``, ``cnmon``) is on PATH."""
    return shutil.which(name) is not None


def run_tool(argv: List[str], timeout: float = 10.0) -> Optional[str]:
    """Runs a vendor tool and returns its stdout, or ``None`` if it is missing or failed."""
    if not has_tool(argv[0]):
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout
