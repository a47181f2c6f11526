"""``--on-failure continue``: a lost worker does not stop the others (docs/elastic.md).

The agent watches its workers one by one instead of as a group. When one
exits, it marks it gone in the workers' store (the survivors' quorum then
decides at once) and starts it again alone, as a joiner, while restarts remain
and its device is still there. It kills workers the survivors left out of a
generation (a stopped one, one that answered late), which then restart the
same way. When the job cannot go on (the decision says why, or the store is
gone, or the workers never started the kaitian.elastic protocol: a script
that does not use its Trainer) it hands over to ``restart``: the group result
is FAILED and torch's agent restarts every worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from kaitian import _torch as _te
from kaitian.elastic.membership import JobRecord

__all__ = ["Continuation", "WorkerProcess", "device_present", "job_record", "publish_live_job", "read_live_job"]

logger = logging.getLogger(__name__)

_LIVE_JOB_KEY = "kaitian/elastic/live"  # in a rendezvous round: the running job a new node joins


@dataclass
class WorkerProcess:
    """One local worker as continue mode tracks it.

    Attributes:
        local_rank: its local rank.
        member: its current member id.
        incarnation: how many times it was started alone.
        context: the process context it runs in, and its key there.
        key: its key in ``context``.
        exit_code: ``None`` while it runs.
    """

    local_rank: int
    member: str
    incarnation: int
    context: Any
    key: int
    exit_code: Optional[int] = None


@dataclass
class Continuation:
    """This node's workers under ``--on-failure continue``.

    Args:
        record: the job's keys in the workers' store.
        runtime: the runtime that started the workers (polls and kills them one by one).
        restart: ``restart(worker) -> (context, key)``: starts ``worker`` again
            alone, as a joiner (``worker.member``/``incarnation`` already new).
        can_restart: ``can_restart(worker)``: a restart is left and its device is there.
    """

    record: JobRecord
    runtime: Any
    restart: Callable[["WorkerProcess"], tuple]
    can_restart: Callable[["WorkerProcess"], bool]
    workers: Dict[int, WorkerProcess] = field(default_factory=dict)
    failures: Dict[int, Any] = field(default_factory=dict)  # local rank -> ProcessFailure
    contexts: List[Any] = field(default_factory=list)  # every process context started: all are closed
    _generation: int = -1

    def watch(self, workers: List[WorkerProcess]) -> None:
        """Adds the workers of one start (the group's, at first)."""
        for w in workers:
            self.workers[w.local_rank] = w
            if all(c is not w.context for c in self.contexts):
                self.contexts.append(w.context)

    def monitor(self, global_ranks: Dict[int, int]) -> "_te.RunResult":
        """One look at the workers: mark the exited gone, restart or drop them, kill the excluded.

        Args:
            global_ranks: local rank -> the round's global rank (the result's keys).
        """
        def by_rank(values: Dict[int, Any]) -> Dict[int, Any]:
            return {global_ranks[lr]: v for lr, v in values.items()}

        try:
            self._kill_excluded()
            for worker in list(self.workers.values()):
                if worker.exit_code is None:
                    code = self.runtime.exit_codes(worker.context)[worker.key]
                    if code is not None:
                        self._exited(worker, code)
        except _Handover as handover:
            logger.error("kaitian elastic: the job cannot go on (%s); --on-failure restart takes over", handover)
            return _te.RunResult(state=_te.WorkerState.FAILED, failures=by_rank(self.failures))
        running = [w for w in self.workers.values() if w.exit_code is None]
        if running:
            return _te.RunResult(state=_te.WorkerState.HEALTHY)
        succeeded = {w.local_rank: None for w in self.workers.values() if w.exit_code == 0}
        if succeeded:  # the lost ones' failures are kept: torch records an event per worker
            return _te.RunResult(state=_te.WorkerState.SUCCEEDED, return_values=by_rank(succeeded),
                                 failures=by_rank(self.failures))
        return _te.RunResult(state=_te.WorkerState.FAILED, failures=by_rank(self.failures))

    def _exited(self, worker: WorkerProcess, code: int) -> None:
        worker.exit_code = code
        pid = worker.context.pids()[worker.key]
        self.runtime.forget_worker(pid)
        if code != 0:
            self.failures[worker.local_rank] = _te.ProcessFailure(
                local_rank=worker.local_rank, pid=pid, exitcode=code,
                error_file=worker.context.error_files.get(worker.key, ""))
        if code == 0:
            with contextlib.suppress(RuntimeError, OSError):  # node 0 closes the store once every member finished
                self.record.mark_gone(worker.member)
            return
        self._store(self.record.mark_gone, worker.member)
        reason = self._store(self.record.stop_reason)
        if reason:
            raise _Handover(reason)
        if self._store(self.record.latest) < 0:
            raise _Handover("the workers never formed a kaitian.elastic job (the script does not train with "
                            "kaitian.elastic.Trainer, or failed before it started)")
        if self._store(self.record.done):
            logger.warning("kaitian elastic: worker %s exited with %s after training ended", worker.member, code)
            return
        if not self.can_restart(worker):
            logger.warning("kaitian elastic: worker %s lost (exit code %s); the others go on without it",
                           worker.member, code)
            return
        lost = worker.member
        worker.incarnation += 1
        worker.member = f"{lost.rsplit('/', 1)[0]}/{worker.incarnation}"
        logger.warning("kaitian elastic: worker %s lost (exit code %s); the others go on, it starts again as %s "
                       "and joins", lost, code, worker.member)
        worker.context, worker.key = self.restart(worker)
        worker.exit_code = None
        self.contexts.append(worker.context)

    def _kill_excluded(self) -> None:
        try:
            latest = self.record.latest()
            while self._generation < latest:
                decision = self.record.decision(self._generation + 1)
                self._generation += 1
                excluded = set(decision.excluded) if decision is not None else set()
                for worker in self.workers.values():
                    if worker.exit_code is None and worker.member in excluded:
                        logger.warning("kaitian elastic: %s was left out of generation %d; stopping it",
                                       worker.member, self._generation)
                        self.runtime.kill_worker(worker.context, worker.key)
        except (RuntimeError, OSError):  # the store's host is lost: the workers will fail and say so
            return

    def _store(self, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, OSError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
            raise _Handover(f"the workers' store does not answer: {exc}") from None

    def finished(self, timeout: float, poll_s: float = 0.05) -> None:
        """Node 0 (which serves the store): waits until every member of the last
        generation finished or is gone, so nobody loses the store it still needs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                decision = self.record.decision(self.record.latest())
                if decision is None or set(decision.members) <= self.record.finished() | self.record.gone():
                    return
            except (RuntimeError, OSError):
                return
            time.sleep(poll_s)
        logger.warning("kaitian elastic: not every member said it finished within %s s", timeout)


class _Handover(Exception):
    """The job cannot go on in continue mode: hand over to restart."""


def job_record(store_addr: Tuple[str, int], run: str) -> JobRecord:
    """The job's keys, through a client of the workers' store."""
    import torch.distributed as dist

    store = dist.TCPStore(store_addr[0], int(store_addr[1]), is_master=False, timeout=timedelta(seconds=30))
    return JobRecord(store, run)


def publish_live_job(store, live: Dict[str, Any]) -> None:
    """In a rendezvous round: the running job (its workers' store, keys, bridge key) a new node joins."""
    store.set(_LIVE_JOB_KEY, json.dumps(live))


def read_live_job(store) -> Optional[Dict[str, Any]]:
    """The running job published in this round, or ``None``."""
    return json.loads(bytes(store.get(_LIVE_JOB_KEY)).decode()) if store.check([_LIVE_JOB_KEY]) else None


def device_present(device) -> bool:
    """Whether a worker's device is still on this host (a GPU can fall off the bus)."""
    if device.type == "cpu":
        return True
    from kaitian.devices.inventory import discover

    try:
        return any(d.type == device.type and d.index == device.index for d in discover())
    except Exception:  # noqa: BLE001 (a probe that fails says nothing about the device)
        logger.warning("could not probe %s devices; restarting the worker anyway", device.type, exc_info=True)
        return True
