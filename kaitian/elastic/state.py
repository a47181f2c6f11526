"""The live training state one member sends the others (a joiner, or survivors a step behind)."""

from __future__ import annotations

import io
import random
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

__all__ = ["broadcast_state", "rng_state", "set_rng_state"]


def broadcast_state(state: Optional[Dict[str, Any]], source: int, device: torch.device) -> Dict[str, Any]:
    """``state`` of rank ``source`` on every rank of the default group (a collective).

    The state is serialised with ``torch.save`` (tensors bit for bit) and
    broadcast as bytes; receivers map its tensors to ``device``.
    """
    mine = dist.get_rank() == source
    if mine:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, source)
    if not mine:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, source)
    if mine:
        return state
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location=device, weights_only=True)


def rng_state(device: torch.device) -> Dict[str, Any]:
    """Python's, NumPy's, torch's and the device's random states."""
    out: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    except ImportError:
        pass
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    if module is not None and hasattr(module, "get_rng_state"):
        out["device"] = module.get_rng_state(device)
    return out


def set_rng_state(state: Dict[str, Any], device: torch.device) -> None:
    """Restores what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss_next = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss_next))
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    if "device" in state and module is not None and hasattr(module, "set_rng_state"):
        module.set_rng_state(state["device"].cpu(), device)
