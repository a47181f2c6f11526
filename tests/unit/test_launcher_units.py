"""kaitianrun's pure pieces: layout, selection rules, plans, logs specs, the kaitian rendezvous.

No workers are started here (the end-to-end tests do that) but one sleeping
process; the rendezvous test runs a real single-node c10d rendezvous.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from support import REPO, alive

from kaitian import _torch as te  # noqa: E402
from kaitian.devices.inventory import (  # noqa: E402
    Device,
    DeviceSelectionError,
    cpu_slots,
    parse_devices_flag,
    select,
)
from kaitian.devices.device import WorkerDevice  # noqa: E402
from kaitian.launcher.placement import NodeInventory, lay_out  # noqa: E402
from kaitian.launcher.logs import build_logs_specs, line_prefixes  # noqa: E402
from kaitian.launcher.workers import NodeWorkersError, parse_cpu_quota, node_workers  # noqa: E402
from kaitian.errors import VersionMismatchError  # noqa: E402
from kaitian.launcher.rendezvous import (  # noqa: E402
    KaitianRendezvousHandler,
    agree_on_placement,
    create_handler,
)

HOST = [
    Device("cuda", 0, "A"),
    Device("cuda", 1, "A"),
    Device("mlu", 0, "M"),
    Device("cpu", 0, "cores", cpus=(0,)),
    Device("cpu", 1, "cores", cpus=(1,)),
]


def _keys(devices):
    return [d.key for d in devices]


def _inv(*devices, role="r", version="1.0", protocol=1, host="h"):
    """A node's inventory of ``(type, index, group)`` devices."""
    return NodeInventory(role, tuple(WorkerDevice(*d) for d in devices), host, version, protocol)


# --- layout ---------------------------------------------------------------------------


def test_layout_homogeneous_is_torchruns():
    placements = lay_out([_inv(*[("cpu", i, "cpu") for i in range(3)], role="default") for _ in range(2)])
    for (node, local), p in placements.items():
        assert p.global_rank == node * 3 + local  # torchrun: node offset + local rank
        assert p.role_rank == p.global_rank and p.world_size == p.role_world_size == 6


def test_layout_groups_by_vendor_across_nodes():
    node0 = _inv(("cpu", 0, "cpu0"), ("cpu", 1, "cpu1"))
    node1 = _inv(("cpu", 0, "cpu0"), ("cuda", 0, "cuda"), ("cpu", 1, "cpu1"))
    p = lay_out([node0, node1])
    order = sorted(p, key=lambda k: p[k].global_rank)
    assert order == [(1, 1), (0, 0), (1, 0), (0, 1), (1, 2)]  # cuda, then cpu0, then cpu1
    assert {x.world_size for x in p.values()} == {5}


# --- selection ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env,flag,expected",
    [
        ({}, None, ["cuda:0", "cuda:1", "mlu:0"]),  # accelerators only when USE_CPU is unset
        ({"USE_CPU": "0"}, None, ["cuda:0", "cuda:1", "mlu:0", "cpu:0"]),
        ({"USE_CUDA": "-1", "USE_MLU": "-1"}, None, ["cpu:0", "cpu:1"]),  # nothing else -> CPU slots
        ({"USE_CUDA": "1", "USE_MLU": "-1"}, None, ["cuda:1"]),
        ({"USE_CUDA": "1,0"}, None, ["cuda:1", "cuda:0", "mlu:0"]),
        ({"USE_CUDA": "1"}, "cuda:0,mlu:-1,cpu", ["cuda:0", "cpu:0", "cpu:1"]),  # --devices wins
    ],
)
def test_select_rules(env, flag, expected):
    chosen = select(HOST, env=env, flag=parse_devices_flag(flag) if flag else None)
    assert _keys(chosen) == expected


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"USE_CUDA": "2"}, "USE_CUDA=2: no such device 2"),
        ({"USE_MLU": "0,x"}, "USE_MLU='0,x' is malformed: use all, -1 (none), or indices like 0,1"),
        ({"USE_CUDA": "0,0"}, "listed twice"),
        ({"USE_CUDA": "-1", "USE_MLU": "-1", "USE_CPU": "-1"}, "no device selected"),
    ],
)
def test_select_errors_list_the_inventory(env, needle):
    with pytest.raises(DeviceSelectionError) as err:
        select(HOST, env=env)
    assert needle in str(err.value)
    assert "this host has: cuda:0, cuda:1, mlu:0, cpu:0, cpu:1" in str(err.value)


