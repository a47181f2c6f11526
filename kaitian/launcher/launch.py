"""``launch_agent``: kaitian's counterpart of ``torch.distributed.launcher.api.launch_agent``.

Torch's function hard-codes ``LocalElasticAgent``; this one builds a
:class:`~kaitian.launcher.agent.KaitianAgent` from torch's config and the
launch request, and otherwise keeps torch's steps: rendezvous handler from the
registry, agent run, ``ChildFailedError`` for failed workers, ``SignalException``
passed through without closing the rendezvous, and ``finally`` shutting down
the rendezvous, the runtime and the monitor. Every difference from torch's is
listed in ``kaitian._torch.LAUNCH_AGENT_DIFFERENCES``; a unit test fails, on
every torch CI runs, when torch's takes something the list does not account for.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Callable, Dict, List, Union

from kaitian import _torch as _te
from kaitian.launcher.agent import KaitianAgent
from kaitian.launcher.rendezvous import KaitianRendezvousHandler
from kaitian.launcher.request import LaunchRequest

__all__ = ["launch_agent"]

logger = logging.getLogger(__name__)


def _make_monitor(out_dir: str, cpu_quotas: Dict[str, float]) -> Any:
    try:
        from kaitian.monitor.agent import AgentMonitor
    except ImportError as e:
        logger.warning("--monitor: kaitian.monitor.agent is not available (%s); not monitoring", e)
        return None
    return AgentMonitor(out_dir, cpu_quotas=cpu_quotas)


def launch_agent(
    config: "_te.LaunchConfig",
    entrypoint: Union[Callable, str, None],
    args: List[Any],
    kaitian: LaunchRequest,
) -> Dict[int, Any]:
    """Runs this node's agent until the job succeeds, fails or is signalled.

    Args:
        config: torchrun's launch config (from ``config_from_args``).
        entrypoint: the worker command or function.
        args: its arguments.
        kaitian: kaitian's additions.

    Returns:
        Worker return values by global rank.

    Raises:
        ChildFailedError: workers failed after all restarts (``@record`` prints the root cause).
        SignalException: the agent was asked to stop (SIGINT, SIGTERM, ...).
    """
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        logger.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    entrypoint_name = _te.get_entrypoint_name(entrypoint, args)

    rdzv_parameters = _te.RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _te.get_addr_and_port(rdzv_parameters)
    signals = _te.launch_option(config, "signals_to_handle")
    if signals is not None:  # torch 2.10+, whose torchrun sets it too
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals

    rdzv_handler = _te.get_rendezvous_handler(rdzv_parameters)
    if not isinstance(rdzv_handler, KaitianRendezvousHandler):
        rdzv_handler = KaitianRendezvousHandler(rdzv_handler, name=rdzv_handler.get_backend())
    rdzv_handler.order_nodes = False  # the agent places every worker (kaitian.launcher.rendezvous)
    spec = _te.call_supported(
        _te.WorkerSpec,
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=_te.launch_option(config, "event_log_handler"),
        duplicate_stdout_filters=_te.launch_option(config, "duplicate_stdout_filters"),
        duplicate_stderr_filters=_te.launch_option(config, "duplicate_stderr_filters"),
        virtual_local_rank=_te.launch_option(config, "virtual_local_rank"),
    )

    runtime = kaitian.runtime
    monitor = None
    shutdown_rdzv = True
    try:
        if kaitian.monitor_dir:
            monitor = _make_monitor(kaitian.monitor_dir, dict(kaitian.node.cpu_quotas))
            if monitor is not None:
                monitor.start()
        agent = KaitianAgent(spec, config, kaitian, monitor)
        _te.metrics.initialize_metrics(_te.metrics.MetricsConfig(config.metrics_cfg))
        try:
            result = agent.run()
            _te.events.record(agent.get_event_succeeded(), _te.launch_option(config, "event_log_handler", "null"))
        except _te.SignalException:
            # As torch: a signalled agent leaves the rendezvous open for the others.
            shutdown_rdzv = False
            _te.events.record(agent.get_event_failed(), _te.launch_option(config, "event_log_handler", "null"))
            raise
        except Exception:
            _te.events.record(agent.get_event_failed(), _te.launch_option(config, "event_log_handler", "null"))
            raise
        if result is None:  # rendezvous closed gracefully
            return {}
        if result.is_failed():
            raise _te.ChildFailedError(name=entrypoint_name, failures=result.failures)
        return result.return_values
    finally:
        try:
            if shutdown_rdzv:
                spec.rdzv_handler.shutdown()
        finally:
            try:
                runtime.shutdown()
            finally:
                if monitor is not None:
                    try:
                        monitor.stop()
                        print(monitor.report(), flush=True)
                    except Exception:
                        logger.warning("--monitor: could not write the report", exc_info=True)
