"""``KaitianAgent``: torch's ``LocalElasticAgent`` with kaitian's rank layout, variables and runtimes.

torch's agent runs the job (rendezvous, start, monitor, restart, exit barrier,
watchdog, health check) and gives every worker this torch release's torchrun
environment. kaitian changes five things:

- the ranks: nodes exchange their device inventories and ranks are laid out
  grouped by vendor (``_assign_worker_ranks``, :mod:`kaitian.launcher.placement`);
- the workers' store: node 0 serves a fresh one after a restart (``_serve_worker_store``);
- where workers run: the processes torch would start (its arguments and
  environments) get kaitian's variables and go to a
  :class:`~kaitian.launcher.runtimes.base.Runtime` (``_start_workers``);
- ``--on-failure continue``: workers are watched and started again one by one
  (``_monitor_workers``, ``_restart_workers``, ``_exit_barrier``;
  :mod:`kaitian.launcher.continuing`);
- a stop signal is never lost: one that an ``except Exception`` swallowed is
  raised again at the next monitoring step (:mod:`kaitian.launcher.stop_signal`).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
from typing import Any, Dict, List, Optional, Tuple

from kaitian import _torch as _te
from kaitian.errors import RendezvousError
from kaitian.launcher.attempt import Attempt
from kaitian.launcher.continuing import (
    Continuation, WorkerProcess, device_present, job_record, publish_live_job, read_live_job,
)
from kaitian.launcher.environment import worker_environment
from kaitian.launcher.logs import line_prefixes, one_worker_logs
from kaitian.launcher.rendezvous import NodePlacement, agree_on_placement, local_inventory
from kaitian.launcher.runtimes.base import WorkerStart
from kaitian.launcher.stop_signal import StopSignal
from kaitian.settings import settings

from kaitian.launcher.request import LaunchRequest

__all__ = ["KaitianAgent"]

logger = logging.getLogger(__name__)


class KaitianAgent(_te.LocalElasticAgent):
    """Starts, monitors and restarts this node's workers through a runtime.

    Args:
        spec: torchelastic's worker spec (``local_world_size``: this node's workers).
        config: torchrun's launch config (logs specs, start method, line prefix
            template, shutdown timeout, ``--nnodes`` MIN).
        launch: what kaitian adds (:class:`~kaitian.launcher.request.LaunchRequest`).
        monitor: an ``AgentMonitor`` fed with worker pids after each start, or ``None``.
    """

    def __init__(self, spec: "_te.WorkerSpec", config: "_te.LaunchConfig", launch: LaunchRequest,
                 monitor: Any = None) -> None:
        if spec.local_world_size != len(launch.node.workers):
            raise ValueError(f"local_world_size {spec.local_world_size} != this node's {len(launch.node.workers)} workers")
        shutdown_timeout = _te.launch_option(config, "shutdown_timeout")  # torch 2.12+
        _te.call_supported(
            super().__init__, spec, logs_specs=config.logs_specs, start_method=config.start_method,
            log_line_prefix_template=config.log_line_prefix_template, shutdown_timeout=shutdown_timeout,
        )
        self._shutdown_timeout = 30 if shutdown_timeout is None else shutdown_timeout
        self._launch = launch
        self._node_workers = launch.node
        self._runtime = launch.runtime
        self._monitor = monitor
        # The last rendezvous round's placement, and the live job a new node joins (continue mode).
        self._round: Tuple[Optional[NodePlacement], Optional[Dict[str, Any]]] = (None, None)
        self._attempt: Optional[Attempt] = None  # the current start
        self._served_store = None  # the store node 0 serves to its workers after a restart
        self._node = f"{socket.gethostname()}:{os.getpid()}"  # names this agent's workers in continue mode
        self._continuation: Optional[Continuation] = None
        self._stop_signal = StopSignal()

    # -- rank layout ----------------------------------------------------------

    def _assign_worker_ranks(
        self, store, group_rank: int, group_world_size: int, spec: "_te.WorkerSpec"
    ) -> List["_te.Worker"]:
        """Agrees on the round's placement (decided once, by node 0) and lays ranks out by vendor.

        Continue mode: agents whose workers keep running publish the live job
        (before their inventory, so whoever reads the placement can read it); a
        node new to the job starts its workers as joiners of it.
        """
        live = self._live_job()
        if live is None:
            self._served_store = None  # node 0 of the previous round serves no more (this one may not be node 0)
        else:
            publish_live_job(store, live)
        placement = agree_on_placement(
            store, group_rank, group_world_size,
            local_inventory(spec.role, [w.device for w in self._node_workers.workers]),
            serve_worker_store=lambda: self._serve_worker_store(spec, store),
        )
        self._round = (placement, read_live_job(store) if live is None and self._launch.continues else None)
        return [
            _te.Worker(
                local_rank=local_rank,
                global_rank=p.global_rank,
                role_rank=p.role_rank,
                world_size=p.world_size,
                role_world_size=p.role_world_size,
            )
            for local_rank, p in enumerate(placement.placements)
        ]

    # -- the workers' store ---------------------------------------------------

    def _serve_worker_store(self, spec: "_te.WorkerSpec", store) -> Optional[Tuple[str, int]]:
        """Node 0: the store this start's workers use, published to every node with the placement.

        torch 2.13 workers join the agent's store without a per-attempt prefix
        (``TORCHELASTIC_USE_AGENT_STORE``), and the agent's store outlives a
        restart, so restarted workers would read the previous attempt's keys
        (gloo connects to dead peers and the job hangs, under torchrun too).
        Node 0 therefore serves a fresh store for every start after its first
        (whose store is torchrun's exact one), on ``--master-port`` when one
        is given (firewalled clusters), else on a free port. Every node takes
        the address from node 0's placement, never from torch's cache: after
        the node that held the store is lost, torch's cache on the survivors
        still names it. In continue mode a running job keeps its store.

        Where torch's handler does not share its store (torch before 2.5, or
        ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), worker rank 0 hosts the
        store, as under torchrun; continue mode needs one that outlives any
        worker, so node 0 serves it from the first start.
        """
        live = read_live_job(store) if self._launch.continues else None
        if live is not None:
            return tuple(live["store"])
        shared = spec.rdzv_handler.use_agent_store
        if not shared and not self._launch.continues:
            return None  # worker rank 0 hosts the store (torchrun's MASTER_ADDR / MASTER_PORT)
        info = getattr(spec.rdzv_handler, "last_info", None)
        bootstrap = info.bootstrap_store_info if info is not None else None
        addr = spec.master_addr or (bootstrap.master_addr if bootstrap else None)
        port = spec.master_port or (bootstrap.master_port if bootstrap else None)
        if addr is None or port is None:
            return None
        fixed = self._launch.worker_store_port
        if shared and self._attempt is None and (fixed is None or fixed == port):
            return addr, int(port)
        import torch.distributed as dist

        try:
            self._served_store = dist.TCPStore(host_name=addr, port=fixed or 0, is_master=True, wait_for_workers=False)
        except RuntimeError as e:
            raise RendezvousError(
                f"cannot serve the workers' store on port {fixed or 0} of {addr} ({e}); "
                "free the port or choose another --master-port"
            ) from None
        return addr, int(self._served_store.port)

    # -- the job key -------------------------------------------------------------

    def _job_key(self, worker_group: "_te.WorkerGroup", epoch: int) -> str:
        """The secret this start's workers prove to each other on the TCP bridge.

        A ``KAITIAN_JOB_KEY`` given to kaitianrun (by the user or the scheduler)
        is passed on and written nowhere. Otherwise each start gets a fresh key:
        one node makes it; with several nodes the others read it from this
        round's rendezvous store, so whoever can read that store can read the
        key too (docs/backend.md, "Security").
        """
        given = settings().job_key
        if given:
            return given
        if worker_group.group_world_size == 1:
            return secrets.token_hex(32)
        key = f"kaitian/job_key/{epoch}"  # the round's exchange number, the same on every node
        if worker_group.group_rank == 0:
            worker_group.store.set(key, secrets.token_hex(32))
        return worker_group.store.get(key).decode()

    # -- starting workers ----------------------------------------------------------

    def _start_workers(self, worker_group: "_te.WorkerGroup") -> Dict[int, Any]:
        """torch's start (torchrun's environment, watchdog, health check), its
        processes handed to the runtime with kaitian's variables: this start's
        :class:`~kaitian.launcher.attempt.Attempt` is made here, once."""
        placement, joins = self._round
        number = 1 if self._attempt is None else self._attempt.number + 1
        epoch = placement.epoch if placement is not None else number
        start_dir = self._launch.run_dir.new_start()
        agent_store = placement is not None and placement.worker_store is not None
        if agent_store:
            worker_group.master_addr, worker_group.master_port = placement.worker_store
        joining = joins is not None  # continue mode: this node joins a running job
        if joining:  # a key given to kaitianrun is never published: then every node has it
            elastic_run, job_key = joins["run"], joins["key"] or self._job_key(worker_group, epoch)
        else:
            elastic_run, job_key = str(epoch), self._job_key(worker_group, epoch)
        members = {w.local_rank: f"{self._node}/{w.local_rank}/0" for w in worker_group.workers}

        def to_runtime(*, args: Dict[int, tuple], envs: Dict[int, Dict[str, str]], **_: Any) -> "_te.PContext":
            self._attempt = Attempt(
                number=number, placement=placement,
                workers_store=(worker_group.master_addr, int(worker_group.master_port)),
                agent_store=agent_store, serves_store=worker_group.group_rank == 0 and not joining,
                job_key=job_key, elastic_run=elastic_run, start_dir=start_dir, joining=joining,
                torchrun={lr: (args[lr], envs[lr]) for lr in envs},
            )
            return self._start_in_runtime(self._worker_start(worker_group.workers, members))

        with _te.workers_started_by(to_runtime):
            pids = super()._start_workers(worker_group)
        if self._launch.continues:
            self._continuation = self._continue(worker_group, members)
        self._workers_started(worker_group)
        return pids

    def _worker_start(self, workers: List["_te.Worker"], members: Dict[int, str],
                      restart_count: Optional[int] = None) -> WorkerStart:
        """What the runtime runs for ``workers``, numbered 0.. in this start: each one's
        torchrun arguments, and its environment (:func:`~kaitian.launcher.environment.worker_environment`).

        Args:
            workers: the group's, or one worker started again alone (with ``restart_count``).
            members: local rank -> member id (continue mode).
            restart_count: a worker started alone: its ``TORCHELASTIC_RESTART_COUNT``.
        """
        spec = self._worker_group.spec
        attempt = self._attempt
        started = {key: self._node_workers.workers[worker.local_rank] for key, worker in enumerate(workers)}
        seen = self._runtime.devices_seen(started)
        args: Dict[int, tuple] = {}
        envs: Dict[int, Dict[str, str]] = {}
        prefix_fields: Dict[int, Dict[str, object]] = {}
        for key, worker in enumerate(workers):
            mine = started[key]
            args[key] = attempt.torchrun[worker.local_rank][0]
            envs[key] = worker_environment(mine, attempt, self._launch, members[worker.local_rank],
                                           restart_count=restart_count, container=seen.get(key))
            prefix_fields[key] = {
                "rank": worker.global_rank,
                "local_rank": worker.local_rank,
                "role_name": spec.role,
                "group": mine.device.group,
                "vendor": mine.device.type,
            }
        alone = restart_count is not None  # logged at its local rank
        return WorkerStart(
            name=spec.role,
            entrypoint=spec.entrypoint,
            args=args,
            envs=envs,
            logs_specs=one_worker_logs(self._logs_specs, workers[0].local_rank) if alone else self._logs_specs,
            workers=started,
            log_line_prefixes=line_prefixes(self._log_line_prefix_template, prefix_fields),
            start_method=self._start_method,
        )

    def _start_in_runtime(self, start: WorkerStart) -> "_te.PContext":
        context = self._runtime.start(start)
        self._stop_signal.hold()  # over the handler the context's start installed
        return context

    def _workers_started(self, worker_group: "_te.WorkerGroup") -> None:
        """Records the running workers' pids (run directory, monitor)."""
        if self._continuation is not None:
            ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
            pids = {ranks[w.local_rank]: w.context.pids()[w.key] for w in self._continuation.workers.values()
                    if w.exit_code is None}
        else:
            pids = {w.global_rank: self._pcontext.pids()[w.local_rank] for w in worker_group.workers}
        self._launch.run_dir.record_workers(pids)
        if self._monitor is not None:
            try:
                self._monitor.watch(
                    pids, {w.global_rank: self._node_workers.workers[w.local_rank].device.key
                           for w in worker_group.workers},
                )
            except Exception:  # the monitor must never take the job down
                logger.warning("monitor.watch failed", exc_info=True)

    # -- --on-failure continue ---------------------------------------------------------

    def _continue(self, worker_group: "_te.WorkerGroup", members: Dict[int, str]) -> Continuation:
        """Watches this start's workers one by one (continue mode)."""
        def restart(worker: WorkerProcess) -> tuple:
            self._remaining_restarts -= 1
            count = worker_group.spec.max_restarts - self._remaining_restarts
            start = self._worker_start([worker_group.workers[worker.local_rank]], {worker.local_rank: worker.member},
                                       restart_count=count)
            context = self._start_in_runtime(start)
            self._workers_started(worker_group)
            return context, 0

        def can_restart(worker: WorkerProcess) -> bool:
            if self._remaining_restarts <= 0:
                return False
            return device_present(self._node_workers.workers[worker.local_rank].device)

        record = job_record(self._attempt.workers_store, self._attempt.elastic_run)
        continuation = Continuation(record, self._runtime, restart, can_restart)
        continuation.watch([WorkerProcess(w.local_rank, members[w.local_rank], 0, self._pcontext,
                                          w.local_rank) for w in worker_group.workers])
        return continuation

    def _live_job(self) -> Optional[Dict[str, Any]]:
        """This agent's running continue-mode job (its store, keys and bridge key), or ``None``."""
        if self._continuation is None or not any(w.exit_code is None for w in self._continuation.workers.values()):
            return None
        return self._attempt.live_job(key_given=bool(settings().job_key))

    def _restart_workers(self, worker_group: "_te.WorkerGroup") -> None:
        if self._continuation is not None and worker_group.state == _te.WorkerState.HEALTHY:
            # A node waits to join (torch would stop every worker): a new round, and the
            # running workers stay; the new node's workers join them at a step boundary.
            logger.info("[%s] a node joins the running job; the workers keep training", worker_group.spec.role)
            self._rendezvous(worker_group)
            worker_group.master_addr, worker_group.master_port = self._attempt.workers_store
            return
        super()._restart_workers(worker_group)

    def _exit_barrier(self) -> None:
        if self._continuation is None:
            return super()._exit_barrier()
        # Nodes may be gone for good: no barrier over all of them. The node that
        # serves the workers' store stays until every member is done with it.
        if self._attempt.serves_store:
            self._continuation.finished(self._exit_barrier_timeout)
        return None

    def _monitor_workers(self, worker_group: "_te.WorkerGroup") -> "_te.RunResult":
        self._stop_signal.raise_received()  # one an `except Exception` swallowed
        if self._continuation is not None:
            return self._continuation.monitor({w.local_rank: w.global_rank for w in worker_group.workers})
        return super()._monitor_workers(worker_group)

    # -- stopping ------------------------------------------------------------------------

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: Optional[int] = None,
                  is_restart: bool = False) -> None:  # torch < 2.9 passes is_restart
        """torch's (watchdog, health check, the workers' process context), and the
        workers a continue-mode job started alone, their own children too."""
        timeout = self._shutdown_timeout if timeout is None else timeout  # torch's _stop_workers passes none
        contexts = self._continuation.contexts if self._continuation is not None else [self._pcontext]
        self._continuation = None
        pids = [pid for c in contexts if c is not None for pid in c.pids().values()]
        if self._pcontext is not None:
            self._runtime.before_stop()
            # A stopped worker (SIGSTOP by anyone) runs a SIGTERM handler only once
            # continued: continue every worker with the stop signal.
            _signal_each(os.kill, pids, signal.SIGCONT)
        _te.close_local_agent(super()._shutdown, death_sig, timeout)
        for c in contexts:
            if c is not None and c is not self._pcontext:
                c.close(death_sig, timeout)
        # Each worker leads its own process group (torch starts it in a new
        # session): what it forked and left running goes with the job.
        _signal_each(os.killpg, pids, signal.SIGKILL)


def _signal_each(send, ids: List[int], sig: signal.Signals) -> None:
    """``send(id, sig)`` for each process (group) id that still exists.

    Ids below 2 are not a worker (-1: a pid not known yet) and would reach far
    more: kill(-1) signals every process the agent may signal, killpg(1) is
    kill(-1), and 0 is the agent's own group.
    """
    for i in ids:
        if i < 2:
            continue
        try:
            send(i, sig)
        except (ProcessLookupError, PermissionError):
            pass
