"""The agent side of ``kaitianrun --monitor``: utilisation sampling and the run's report.

The workers write one JSON line per step (and per re-balancing round) to
``<dir>/rank-<rank>.jsonl`` (:mod:`kaitian.monitor.records`).
:class:`AgentMonitor` samples each worker's CPU use (psutil, the worker and
its children) and accelerator utilisation
(:func:`kaitian.devices.vendors.utilisation`) every ``interval``
seconds into ``<dir>/utilisation.jsonl``; at the end :meth:`AgentMonitor.report`
writes ``monitor.png`` and ``summary.txt``. Each run starts a fresh record:
:meth:`AgentMonitor.start` moves an earlier run's files to ``<dir>/previous/``.

Communication vs waiting: a rank's time in the gradient allreduce is the
transfer itself plus the time it waits for slower ranks. In each step the
rank that arrived last waited least, so the smallest allreduce time of the
step (over ranks) is taken as *communication* and each rank's excess over it
as *imbalance wait*; re-balancing drives the wait towards zero.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from typing import Dict, List, Mapping, Optional, Tuple

from kaitian.devices.vendors import utilisation
from kaitian.monitor.records import read_jsonl
from kaitian.training.stepcost import StepCost, predicted_step

__all__ = ["AgentMonitor", "split_wait"]

_log = logging.getLogger(__name__)

UTILISATION_FILE = "utilisation.jsonl"
RANK_FILE = re.compile(r"rank-(\d+)\.jsonl")
# what a run leaves in the directory: set aside when the next one starts
RUN_FILES = (UTILISATION_FILE, "summary.txt", "monitor.png")


class AgentMonitor:
    """Samples the workers' utilisation while a job runs; reports at the end.

    Used by ``kaitianrun --monitor [DIR]``: ``start()``, ``watch()`` after each
    (re)start of the workers, ``stop()`` and ``report()`` at the end.

    Args:
        out_dir: where the workers' ``rank-*.jsonl`` go (``KAITIAN_MONITOR_DIR``)
            and where the report is written.
        interval: seconds between utilisation samples.
        cpu_quotas: group -> cores of CPU time (``--cpu-quota``), named in the plot's title.
    """

    def __init__(self, out_dir: str, interval: float = 1.0, cpu_quotas: Optional[Mapping[str, float]] = None) -> None:
        self.out_dir = out_dir
        self.interval = float(interval)
        self.cpu_quotas = dict(cpu_quotas or {})
        self._pids: Dict[int, int] = {}
        self._devices: Dict[int, str] = {}
        self._procs: Dict[int, object] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_time: Optional[float] = None
        os.makedirs(out_dir, exist_ok=True)

    def start(self) -> None:
        """Sets an earlier run's record aside and starts the sampling thread (idempotent)."""
        if self._thread is not None:
            return
        self._set_aside_previous_run()
        self._start_time = time.time()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kaitian-monitor", daemon=True)
        self._thread.start()

    def _set_aside_previous_run(self) -> None:
        """Moves an earlier run's files to ``<dir>/previous/``, replacing the run kept there.

        The workers append to their files (a restart in the same run goes on in
        them), so a second run into the same directory would otherwise be
        counted with the first and plotted across the gap between them.
        """
        names = [n for n in os.listdir(self.out_dir) if n in RUN_FILES or RANK_FILE.fullmatch(n)]
        if not names:
            return
        previous = os.path.join(self.out_dir, "previous")
        shutil.rmtree(previous, ignore_errors=True)
        os.makedirs(previous)
        for name in names:
            os.replace(os.path.join(self.out_dir, name), os.path.join(previous, name))

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
        accel = utilisation({d.split(":")[0] for d in devices.values()})
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
        rounds: Dict[tuple, dict] = {}
        for name in sorted(os.listdir(self.out_dir)):
            m = RANK_FILE.fullmatch(name)
            if m:
                records = read_jsonl(os.path.join(self.out_dir, name))
                steps[int(m.group(1))] = [r for r in records if r.get("kind", "step") == "step"]
                # every rank of a round records it (a benched rank takes part in the epoch starts only)
                for r in records:
                    if r.get("kind") == "rebalance":
                        rounds.setdefault((r["step"], tuple(r["old"]), tuple(r["new"])), r)
        util: Dict[int, List[dict]] = {}
        for rec in read_jsonl(os.path.join(self.out_dir, UTILISATION_FILE)):
            util.setdefault(int(rec["rank"]), []).append(rec)
        return steps, util, sorted(rounds.values(), key=lambda r: r["time"])

    def report(self) -> str:
        """Writes ``summary.txt`` and ``monitor.png`` in ``out_dir``; returns the summary table."""
        steps, util, rounds = self._load()
        waits = split_wait(steps)
        ranks = sorted(set(steps) | set(util))
        head = ("RANK", "DEVICE", "GROUP", "STEPS", "SAMPLES", "BATCH", "SAMPLES/S",
                "STEP MS", "COMPUTE MS", "COMM MS", "WAIT MS", "WAIT %", "CPU %", "DEV UTIL %")
        rows = [head]
        total_rate = 0.0
        benched = [r for r, n in enumerate(rounds[-1]["new"]) if n == 0] if rounds else []
        for rank in ranks:
            recs = steps.get(rank, [])
            ut = util.get(rank, [])
            n = len(recs)
            samples = sum(r["samples"] for r in recs)
            step_s = sum(r["step_s"] for r in recs)
            compute_s = sum(r["compute_s"] for r in recs)
            comm_s = sum(c for c, _ in waits.get(rank, []))
            wait_s = sum(w for _, w in waits.get(rank, []))
            rate = samples / step_s if step_s > 0 else 0.0
            total_rate += rate
            cpu = [u["cpu_percent"] for u in ut if "cpu_percent" in u]
            dev = [u["device_util"] for u in ut if "device_util" in u]
            device = (recs[-1].get("device") if recs else None) or (ut[-1]["device"] if ut else "-")
            per_step = (lambda v: f"{1000 * v / n:.1f}") if n else (lambda v: "-")
            rows.append((
                str(rank), device, (recs[-1].get("group", "-") if recs else "-"),
                str(n), str(samples),
                "benched" if rank in benched else (str(_full_step_batch(recs)) if n else "-"),
                f"{rate:.1f}",
                per_step(step_s), per_step(compute_s), per_step(comm_s), per_step(wait_s),
                f"{100 * wait_s / step_s:.1f}" if step_s > 0 else "-",
                f"{sum(cpu) / len(cpu):.0f}" if cpu else "-",
                f"{sum(dev) / len(dev):.0f}" if dev else "-",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        table = "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
        table += f"\n\njob throughput: {total_rate:.1f} samples/s over {len(ranks)} rank(s)"
        applied = [r for r in rounds if r.get("applied")]
        if rounds:
            table += (f"; {len(rounds)} re-balancing round(s), {len(applied)} changed the split"
                      + (f" (last: {applied[-1]['new']} at step {applied[-1]['step']})" if applied else ""))
        if rounds and rounds[-1].get("predicted_s"):
            last = rounds[-1]
            table += (f"\nlast round: predicted step {1000 * last['predicted_s']:.1f} ms, measured "
                      f"{1000 * last.get('measured_s', 0.0):.1f} ms"
                      + (f"; benched (hot spares): rank {', '.join(map(str, benched))}" if benched else ""))
        gain = equal_split_gain(rounds)
        if gain is not None:
            table += (f"\nvs an equal split: {gain[0]:.2f}x the throughput (the last round's step-cost model: "
                      f"{1000 * gain[1]:.1f} ms a step at an equal split)")
        table += ("\nBATCH: a full step's (benched: none, a hot spare); COMM: the allreduce itself "
                  "(the step's fastest rank); WAIT: time waiting for slower ranks")
        with open(os.path.join(self.out_dir, "summary.txt"), "w", encoding="utf-8") as f:
            f.write(table + "\n")
        try:
            self._plot(steps, util, rounds, waits, self._title(steps, rounds, gain))
        except ImportError:
            table += "\n(matplotlib is not installed: no monitor.png; pip install matplotlib)"
        return table

    def _title(self, steps: Dict[int, List[dict]], rounds: List[dict], gain: Optional[Tuple[float, float]]) -> str:
        """What ran (each group's devices and CPU quota) and the gain over an equal split."""
        groups: Dict[str, List[str]] = {}
        for _, recs in sorted(steps.items()):
            if recs:
                groups.setdefault(recs[-1].get("group", "?"), []).append(recs[-1].get("device", "?"))
        parts = []
        for group, devices in groups.items():
            what = ", ".join(devices) if len(devices) <= 4 else f"{len(devices)} ranks"
            if group in self.cpu_quotas:
                what += f", {self.cpu_quotas[group]:g} core{'' if self.cpu_quotas[group] == 1 else 's'}"
            parts.append(f"{group} ({what})")
        return (" + ".join(parts) + "\n" + ("no re-balancing round" if not rounds else "gain over an equal split: "
                + (f"{gain[0]:.2f}x (step-cost model)" if gain else "not known yet")))

    def _plot(self, steps, util, rounds, waits, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        firsts = [recs[0]["time"] - recs[0]["step_s"] for recs in steps.values() if recs]
        t0 = min(firsts) if firsts else (self._start_time or time.time())
        fig, axes = plt.subplots(4, 1, figsize=(13, 11), sharex=True, layout="constrained",
                                 gridspec_kw={"height_ratios": [3, 2, 3, 2]})
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        total_t, total_rate = None, None
        last_step = 0.0
        for i, (rank, recs) in enumerate(sorted(steps.items())):
            if not recs:
                continue
            colour = colours[i % len(colours)]
            label = f"rank {rank} ({recs[-1].get('group', '')}, {recs[-1].get('device', '')})"
            t = [r["time"] - t0 for r in recs]
            rate = _smoothed_rate(recs)
            axes[0].plot(t, rate, color=colour, label=label, lw=1.2)
            # the split: full steps only (an epoch's short last step would read as a dip)
            full = _full_step_samples(recs)
            split = [(ti, r["samples"]) for ti, r in zip(t, recs) if r.get("global_samples", 0) == full]
            axes[1].step([a for a, _ in split], [b for _, b in split], where="post", color=colour,
                         label=label, lw=1.2)
            last_step = max(last_step, t[-1])
            comm = _smooth([c for c, _ in waits[rank]])
            wait = _smooth([w for _, w in waits[rank]])
            axes[2].plot(t, [1000 * v for v in _smooth([r["compute_s"] for r in recs])], color=colour,
                         lw=1.2, label=f"rank {rank} compute")
            axes[2].plot(t, [1000 * v for v in wait], "--", color=colour, lw=1.2,
                         label=f"rank {rank} imbalance wait")
            if i == 0:
                axes[2].plot(t, [1000 * v for v in comm], ":", color="black", lw=1.2,
                             label="communication (allreduce)")
                total_t = t
            if total_rate is None:
                total_rate = list(rate)
            else:
                total_rate = [a + b for a, b in zip(total_rate, rate)]
        if total_t is not None and total_rate is not None and len(steps) > 1:
            n = min(len(total_t), len(total_rate))
            axes[0].plot(total_t[:n], total_rate[:n], color="black", lw=1.0, alpha=0.6, label="job total")
        for r in rounds:
            x = r["time"] - t0
            for ax in axes[:3]:
                ax.axvline(x, color="grey", lw=0.8, ls="-" if r.get("applied") else ":", alpha=0.7)
        if rounds:
            axes[1].plot([], [], color="grey", lw=0.8, label="re-balance (solid: split changed)")
            for i, rank in enumerate(sorted(steps)):  # benched ranks: at zero from the round that benched them
                out = [(r["time"] - t0, 0) for r in rounds if rank < len(r["new"]) and r["new"][rank] == 0]
                if out:
                    axes[1].plot(*zip(*out), "x", color=colours[i % len(colours)], label=f"rank {rank} benched")
            predicted = [(r["time"] - t0, 1000 * r["predicted_s"], 1000 * r.get("measured_s", 0.0))
                         for r in rounds if r.get("predicted_s")]
            if predicted:
                t, p, m = zip(*predicted)
                axes[2].plot(t, p, "v", color="black", label="step: predicted (at a round)")
                axes[2].plot(t, m, "^", color="grey", label="step: measured (before it)")
        for i, (rank, recs) in enumerate(sorted(util.items())):
            colour = colours[i % len(colours)]
            t = [u["time"] - t0 for u in recs]
            axes[3].plot(t, [u.get("cpu_percent", 0.0) for u in recs], color=colour, lw=1.0,
                         label=f"rank {rank} CPU %")
            if any("device_util" in u for u in recs):
                axes[3].plot(t, [u.get("device_util", 0.0) for u in recs], ":", color=colour,
                             label=f"rank {rank} device %")
        axes[0].set_ylabel("samples/s (smoothed)")
        axes[0].set_ylim(bottom=0)
        axes[1].set_ylabel("batch per full step")
        axes[1].set_ylim(bottom=0)
        axes[2].set_ylabel("ms per step (smoothed)")
        axes[2].set_ylim(bottom=0)
        axes[3].set_ylabel("utilisation %")
        axes[3].set_xlabel("seconds since the first training step")
        # the job's training time; start-up and shutdown samples fall outside
        axes[3].set_xlim(0, last_step * 1.02 if last_step > 0 else None)
        axes[0].set_title("throughput per rank", fontsize=9, loc="left")
        axes[1].set_title("batch split (re-balancing rounds marked)", fontsize=9, loc="left")
        axes[2].set_title("compute, communication and imbalance wait", fontsize=9, loc="left")
        axes[3].set_title("process CPU and device utilisation", fontsize=9, loc="left")
        for ax in axes:
            if ax.lines:  # beside the plot, where it covers no line
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
            ax.grid(alpha=0.3)
        fig.suptitle(f"kaitian monitor: {title}", fontsize=10)
        fig.savefig(os.path.join(self.out_dir, "monitor.png"), dpi=90)
        plt.close(fig)


def split_wait(steps: Dict[int, List[dict]]) -> Dict[int, List[Tuple[float, float]]]:
    """Per rank and step: (communication, imbalance wait) out of its allreduce time.

    Steps are matched by their index; the step's smallest allreduce time over
    the ranks is the communication, each rank's excess is its wait (plus its
    other collective waits, ``wait_s``).
    """
    by_step: Dict[int, float] = {}
    for recs in steps.values():
        for r in recs:
            by_step[r["step"]] = min(by_step.get(r["step"], float("inf")), r["comm_s"])
    out: Dict[int, List[Tuple[float, float]]] = {}
    for rank, recs in steps.items():
        out[rank] = [
            (by_step[r["step"]], r["comm_s"] - by_step[r["step"]] + r.get("wait_s", 0.0)) for r in recs
        ]
    return out


def equal_split_gain(rounds: List[dict]) -> Optional[Tuple[float, float]]:
    """The throughput gained over an equal split, by the last round's step-cost model.

    Returns:
        (the predicted step at an equal split / the one predicted for the split
        the round chose, the former in seconds), or ``None`` before a round
        that fitted every rank.
    """
    last = next((r for r in reversed(rounds) if r.get("fixed_s") and r.get("predicted_s")), None)
    if last is None:
        return None
    costs = [StepCost(a, b) for a, b in zip(last["fixed_s"], last["per_sample_s"])]
    if not all(c.known for c in costs):
        return None
    total, world = sum(last["new"]), len(last["new"])
    equal = [total // world + (r < total % world) for r in range(world)]
    equal_s = predicted_step(equal, costs, last.get("exchange_s", 0.0), last.get("groups"), last.get("within_s"))
    return equal_s / last["predicted_s"], equal_s


def _full_step_samples(recs: List[dict]) -> int:
    """The global batch of a full step (an epoch's short last step has fewer samples)."""
    return max(r.get("global_samples", 0) for r in recs)


def _full_step_batch(recs: List[dict]) -> int:
    """A rank's batch in its last full step (an epoch's short last step is not the split)."""
    full = _full_step_samples(recs)
    return next((r["samples"] for r in reversed(recs) if r.get("global_samples", 0) == full), recs[-1]["samples"])


def _smooth(values: List[float], alpha: float = 0.2) -> List[float]:
    """Exponential moving average (what a person reads as the trend)."""
    out, ema = [], None
    for v in values:
        ema = v if ema is None else alpha * v + (1 - alpha) * ema
        out.append(ema)
    return out


def _smoothed_rate(recs: List[dict], window: int = 10) -> List[float]:
    """Samples per second over the last ``window`` steps (not one noisy step)."""
    out = []
    for i in range(len(recs)):
        part = recs[max(0, i - window + 1): i + 1]
        seconds = sum(r["step_s"] for r in part)
        out.append(sum(r["samples"] for r in part) / seconds if seconds > 0 else 0.0)
    return out
