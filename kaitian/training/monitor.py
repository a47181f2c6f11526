"""Run monitoring: per-rank step records (workers) and device utilisation (agent).

Workers: when ``KAITIAN_MONITOR_DIR`` is set (``kaitianrun --monitor``),
``kaitian.DistributedDataParallel`` appends one JSON line per training step to
``<dir>/rank-<rank>.jsonl`` (samples, step / compute / communication time,
throughput).

Agent: :class:`AgentMonitor` samples each worker's CPU use (psutil, the worker
and its children) and accelerator utilisation (``nvidia-smi`` / ``cnmon`` where
present) every ``interval`` seconds into ``<dir>/utilisation.jsonl``; at the
end :meth:`AgentMonitor.report` writes ``monitor.png`` and ``summary.txt``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import time
from typing import Dict, List, Optional

from kaitian.devices.utilisation import device_utilisation
from kaitian.settings import settings

__all__ = ["StepRecorder", "recorder_for_this_rank", "AgentMonitor", "read_jsonl"]

_log = logging.getLogger(__name__)

UTILISATION_FILE = "utilisation.jsonl"


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

    def record_step(self, timing) -> None:
        """Records one :class:`kaitian.training.ddp.StepTiming`."""
        record = {
            "rank": self.rank,
            "time": timing.end,
            "step": timing.step,
            "samples": timing.samples,
            "global_samples": timing.global_samples,
            "step_s": timing.step_s,
            "compute_s": timing.compute_s,
            "comm_s": timing.comm_s,
            "samples_per_s": timing.samples / timing.step_s if timing.step_s > 0 else 0.0,
            **self.extra,
        }
        with self._lock:
            self._lines.append(json.dumps(record))
        if time.monotonic() - self._last_flush > 1.0:
            self.flush()

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


class AgentMonitor:
    """Samples the workers' utilisation while a job runs; reports at the end.

    Used by ``kaitianrun --monitor [DIR]``: ``start()``, ``watch()`` after each
    (re)start of the workers, ``stop()`` and ``report()`` at the end.

    Args:
        out_dir: where the workers' ``rank-*.jsonl`` go (``KAITIAN_MONITOR_DIR``)
            and where the report is written.
        interval: seconds between utilisation samples.
    """

    def __init__(self, out_dir: str, interval: float = 1.0) -> None:
        self.out_dir = out_dir
        self.interval = float(interval)
        self._pids: Dict[int, int] = {}
        self._devices: Dict[int, str] = {}
        self._procs: Dict[int, object] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_time: Optional[float] = None
        os.makedirs(out_dir, exist_ok=True)

    def start(self) -> None:
        """Starts the sampling thread (idempotent)."""
        if self._thread is not None:
            return
        self._start_time = time.time()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kaitian-monitor", daemon=True)
        self._thread.start()

    def watch(self, pids_by_rank: Dict[int, int], devices_by_rank: Dict[int, str]) -> None:
        """Sets the worker processes to sample (call again after a restart).

        Args:
            pids_by_rank: global rank -> worker pid.
            devices_by_rank: global rank -> device key (``cuda:0``, ``cpu:1``).
        """
        with self._lock:
            self._pids = {int(r): int(p) for r, p in pids_by_rank.items()}
            self._devices = {int(r): str(d) for r, d in devices_by_rank.items()}
            self._procs = {}

    def stop(self) -> None:
        """Stops sampling (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval + 5)
            self._thread = None

    def _process(self, rank: int, pid: int):
        import psutil

        proc = self._procs.get(rank)
        if proc is None:
            proc = psutil.Process(pid)
            proc.cpu_percent(None)  # primes the counter
            for child in proc.children(recursive=True):
                child.cpu_percent(None)
            self._procs[rank] = proc
        return proc

    def _sample(self) -> List[dict]:
        import psutil

        with self._lock:
            pids, devices = dict(self._pids), dict(self._devices)
        accel = device_utilisation({d.split(":")[0] for d in devices.values()})
        now = time.time()
        samples = []
        for rank, pid in sorted(pids.items()):
            record = {"time": now, "rank": rank, "device": devices.get(rank, "")}
            try:
                proc = self._process(rank, pid)
                cpu = proc.cpu_percent(None)
                rss = proc.memory_info().rss
                for child in proc.children(recursive=True):
                    try:
                        cpu += child.cpu_percent(None)
                        rss += child.memory_info().rss
                    except psutil.Error:
                        pass
                record.update(cpu_percent=cpu, rss_bytes=rss)
            except psutil.Error:
                continue  # exited or restarting; the next watch() brings the new pid
            if record["device"] in accel:
                record["device_util"] = accel[record["device"]]
            samples.append(record)
        return samples

    def _run(self) -> None:
        path = os.path.join(self.out_dir, UTILISATION_FILE)
        while not self._stop.wait(self.interval):
            try:
                samples = self._sample()
            except Exception:  # monitoring must never take the job down
                _log.debug("monitor sample failed", exc_info=True)
                continue
            if samples:
                with open(path, "a", encoding="utf-8") as f:
                    f.write("".join(json.dumps(s) + "\n" for s in samples))

    # -- report ----------------------------------------------------------------------

    def _load(self):
        steps: Dict[int, List[dict]] = {}
        for name in sorted(os.listdir(self.out_dir)):
            m = re.fullmatch(r"rank-(\d+)\.jsonl", name)
            if m:
                steps[int(m.group(1))] = read_jsonl(os.path.join(self.out_dir, name))
        util: Dict[int, List[dict]] = {}
        for rec in read_jsonl(os.path.join(self.out_dir, UTILISATION_FILE)):
            util.setdefault(int(rec["rank"]), []).append(rec)
        return steps, util

    def report(self) -> str:
        """Writes ``summary.txt`` and ``monitor.png`` in ``out_dir``; returns the summary table."""
        steps, util = self._load()
        ranks = sorted(set(steps) | set(util))
        head = ("RANK", "DEVICE", "GROUP", "STEPS", "SAMPLES", "BATCH", "SAMPLES/S",
                "STEP MS", "COMPUTE MS", "COMM MS", "COMM %", "CPU %", "DEV UTIL %")
        rows = [head]
        total_rate = 0.0
        for rank in ranks:
            recs = steps.get(rank, [])
            ut = util.get(rank, [])
            n_steps = len(recs)
            samples = sum(r["samples"] for r in recs)
            step_s = sum(r["step_s"] for r in recs)
            comm_s = sum(r["comm_s"] for r in recs)
            compute_s = sum(r["compute_s"] for r in recs)
            rate = samples / step_s if step_s > 0 else 0.0
            total_rate += rate
            cpu = [u["cpu_percent"] for u in ut if "cpu_percent" in u]
            dev = [u["device_util"] for u in ut if "device_util" in u]
            device = (recs[-1].get("device") if recs else None) or (ut[-1]["device"] if ut else "-")
            rows.append((
                str(rank), device, (recs[-1].get("group", "-") if recs else "-"),
                str(n_steps), str(samples),
                f"{samples / n_steps:.1f}" if n_steps else "-",
                f"{rate:.1f}",
                f"{1000 * step_s / n_steps:.1f}" if n_steps else "-",
                f"{1000 * compute_s / n_steps:.1f}" if n_steps else "-",
                f"{1000 * comm_s / n_steps:.1f}" if n_steps else "-",
                f"{100 * comm_s / step_s:.1f}" if step_s > 0 else "-",
                f"{sum(cpu) / len(cpu):.0f}" if cpu else "-",
                f"{sum(dev) / len(dev):.0f}" if dev else "-",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        table = "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
        table += f"\n\njob throughput: {total_rate:.1f} samples/s over {len(ranks)} rank(s)"
        with open(os.path.join(self.out_dir, "summary.txt"), "w", encoding="utf-8") as f:
            f.write(table + "\n")
        try:
            self._plot(steps, util)
        except ImportError:
            table += "\n(matplotlib is not installed: no monitor.png; pip install matplotlib)"
        return table

    def _plot(self, steps: Dict[int, List[dict]], util: Dict[int, List[dict]]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t0 = min(
            [r["time"] for recs in steps.values() for r in recs[:1]]
            + [u["time"] for recs in util.values() for u in recs[:1]]
            + [self._start_time or time.time()]
        )
        fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
        for rank, recs in sorted(steps.items()):
            if not recs:
                continue
            label = f"rank {rank} ({recs[-1].get('device', '')})"
            t = [r["time"] - t0 for r in recs]
            axes[0].plot(t, [r["samples_per_s"] for r in recs], label=label, lw=0.8)
            axes[1].plot(t, [1000 * r["step_s"] for r in recs], label=f"{label} step", lw=0.8)
            axes[1].plot(t, [1000 * r["comm_s"] for r in recs], "--", label=f"{label} comm", lw=0.8)
        for rank, recs in sorted(util.items()):
            t = [u["time"] - t0 for u in recs]
            axes[2].plot(t, [u.get("cpu_percent", 0.0) for u in recs], label=f"rank {rank} CPU %")
            if any("device_util" in u for u in recs):
                axes[2].plot(t, [u.get("device_util", 0.0) for u in recs], ":",
                             label=f"rank {rank} device %")
        axes[0].set_ylabel("samples/s")
        axes[1].set_ylabel("ms per step")
        axes[2].set_ylabel("utilisation %")
        axes[2].set_xlabel("seconds")
        for ax in axes:
            if ax.lines:
                ax.legend(fontsize=7, loc="upper right")
            ax.grid(alpha=0.3)
        fig.suptitle("kaitian monitor")
        fig.tight_layout()
        fig.savefig(os.path.join(self.out_dir, "monitor.png"), dpi=90)
        plt.close(fig)
