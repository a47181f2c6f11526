"""Step timing on the device that does the work.

On an accelerator (CUDA, MLU, any torch device module with ``Event``) the
host returns from ``backward()`` while kernels still run, so host clocks would
count device compute as communication. :class:`StepClock` records device
events at the step's marks on the rank's device's current stream (``end``
after the step's communication: DDP's finaliser made that stream wait for
it) and reads a step's events only when the *next* step ends: by then they
have completed, so reading them never makes the host wait for the device and
the host keeps running ahead. On CPU it reads ``time.perf_counter`` and a
step's times are known at once.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Deque, Dict, List, Tuple

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
        self._module, self._device = module, device
        self._marks: Dict[str, object] = {}
        self._pending: Deque[Tuple[Any, Dict[str, object]]] = deque()

    @property
    def on_device(self) -> bool:
        return self._events is not None

    def mark(self, name: str) -> None:
        """Records the mark ``name`` (``start``, ``compute_end``, ``end``) now."""
        if self._events is None:
            self._marks[name] = time.perf_counter()
        else:
            event = self._events(enable_timing=True)
            # the rank's device and stream: a bare record() takes the current
            # device's (cuda:0 unless the script set one)
            event.record(self._module.current_stream(self._device))
            self._marks[name] = event

    def has(self, name: str) -> bool:
        return name in self._marks

    def finish(self, step: Any) -> List[Tuple[Any, Dict[str, float]]]:
        """Ends the step ``step`` (what the caller knows of it); clears the marks.

        Returns:
            ``(step, {"compute_s", "comm_s"})`` of every step whose times are
            known now: this one on CPU; on a device the previous one.
        """
        marks, self._marks = self._marks, {}
        self._pending.append((step, marks))
        ready = []
        while len(self._pending) > (1 if self.on_device else 0):
            ready.append(self._durations(*self._pending.popleft()))
        return ready

    def flush(self) -> List[Tuple[Any, Dict[str, float]]]:
        """Every ended step not returned yet (on a device, waits for its events)."""
        ready = [self._durations(*p) for p in self._pending]
        self._pending.clear()
        return ready

    def _durations(self, step: Any, marks: Dict[str, object]) -> Tuple[Any, Dict[str, float]]:
        start, end = marks.get("start"), marks.get("end")
        compute_end = marks.get("compute_end", end)
        if start is None or end is None:
            return step, {"compute_s": 0.0, "comm_s": 0.0}
        if self._events is None:
            return step, {"compute_s": max(0.0, compute_end - start), "comm_s": max(0.0, end - compute_end)}
        end.synchronize()  # a step old: done already, unless flushed
        return step, {
            "compute_s": max(0.0, start.elapsed_time(compute_end) / 1000.0),
            "comm_s": max(0.0, compute_end.elapsed_time(end) / 1000.0) if compute_end is not end else 0.0,
        }
