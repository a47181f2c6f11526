"""The worker-side step recorder of ``kaitianrun --monitor``.

When ``KAITIAN_MONITOR_DIR`` is set, :class:`kaitian.DistributedDataParallel`
appends one JSON line per synchronised step to ``<dir>/rank-<rank>.jsonl``
(samples, step / compute / communication / wait time, throughput) and the
:class:`kaitian.Rebalancer` one line per re-balancing round
(``"kind": "rebalance"``). The agent side (:mod:`kaitian.monitor.agent`)
reads them for its report.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Dict, List, Optional

from kaitian.settings import settings

__all__ = ["StepRecorder", "recorder_for_this_rank", "read_jsonl"]


class StepRecorder:
    """Appends one JSON line per training step to a rank's file.

    Lines are buffered and flushed about once a second (and at exit), so a
    monitor costs no measurable step time.

    Args:
        path: the JSONL file.
        rank: global rank written into each record.
        extra: fields added to every record (device, group).
    """

    def __init__(self, path: str, rank: int, extra: Optional[Dict[str, object]] = None) -> None:
        self.path = path
        self.rank = rank
        self.extra = dict(extra or {})
        self._lines: List[str] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atexit.register(self.flush)

    def _add(self, record: dict) -> None:
        with self._lock:
            self._lines.append(json.dumps(record))
        if time.monotonic() - self._last_flush > 1.0:
            self.flush()

    def record_step(self, timing) -> None:
        """Records one :class:`kaitian.training.ddp.StepTiming`."""
        self._add({
            "rank": self.rank,
            "time": timing.end,
            "step": timing.step,
            "samples": timing.samples,
            "global_samples": timing.global_samples,
            "step_s": timing.step_s,
            "compute_s": timing.compute_s,
            "comm_s": timing.comm_s,
            "wait_s": timing.wait_s,
            "samples_per_s": timing.samples / timing.step_s if timing.step_s > 0 else 0.0,
            **self.extra,
        })

    def record_rebalance(self, decision) -> None:
        """Records one :class:`kaitian.training.rebalance.RebalanceDecision`."""
        self._add({
            "rank": self.rank, "kind": "rebalance", "time": time.time(), "step": decision.step,
            "old": decision.old, "new": decision.new, "applied": decision.applied,
            "per_sample_s": decision.per_sample_s, "fixed_s": decision.fixed_s,
            "exchange_s": decision.exchange_s, "within_s": decision.within_s, "groups": decision.groups,
            "predicted_s": decision.predicted_s,
            "measured_s": decision.measured_s,
        })

    def flush(self) -> None:
        """Writes buffered records to the file."""
        with self._lock:
            lines, self._lines = self._lines, []
            self._last_flush = time.monotonic()
        if lines:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")


def recorder_for_this_rank() -> Optional[StepRecorder]:
    """A recorder writing to ``KAITIAN_MONITOR_DIR``, or ``None`` when monitoring is off."""
    cfg = settings()
    if not cfg.monitor_dir:
        return None
    rank = int(os.environ.get("RANK", "0"))
    extra = {
        "device": f"{cfg.device_type or 'cpu'}:{cfg.device_index if cfg.device_index is not None else 0}",
        "group": cfg.group or cfg.device_type or "cpu",
    }
    return StepRecorder(os.path.join(cfg.monitor_dir, f"rank-{rank}.jsonl"), rank, extra)


def read_jsonl(path: str) -> List[dict]:
    """Reads a JSONL file, skipping a torn last line (a worker killed mid-write)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out