def test_devices_flag_errors():
    with pytest.raises(DeviceSelectionError, match="unknown device type 'gpu'"):
        parse_devices_flag("gpu:0")
    with pytest.raises(DeviceSelectionError, match="is not <type>:<index>"):
        parse_devices_flag("cuda:first")


def test_cpu_slots_cover_the_cores_once():
    cores = sorted(os.sched_getaffinity(0))
    for n in range(1, len(cores) + 1):
        slots = cpu_slots(n)
        assert len(slots) == n and [s.index for s in slots] == list(range(n))
        assert sorted(c for s in slots for c in s.cpus) == cores
    with pytest.raises(DeviceSelectionError, match="usable cores"):
        cpu_slots(len(cores) + 1)


# --- node workers -----------------------------------------------------------------------


def test_node_workers_nproc_auto_groups_and_quota():
    cpu4 = [Device("cpu", i, "c", cpus=(i,)) for i in range(4)]
    node = node_workers(nproc_auto=True, nproc_per_node=None, cpu_groups=2, cpu_quota=[0.5, 2.0],
                     env={}, devices=cpu4)
    assert [w.device.group for w in node.workers] == ["cpu0", "cpu0", "cpu1", "cpu1"]
    assert [w.local_rank for w in node.workers] == [0, 1, 2, 3]
    assert node.cpu_quotas == {"cpu0": 0.5, "cpu1": 2.0} and node.hide_other_vendors
    assert [w.cpus for w in node.workers] == [(0,), (1,), (2,), (3,)]
    assert all(w.device.explicit_group for w in node.workers)
    one = node_workers(nproc_auto=True, nproc_per_node=None, cpu_quota=[1.5], env={}, devices=cpu4)
    assert one.cpu_quotas == {"cpu": 1.5}  # one value, the one group of every CPU worker


def test_node_workers_nproc_per_node_keep_torchrun_meaning():
    node = node_workers(nproc_auto=False, nproc_per_node=3, env={}, devices=HOST)
    assert [w.device.key for w in node.workers] == ["cuda:0", "cuda:1", "mlu:0"]
    assert not node.hide_other_vendors
    node = node_workers(nproc_auto=False, nproc_per_node=3, env={"USE_CUDA": "-1", "USE_MLU": "-1"},
                     devices=HOST)
    assert [w.device.key for w in node.workers] == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(w.cpus == () and not w.device.explicit_group for w in node.workers)


def test_node_workers_errors():
    cpu1 = [Device("cpu", 0, "c", cpus=(0,))]
    with pytest.raises(NodeWorkersError, match="--cpu-groups 2: only 1 CPU worker"):
        node_workers(nproc_auto=True, nproc_per_node=None, cpu_groups=2, env={}, devices=cpu1)
    with pytest.raises(NodeWorkersError, match="2 values for 1 CPU group"):
        node_workers(nproc_auto=True, nproc_per_node=None, cpu_quota=[1, 2], env={}, devices=cpu1)
    with pytest.raises(NodeWorkersError):
        parse_cpu_quota("0,1")
    with pytest.raises(NodeWorkersError):
        parse_cpu_quota("fast")


# --- logs ---------------------------------------------------------------------------------


