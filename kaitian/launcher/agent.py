"""``KaitianAgent``: torchelastic's ``SimpleElasticAgent`` with kaitian's rank layout and runtimes.

The template method (rendezvous, start, monitor, restart, exit barrier) is
torch's. This class fills in the four hooks and replaces the rank
assignment: nodes exchange their device inventories and ranks are laid out
grouped by vendor (:mod:`kaitian.launcher.placement`). Workers get exactly the
environment ``LocalElasticAgent`` gives them, plus the ``KAITIAN_*`` ones, and
are started by a :class:`~kaitian.launcher.runtimes.base.Runtime`.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from kaitian.devices import vendors as _vendors
from kaitian import _torch as _te
from kaitian.errors import RendezvousError
from kaitian.launcher.placement import Slot
from kaitian.launcher.logs import line_prefixes
from kaitian.launcher.plan import WorkerPlan
from kaitian.launcher.rendezvous import NodePlan, agree_on_placement, local_inventory
from kaitian.launcher.rundir import RunDir
from kaitian.launcher.runtimes.base import Runtime, WorkerLaunch, WorkerStart
from kaitian.settings import settings
from kaitian.version import versions

__all__ = ["KaitianAgent"]

logger = logging.getLogger(__name__)


class KaitianAgent(_te.SimpleElasticAgent):
    """Starts, monitors and restarts this node's workers through a runtime.

    Args:
        spec: torchelastic's worker spec (``local_world_size == len(plans)``).
        logs_specs: where worker logs and error files go.
        runtime: starts the workers (local subprocesses, docker exec, ...).
        plans: one :class:`WorkerPlan` per local rank.
        run_dir: this agent's run directory.
        start_method: multiprocessing start method (function entrypoints).
        log_line_prefix_template: ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``.
        shutdown_timeout: seconds between the stop signal and SIGKILL.
        capabilities: device key -> samples/s (``KAITIAN_CAPABILITY``).
        monitor_dir: ``--monitor`` directory (``KAITIAN_MONITOR_DIR``), or ``None``.
        monitor: an ``AgentMonitor`` fed with worker pids after each start.
        omp_from_user: ``OMP_NUM_THREADS`` was set by the user (it then wins
            over a CPU slot's core count).
        exit_barrier_timeout: as torch's.
        worker_store_port: the fixed port of the workers' store on node 0, kept
            across restarts (``None``: a free port after each restart).
    """

    def __init__(
        self,
        spec: "_te.WorkerSpec",
        logs_specs: "_te.LogsSpecs",
        runtime: Runtime,
        plans: List[WorkerPlan],
        run_dir: RunDir,
        start_method: str = "spawn",
        log_line_prefix_template: Optional[str] = None,
        shutdown_timeout: int = 30,
        capabilities: Optional[Dict[str, float]] = None,
        monitor_dir: Optional[str] = None,
        monitor: Any = None,
        omp_from_user: bool = False,
        exit_barrier_timeout: float = 300,
        worker_store_port: Optional[int] = None,
    ) -> None:
        if spec.local_world_size != len(plans):
            raise ValueError(f"local_world_size {spec.local_world_size} != {len(plans)} planned workers")
        super().__init__(spec, exit_barrier_timeout)
        self._shutdown_timeout = shutdown_timeout  # torch < 2.12's agent takes none
        self._logs_specs = logs_specs
        self._runtime = runtime
        self._plans = plans
        self._run_dir = run_dir
        self._start_method = start_method
        self._log_line_prefix_template = log_line_prefix_template
        self._capabilities = capabilities or {}
        self._monitor_dir = monitor_dir
        self._monitor = monitor
        self._omp_from_user = omp_from_user
        self._pcontext: Optional[_te.PContext] = None
        self._watchdog = None
        self._health_check_server = None
        self._plan: Optional[NodePlan] = None  # this round's placement, from node 0
        self._starts = 0
        self._worker_store = None  # the store node 0 serves to its workers after a restart
        self._worker_store_fixed_port = worker_store_port

    # -- rank layout ----------------------------------------------------------

    def _local_slots(self) -> List[Slot]:
        role = self._worker_group.spec.role
        return [Slot(p.device, role) for p in self._plans]

    def _assign_worker_ranks(
        self, store, group_rank: int, group_world_size: int, spec: "_te.WorkerSpec"
    ) -> List["_te.Worker"]:
        """Agrees on the round's placement (decided once, by node 0) and lays ranks out by vendor."""
        self._worker_store = None  # node 0 of the previous round serves no more (this one may not be node 0)
        plan = agree_on_placement(
            store, group_rank, group_world_size, local_inventory(self._local_slots()),
            serve_worker_store=lambda: self._serve_worker_store(spec),
        )
        self._plan = plan
        return [
            _te.Worker(
                local_rank=local_rank,
                global_rank=p.global_rank,
                role_rank=p.role_rank,
                world_size=p.world_size,
                role_world_size=p.role_world_size,
            )
            for local_rank, p in enumerate(plan.placements)
        ]

    # -- the workers' store ---------------------------------------------------

    def _serve_worker_store(self, spec: "_te.WorkerSpec") -> Optional[Tuple[str, int]]:
        """Node 0: the store this start's workers use, published to every node with the placement.

        torch 2.13 workers join the agent's store without a per-attempt prefix
        (``TORCHELASTIC_USE_AGENT_STORE``), and the agent's store outlives a
        restart, so restarted workers would read the previous attempt's keys
        (gloo connects to dead peers and the job hangs, under torchrun too).
        Node 0 therefore serves a fresh store for every start after its first
        (whose store is torchrun's exact one), on ``worker_store_port`` when
        one is configured (firewalled clusters), else on a free port. Every
        node takes the address from node 0's plan, never from torch's cache:
        after the node that held the store is lost, torch's cache on the
        survivors still names it.
        """
        if not spec.rdzv_handler.use_agent_store:
            return None  # worker rank 0 hosts the store (torchrun's MASTER_ADDR / MASTER_PORT)
        info = getattr(spec.rdzv_handler, "last_info", None)
        bootstrap = info.bootstrap_store_info if info is not None else None
        addr = spec.master_addr or (bootstrap.master_addr if bootstrap else None)
        port = spec.master_port or (bootstrap.master_port if bootstrap else None)
        if addr is None or port is None:
            return None
        if self._starts == 0 and (self._worker_store_fixed_port is None or self._worker_store_fixed_port == port):
            return addr, int(port)
        import torch.distributed as dist

        wanted = self._worker_store_fixed_port or 0
        try:
            self._worker_store = dist.TCPStore(
                host_name=addr, port=wanted, is_master=True, wait_for_workers=False
            )
        except RuntimeError as e:
            raise RendezvousError(
                f"cannot serve the workers' store on port {wanted} of {addr} ({e}); "
                "free the port or choose another --master-port"
            ) from None
        return addr, int(self._worker_store.port)

    # -- the job key -------------------------------------------------------------

    def _job_key(self, worker_group: "_te.WorkerGroup") -> str:
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
        key = f"kaitian/job_key/{self._plan.epoch}"  # the round's exchange number, the same on every node
        if worker_group.group_rank == 0:
            worker_group.store.set(key, secrets.token_hex(32))
        return worker_group.store.get(key).decode()

    # -- the worker environment ----------------------------------------------

    def _torchrun_env(self, worker_group: "_te.WorkerGroup", worker: "_te.Worker", restart_count: int) -> Dict[str, str]:
        """Exactly what ``LocalElasticAgent._start_workers`` gives a worker."""
        spec = worker_group.spec
        env = {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(worker_group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": worker_group.master_addr,
            "MASTER_PORT": str(worker_group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", str(1)),
        }
        local_rank = worker.local_rank
        if getattr(spec, "virtual_local_rank", False):  # torch 2.10+
            env["LOCAL_RANK"] = "0"
            parent = os.getenv("CUDA_VISIBLE_DEVICES")
            if parent is not None:
                gpus = parent.split(",")
                if local_rank >= len(gpus):
                    raise ValueError(
                        f"local_rank {local_rank} exceeds available GPUs in CUDA_VISIBLE_DEVICES={parent}"
                    )
                env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank].strip()
            else:
                env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
        else:
            env["LOCAL_RANK"] = str(local_rank)
            if "CUDA_VISIBLE_DEVICES" in os.environ:
                env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        return env

    def _kaitian_env(self, plan: WorkerPlan, start_dir: str, job_key: str) -> Dict[str, str]:
        env = {**plan.device.to_env(), "KAITIAN_RUN_DIR": start_dir, "KAITIAN_JOB_KEY": job_key,
               "KAITIAN_AGENT_VERSION": versions()}
        if plan.key in self._capabilities:
            env["KAITIAN_CAPABILITY"] = repr(float(self._capabilities[plan.key]))
        if self._monitor_dir:
            env["KAITIAN_MONITOR_DIR"] = self._monitor_dir
        if plan.omp_threads is not None and not self._omp_from_user:
            env["OMP_NUM_THREADS"] = str(plan.omp_threads)
        if plan.hide_other_vendors:
            for v in _vendors.VENDORS.values():
                if v.visible_env and v.name != plan.device.type:
                    env[v.visible_env] = ""
        return env

    # -- watchdog / health check (as LocalElasticAgent) ------------------------

    def _setup_watchdog(self, envs: Dict[int, Dict[str, str]]) -> None:
        path = os.getenv(_te.TORCHELASTIC_TIMER_FILE)
        if os.getenv(_te.TORCHELASTIC_ENABLE_FILE_TIMER) == "1":
            if path is None:
                path = os.path.join(tempfile.gettempdir(), "watchdog_timer_" + str(uuid.uuid4()))
            run_id = envs[0]["TORCHELASTIC_RUN_ID"] if envs else ""
            self._watchdog = _te.timer.FileTimerServer(
                file_path=path, run_id=run_id, max_interval=0.1, daemon=True
            )
            self._watchdog.start()
        if path is not None:
            for env in envs.values():
                env[_te.TORCHELASTIC_TIMER_FILE] = path

    def _setup_healthcheck(self) -> None:
        port = os.getenv(_te.TORCHELASTIC_HEALTH_CHECK_PORT)
        if port is None or self._health_check_server is not None:
            return
        try:
            callback = (
                self._watchdog.get_last_progress_time
                if self._watchdog is not None
                else (lambda: int(time.time()))
            )
            self._health_check_server = _te.create_healthcheck_server(
                alive_callback=callback, port=int(port), timeout=60
            )
            self._health_check_server.start()
        except ValueError:
            logger.info("Invalid healthcheck port value: %r; not starting the health check", port)

    # -- the four hooks ----------------------------------------------------------

    def _start_workers(self, worker_group: "_te.WorkerGroup") -> Dict[int, Any]:
        spec = worker_group.spec
        if worker_group.store is None:
            raise AssertionError("worker group has no store; rendezvous first")
        restart_count = spec.max_restarts - self._remaining_restarts
        start_dir = self._run_dir.new_start()
        if self._plan is not None and self._plan.worker_store is not None:
            worker_group.master_addr, worker_group.master_port = self._plan.worker_store
        self._starts += 1
        job_key = self._job_key(worker_group)

        args: Dict[int, tuple] = {}
        envs: Dict[int, Dict[str, str]] = {}
        launches: Dict[int, WorkerLaunch] = {}
        prefix_fields: Dict[int, Dict[str, object]] = {}
        for worker in worker_group.workers:
            local_rank = worker.local_rank
            plan = self._plans[local_rank]
            env = self._torchrun_env(worker_group, worker, restart_count)
            env.update(self._kaitian_env(plan, start_dir, job_key))
            if getattr(spec, "virtual_local_rank", False) and plan.device.type == "cuda":  # torch 2.10+
                # torchrun shows worker i the i-th GPU; kaitian shows it its planned one
                env["CUDA_VISIBLE_DEVICES"] = plan.device.uuid or str(plan.device.index)
            envs[local_rank] = env
            args[local_rank] = tuple(_te.macros.substitute(list(spec.args), str(local_rank)))
            launches[local_rank] = WorkerLaunch(
                local_rank=local_rank,
                global_rank=worker.global_rank,
                device=plan.device,
                cpus=plan.cpus,
                cpu_quota=plan.cpu_quota,
            )
            prefix_fields[local_rank] = {
                "rank": worker.global_rank,
                "local_rank": local_rank,
                "role_name": spec.role,
                "group": plan.device.group,
                "vendor": plan.device.type,
            }

        self._setup_watchdog(envs)
        self._setup_healthcheck()
        if spec.entrypoint is None:
            raise AssertionError("worker spec has no entrypoint")
        self._pcontext = self._runtime.start(WorkerStart(
            name=spec.role,
            entrypoint=spec.entrypoint,
            args=args,
            envs=envs,
            logs_specs=self._logs_specs,
            workers=launches,
            log_line_prefixes=line_prefixes(self._log_line_prefix_template, prefix_fields),
            start_method=self._start_method,
        ))
        pids = self._pcontext.pids()
        self._run_dir.record_workers(pids)
        if self._monitor is not None:
            try:
                self._monitor.watch(
                    {w.global_rank: pids[w.local_rank] for w in worker_group.workers},
                    {w.global_rank: self._plans[w.local_rank].key for w in worker_group.workers},
                )
            except Exception:  # the monitor must never take the job down
                logger.warning("monitor.watch failed", exc_info=True)
        return pids

    def _stop_workers(self, worker_group: "_te.WorkerGroup", is_restart: bool = False) -> None:  # torch < 2.9 passes is_restart
        self._shutdown(timeout=self._shutdown_timeout)

    def _monitor_workers(self, worker_group: "_te.WorkerGroup") -> "_te.RunResult":
        role = worker_group.spec.role
        if self._pcontext is None:
            raise AssertionError("no workers started")
        worker_pids = {w.id for w in worker_group.workers}
        pc_pids = set(self._pcontext.pids().values())
        if worker_pids != pc_pids:
            logger.error(
                "[%s] worker pids do not match process_context pids. Expected: %s, actual: %s",
                role,
                worker_pids,
                pc_pids,
            )
            return _te.RunResult(state=_te.WorkerState.UNKNOWN)
        result = self._pcontext.wait(0)
        if not result:
            return _te.RunResult(state=_te.WorkerState.HEALTHY)
        if result.is_failed():
            failures = {
                worker_group.workers[local_rank].global_rank: failure
                for local_rank, failure in result.failures.items()
            }
            return _te.RunResult(state=_te.WorkerState.FAILED, failures=failures)
        values = {
            worker_group.workers[local_rank].global_rank: value
            for local_rank, value in result.return_values.items()
        }
        return _te.RunResult(state=_te.WorkerState.SUCCEEDED, return_values=values)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._health_check_server is not None:
            self._health_check_server.stop()
            self._health_check_server = None
        if self._pcontext is not None:
            self._runtime.before_stop()
            self._pcontext.close(death_sig, timeout)
