"""Step timing on the device that does the work.

On an accelerator (CUDA, MLU, any torch device module with ``Event``) the
host returns from ``backward()`` while kernels still run, so host clocks would
count device compute as communication. :class:`StepClock` records device
events at the step's marks on the current stream and reads them once the
step's backward has returned (one event synchronisation per step: the host
then waits for the device to finish the step, which costs the host's
run-ahead into the next step's forward). On CPU it reads ``time.perf_counter``.

GPU behaviour is written from the CUDA/MLU event API; this project's CI has no
accelerator, so only the CPU path is tested.
"""

from __future__ import annotations

import time
from typing import Dict

import torch

__all__ = ["StepClock"]


class StepClock:
    """Marks ``start``, ``compute_end`` and ``end`` of each step; yields durations.

    Args:
        device: the device the model runs on.
    """

    def __init__(self, device: torch.device) -> None:
        module = getattr(torch, device.type, None) if device.type != "cpu" else None
        self._events = getattr(module, "Event", None) if module is not None else None
        self._marks: Dict[str, object] = {}

    @property
    def on_device(self) -> bool:
        return self._events is not None

    def mark(self, name: str) -> None:
        """Records the mark ``name`` (``start``, ``compute_end``, ``end``) now."""
        if self._events is None:
            self._marks[name] = time.perf_counter()
        else:
            event = self._events(enable_timing=True)
            event.record()
            self._marks[name] = event

    def has(self, name: str) -> bool:
        return name in self._marks

    def take(self) -> Dict[str, float]:
        """The finished step's ``compute_s`` and ``comm_s``; clears the marks.

        Device events are synchronised here, after the step's backward has
        returned.
        """
        marks, self._marks = self._marks, {}
        start, end = marks.get("start"), marks.get("end")
        compute_end = marks.get("compute_end", end)
        if start is None or end is None:
            return {"compute_s": 0.0, "comm_s": 0.0}
        if self._events is None:
            return {"compute_s": max(0.0, compute_end - start), "comm_s": max(0.0, end - compute_end)}
        end.synchronize()
        return {
            "compute_s": max(0.0, start.elapsed_time(compute_end) / 1000.0),
            "comm_s": max(0.0, compute_end.elapsed_time(end) / 1000.0) if compute_end is not end else 0.0,
        }