def test_logs_specs_tee_what_is_not_redirected(tmp_path):
    specs = build_logs_specs(log_dir=str(tmp_path), redirects="0:1", tee="0", local_ranks_filter={1}, nproc=2)
    envs = {0: {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"},
            1: {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0"}}
    dest = specs.reify(envs)
    assert dest.stdouts[0].endswith("0/stdout.log") and dest.stderrs[0].endswith("0/stderr.log")
    assert 0 not in dest.tee_stdouts  # redirected: file only; filtered out of the console anyway
    assert dest.tee_stdouts[1].endswith("1/stdout.log")  # not redirected: tee'd -> prefixed
    assert envs[1]["TORCHELASTIC_ERROR_FILE"].endswith("1/error.json")
    assert line_prefixes(None, {0: {"rank": 3, "group": "cpu1"}}) == {0: "[3|cpu1]:"}
    assert line_prefixes("<${vendor}${local_rank}>", {1: {"vendor": "cuda", "local_rank": 1}}) == {1: "<cuda1>"}


# --- rendezvous -------------------------------------------------------------------------------


class _CountingStore:
    """A store that counts the requests each node makes (to check O(nodes) traffic)."""

    def __init__(self, store):
        self._store, self.calls = store, 0

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def _agree(store, inventories, serve=None):
    """Runs one round with one thread per node; returns (plans or errors by rank, requests by rank)."""
    results, calls = {}, {}

    def node(rank):
        mine = _CountingStore(store)
        try:
            results[rank] = agree_on_placement(mine, rank, len(inventories), inventories[rank],
                                               serve if rank == 0 else None)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[rank] = e
        calls[rank] = mine.calls

    threads = [threading.Thread(target=node, args=(r,)) for r in range(len(inventories))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return results, calls


def test_placement_decided_once_and_published():
    """Node 0 lays out and publishes; each node makes a constant number of store requests."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    nodes = [_inv(("cpu", 0, "cpu0")),
             _inv(("cuda", 1, "cuda"), ("cpu", 0, "cpu")),
             _inv(("cpu", 0, "cpu0"), ("cpu", 1, "cpu1"))]
    results, calls = _agree(store, nodes, serve=lambda: ("10.0.0.1", 4242))
    expected = lay_out(nodes)
    for rank, share in results.items():
        assert [p for p in share.placements] == [expected[(rank, lr)] for lr in range(len(nodes[rank].devices))]
        assert share.worker_store == ("10.0.0.1", 4242) and share.epoch == 1
    assert max(calls.values()) <= 4, calls  # add, set, (multi_get, multi_set on node 0), get
    # a second round on the same store never serves the first round's inventory
    nodes[0] = _inv(("cuda", 0, "cuda"))
    results, _ = _agree(store, nodes)
    assert results[0].placements[0].global_rank == 0 and results[1].placements[0].global_rank == 1
    assert results[0].epoch == 2 and results[0].worker_store is None


def test_version_mismatch_fails_every_node_in_one_line():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    served = []
    nodes = [_inv(("cpu", 0, "cpu"), host="a"), _inv(("cpu", 0, "cpu"), host="b"),
             _inv(("cpu", 0, "cpu"), version="0.9", host="c")]
    results, _ = _agree(store, nodes, serve=lambda: served.append(1))
    for rank in range(3):
        assert isinstance(results[rank], VersionMismatchError), results[rank]
        assert str(results[rank]) == str(results[0]) and "\n" not in str(results[0])
    assert "node 0 (a) has kaitian 1.0" in str(results[0]) and "node 2 (c) has kaitian 0.9" in str(results[0])
    assert not served  # nothing is started for a round that cannot run
    protocol = [_inv(("cpu", 0, "cpu")), _inv(("cpu", 0, "cpu"), protocol=2)]
    results, _ = _agree(store, protocol)
    assert all("bridge protocol 2" in str(results[r]) for r in (0, 1))


class _Round:
    """A stand-in inner rendezvous: returns a fixed rank and (possibly stale) store address."""

    use_agent_store = True

    def __init__(self, store, rank, world, addr, port):
        self._info = te.RendezvousInfo(store, rank, world, te.RendezvousStoreInfo(addr, port))

    def next_rendezvous(self):
        return self._info


def test_plain_torchrun_nodes_ordered_by_vendor_and_store_address_fresh():
    """torchrun --rdzv-backend kaitian: the CUDA node gets rank 0; every node gets node 0's address."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    vendors = {0: "cpu", 1: "cuda", 2: "mlu"}
    stale = {0: ("h0", 1234), 1: ("dead-host", 999), 2: ("dead-host", 999)}  # torch's cache on nodes 1, 2
    results = {}

    def node(rank):
        handler = KaitianRendezvousHandler(_Round(store, rank, 3, *stale[rank]), node_vendor=lambda: vendors[rank])
        results[rank] = handler.next_rendezvous()

    threads = [threading.Thread(target=node, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert {r: results[r].rank for r in range(3)} == {0: 2, 1: 0, 2: 1}  # cuda, mlu, cpu
    for r in range(3):
        info = results[r].bootstrap_store_info
        assert (info.master_addr, info.master_port) == ("h0", 1234)


def test_entry_point_matches_torch_loader():
    """pyproject's torchrun.handlers entry point loads the way torch loads it."""
    from importlib.metadata import EntryPoint

    text = open(os.path.join(REPO, "pyproject.toml")).read()
    section = text.split('[project.entry-points."torchrun.handlers"]', 1)[1]
    value = section.split("kaitian", 1)[1].split('"')[1]
    entry = EntryPoint(name="kaitian", value=value, group="torchrun.handlers")
    assert entry.load()() is create_handler  # torch: registry.register(name, get_handler())
    assert te.rendezvous_handler_registry._registry["kaitian"] is create_handler


def test_kaitian_rendezvous_single_node():
    params = te.RendezvousParameters(
        backend="kaitian", endpoint="127.0.0.1:0", run_id="unit", min_nodes=1, max_nodes=1,
        join_timeout=30, last_call_timeout=1,
    )
    handler = te.get_rendezvous_handler(params)
    assert isinstance(handler, KaitianRendezvousHandler) and handler.get_backend() == "kaitian"
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert handler.last_info is info
        assert handler.get_run_id() == "unit"
        # as torch's own c10d handler answers (True from the release that shares
        # the agent's store with the workers; torch 2.4's never does)
        assert handler.use_agent_store is handler._inner.use_agent_store
    finally:
        handler.shutdown()


def test_cuda_discovery_from_nvidia_smi(tmp_path, monkeypatch):
    """nvidia-smi's CSV -> Devices (a stand-in nvidia-smi on PATH prints what the real one prints)."""
    from kaitian.devices.inventory import discover, format_table

    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        "echo '0, NVIDIA H100 80GB HBM3, 81559, 00000000:19:00.0, 5, 16'\n"
        "echo '1, NVIDIA H100 80GB HBM3, 81559, 00000000:3B:00.0, 5, 16'\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda = [d for d in discover() if d.type == "cuda"]
    assert [d.key for d in cuda] == ["cuda:0", "cuda:1"]
    assert cuda[1].name == "NVIDIA H100 80GB HBM3" and cuda[1].memory_bytes == 81559 << 20
    assert cuda[1].bus_id == "0000:3b:00.0" and cuda[1].link == "PCIe5 x16"  # the kernel's form
    # CUDA_VISIBLE_DEVICES hides devices; the others keep their physical index
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cuda = [d for d in discover() if d.type == "cuda"]
    assert [(d.key, d.bus_id) for d in cuda] == [("cuda:1", "0000:3b:00.0")]
    table = format_table(cuda)
    assert "79.6 GiB" in table and "PCIe5 x16" in table


def test_a_signal_while_local_workers_are_pinned_stops_them(tmp_path, monkeypatch):
    """Ctrl-C after torch started the workers but before the runtime returned
    their context (pinning them): the agent never gets the context, so the
    runtime must close it, or the workers outlive the agent's shutdown."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from kaitian.launcher.workers import LocalWorker
    from kaitian.launcher.runtimes import local
    from kaitian.launcher.runtimes.base import RunContext, WorkerStart

    pinned = []

    def pin_then_signal(pid, cpus):
        pinned.append(pid)
        raise SignalException("got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr(local, "pin", pin_then_signal)
    worker = LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,))
    runtime = local.LocalRuntime(RunContext("t", str(tmp_path), None, str(tmp_path)))
    with pytest.raises(SignalException):
        runtime.start(WorkerStart(
            name="sleeper", entrypoint="sleep", args={0: ("600",)}, envs={0: {}},
            logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), workers={0: worker},
        ))
    assert len(pinned) == 1
    deadline = time.monotonic() + 10
    while alive(pinned[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pinned[0])


def test_quota_mode_without_cgroups(tmp_path, monkeypatch):
    from kaitian.launcher.runtimes import cpu_limits

    monkeypatch.setattr(cpu_limits, "_CGROUP_CPU", str(tmp_path / "no-cgroup-here"))
    assert not cpu_limits.cgroups_writable()
    assert cpu_limits.quota_mode("auto") == "signal"
    with pytest.raises(cpu_limits.QuotaUnavailableError, match="not writable"):
        cpu_limits.quota_mode("cgroup")


def test_a_cgroup_quota_is_exact_below_a_tenth_of_a_core(tmp_path, monkeypatch):
    """10 ms periods, longer only where the quota would fall below the kernel's 1 ms: --cpu-quota 1,0.05
    (kaitian bench hetero --gap 20) gives the slow group 0.05 cores, not the 0.1 a 1 ms floor would."""
    from kaitian.launcher.runtimes import cpu_limits

    for cores in (4, 1, 0.3, 0.1, 0.05, 0.0333, 0.001):
        period, quota = cpu_limits.cfs_limits(cores)
        assert period >= cpu_limits.CPU_PERIOD_US and quota >= 1000
        assert quota / period == pytest.approx(cores, rel=1e-3)
    assert cpu_limits.cfs_limits(0.3) == (10_000, 3_000) and cpu_limits.cfs_limits(0.05) == (20_000, 1_000)
    assert cpu_limits.cfs_limits(0.05, 100_000) == (100_000, 5_000)
    monkeypatch.setattr(cpu_limits, "cgroup_root", lambda: str(tmp_path))
    cpu_limits.CgroupQuota("run.1").set_quota("cpu1", 0.05)
    written = {name: (tmp_path / "run.1" / "cpu1" / f"cpu.cfs_{name}_us").read_text() for name in ("period", "quota")}
    assert written == {"period": "20000", "quota": "1000"}
    assert parse_cpu_quota("1,0.05") == [1.0, 0.05]
    with pytest.raises(NodeWorkersError, match="the smallest quota is 0.001 cores"):
        parse_cpu_quota("1,0.0005")


def test_signal_quota_holds_its_fraction_when_the_throttling_thread_wakes_up_late(monkeypatch):
    """--cpu-quota in signal mode: every wait of the duty cycle ends 3 ms late (the
    agent's thread on a busy machine); the worker still runs 10 % of the time, not
    2 + 3 ms of every 20 + 3. On a virtual clock, so the machine's load cannot move it."""
    import signal
    from kaitian.launcher.runtimes import cpu_limits

    now = [0.0]
    events = []
    monkeypatch.setattr(cpu_limits.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(cpu_limits.DutyCycle, "_signal", staticmethod(lambda pid, sig: events.append((now[0], sig))))

    class LateStop(threading.Event):
        def wait(self, timeout=None):
            now[0] += timeout + 0.003
            if now[0] >= 2.0:
                self.set()
            return self.is_set()

    duty = cpu_limits.DutyCycle(period=0.02)
    duty._stop = LateStop()
    duty._targets[12345] = 0.1
    duty._loop()  # here, until the virtual clock reaches 2 s
    running, since = 0.0, None
    for at, sig in events:
        if sig == signal.SIGCONT and since is None:
            since = at
        elif sig == signal.SIGSTOP and since is not None:
            running, since = running + at - since, None
    fraction = running / now[0]
    assert 0.09 < fraction < 0.11, f"ran {fraction:.3f} of the time under a 0.1 quota"


# --- PET_* forms of kaitian's flags ------------------------------------------------------------

_PET_VALUES = {"nproc_auto": ("1", True), "devices": ("cuda:0,cpu", "cuda:0,cpu"), "cpu_slots": ("3", 3),
               "cpu_groups": ("2", 2), "cpu_quota": ("0.5,1", "0.5,1"), "runtime": ("docker", "docker"),
               "image": ("cuda=a:1,mlu=b:2", ["cuda=a:1", "mlu=b:2"]), "keep_containers": ("1", True),
               "volume": ("/a:/b,/c:/d:ro", ["/a:/b", "/c:/d:ro"]), "shm_size": ("8g", "8g"),
               "container_user": ("1000:1000", "1000:1000"), "monitor": ("/tmp/mon", "/tmp/mon"),
               "on_failure": ("continue", "continue"), "dry_run": ("1", True)}


def test_every_kaitian_flag_has_a_pet_form(monkeypatch):
    """As torchrun's flags: PET_<FLAG> sets each kaitian flag; the command line wins over it."""
    from kaitian.launcher.cli import build_parser

    group = next(g for g in build_parser()._action_groups if g.title == "kaitian")
    dests = {a.dest for a in group._group_actions}
    assert dests == set(_PET_VALUES), "a kaitian flag without a PET_ test value"
    for dest, (raw, _) in _PET_VALUES.items():
        monkeypatch.setenv(f"PET_{dest.upper()}", raw)
    args = build_parser().parse_args(["train.py"])
    for dest, (_, want) in _PET_VALUES.items():
        assert getattr(args, dest) == want, dest
    args = build_parser().parse_args(["--cpu-groups", "1", "--image", "cpu=c", "train.py"])
    assert args.cpu_groups == 1 and args.image == ["cpu=c"]  # flags replace the variables


def test_teardown_signals_only_known_host_processes():
    """An unknown pid (-1) must never reach kill(2): kill(-1) signals every process
    the agent may signal, killpg(1) is kill(-1) too, and 0 is the agent's own group."""
    from kaitian.launcher.agent import _signal_each

    sent = []
    _signal_each(lambda i, sig: sent.append(i), [4242, -1, 0, 1, 4243], 9)
    assert sent == [4242, 4243]


def test_docker_worker_pids_are_host_pids_or_unknown():
    """Before the Engine reports a worker's host pid, its pid is unknown (-1), never
    its pid inside the container, which names another process on the host."""
    from types import SimpleNamespace

    from kaitian.launcher.runtimes.docker.exec import DockerExecContext

    context = DockerExecContext.__new__(DockerExecContext)
    context._execs = {0: SimpleNamespace(host_pid=None, container_pid=lambda wait=0: 7),
                      1: SimpleNamespace(host_pid=31337, container_pid=lambda wait=0: 8)}
    assert context.pids() == {0: -1, 1: 31337}


def test_kaitians_launch_agent_accounts_for_everything_torchs_takes(monkeypatch):
    """kaitian's launch_agent is torch's but for the differences listed in kaitian/_torch.py;
    a torch whose launch_agent takes more (a parameter, a LaunchConfig field) fails here."""
    from dataclasses import make_dataclass

    from torch.distributed.launcher import api

    assert te.launch_agent_drift() == []
    assert te.LAUNCH_AGENT_DIFFERENCES
    monkeypatch.setattr(api, "launch_agent", lambda config, entrypoint, args, tracer=None: None)
    monkeypatch.setattr(api, "LaunchConfig", make_dataclass("LaunchConfig", ["min_nodes", "topology"]))
    assert te.launch_agent_drift() == ["launch_agent(tracer=...)", "LaunchConfig.topology"]


def test_a_stop_signal_swallowed_by_an_except_exception_is_raised_again():
    """torch's handler raises the signal as an ``Exception``; code that tolerates errors swallows it."""
    from kaitian.launcher.stop_signal import STOP_SIGNALS, StopSignal

    raised = []

    def torchs(signum, frame):
        raised.append(signum)
        raise te.SignalException("stop", sigval=signal.Signals(signum))

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    signal.signal(signal.SIGTERM, torchs)
    try:
        stop = StopSignal()
        stop.hold()
        held = signal.getsignal(signal.SIGTERM)
        stop.hold()  # a second start: not wrapped again
        assert signal.getsignal(signal.SIGTERM) is held
        stop.raise_received()  # none yet
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # (the handler runs here, and raises)
        except Exception:  # noqa: BLE001 (what is tested: an error path that swallows it)
            pass
        assert raised == [signal.SIGTERM]
        with pytest.raises(te.SignalException) as again:
            stop.raise_received()
        assert again.value.sigval == signal.SIGTERM
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_stale_cgroup_its_agent_removes_meanwhile_does_not_stop_a_new_job(tmp_path, monkeypatch):
    """Two jobs on one machine: a new agent collects the cgroup of one whose agent just exited while
    that agent still removes it; the directory vanishes between the scan and its listing."""
    from kaitian.launcher.runtimes import cpu_limits

    gone = tmp_path / "none.999999999"  # no such pid: its agent is gone
    (gone / "cpu0").mkdir(parents=True)
    (tmp_path / "none.1").mkdir()  # pid 1 lives: kept
    monkeypatch.setattr(cpu_limits, "cgroup_root", lambda: str(tmp_path))
    real_listdir = os.listdir

    def listdir(path):
        if path == str(gone):  # its own agent's shutdown wins the race
            (gone / "cpu0").rmdir()
            gone.rmdir()
        return real_listdir(path)

    monkeypatch.setattr(cpu_limits.os, "listdir", listdir)
    assert cpu_limits.collect_stale_cgroups() == []
    assert sorted(real_listdir(tmp_path)) == ["none.1"]
