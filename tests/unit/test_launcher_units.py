"""kaitianrun's pure pieces: layout, selection rules, plans, logs specs, the kaitian rendezvous.

No workers are started here (the end-to-end tests do that); the rendezvous
test runs a real single-node c10d rendezvous.
"""

from __future__ import annotations

import os
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from support import REPO

from kaitian import _torch as te  # noqa: E402
from kaitian.devices.inventory import (  # noqa: E402
    Device,
    DeviceSelectionError,
    cpu_slots,
    parse_devices_flag,
    select,
)
from kaitian.devices.device import WorkerDevice  # noqa: E402
from kaitian.launcher.placement import Slot, lay_out  # noqa: E402
from kaitian.launcher.logs import build_logs_specs, line_prefixes  # noqa: E402
from kaitian.launcher.plan import PlanError, parse_cpu_quota, plan_workers  # noqa: E402
from kaitian.launcher.rendezvous import (  # noqa: E402
    KaitianRendezvousHandler,
    create_handler,
    exchange_inventory,
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


# --- layout ---------------------------------------------------------------------------


def test_layout_homogeneous_is_torchruns():
    inv = [[Slot(WorkerDevice("cpu", i, "cpu"), "default") for i in range(3)] for _ in range(2)]
    placements = lay_out(inv)
    for (node, local), p in placements.items():
        assert p.global_rank == node * 3 + local  # torchrun: node offset + local rank
        assert p.role_rank == p.global_rank and p.world_size == p.role_world_size == 6


def test_layout_groups_by_vendor_across_nodes():
    node0 = [Slot(WorkerDevice("cpu", 0, "cpu0"), "r"), Slot(WorkerDevice("cpu", 1, "cpu1"), "r")]
    node1 = [Slot(WorkerDevice("cpu", 0, "cpu0"), "r"), Slot(WorkerDevice("cuda", 0, "cuda"), "r"), Slot(WorkerDevice("cpu", 1, "cpu1"), "r")]
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
        ({"USE_MLU": "0,x"}, "USE_MLU='0,x' is malformed"),
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


# --- plans ------------------------------------------------------------------------------


def test_plan_nproc_auto_groups_and_quota():
    cpu4 = [Device("cpu", i, "c", cpus=(i,)) for i in range(4)]
    plans = plan_workers(nproc_auto=True, nproc_per_node=None, cpu_groups=2, cpu_quota=[0.5, 2.0],
                         env={}, devices=cpu4)
    assert [p.device.group for p in plans] == ["cpu0", "cpu0", "cpu1", "cpu1"]
    assert [p.cpu_quota for p in plans] == [0.5, 0.5, 2.0, 2.0]
    assert [p.cpus for p in plans] == [(0,), (1,), (2,), (3,)]
    assert all(p.device.explicit_group and p.omp_threads == 1 for p in plans)


def test_plan_nproc_per_node_keeps_torchrun_meaning():
    plans = plan_workers(nproc_auto=False, nproc_per_node=3, env={}, devices=HOST)
    assert [p.key for p in plans] == ["cuda:0", "cuda:1", "mlu:0"]
    plans = plan_workers(nproc_auto=False, nproc_per_node=3, env={"USE_CUDA": "-1", "USE_MLU": "-1"},
                         devices=HOST)
    assert [p.key for p in plans] == ["cpu:0", "cpu:1", "cpu:2"]
    assert all(p.cpus == () and p.omp_threads is None and not p.device.explicit_group for p in plans)


def test_plan_errors():
    cpu1 = [Device("cpu", 0, "c", cpus=(0,))]
    with pytest.raises(PlanError, match="--cpu-groups 2: only 1 CPU worker"):
        plan_workers(nproc_auto=True, nproc_per_node=None, cpu_groups=2, env={}, devices=cpu1)
    with pytest.raises(PlanError, match="2 values for 1 CPU group"):
        plan_workers(nproc_auto=True, nproc_per_node=None, cpu_quota=[1, 2], env={}, devices=cpu1)
    with pytest.raises(PlanError):
        parse_cpu_quota("0,1")
    with pytest.raises(PlanError):
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


def test_exchange_inventory_between_nodes():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    slots = {0: [Slot(WorkerDevice("cpu", 0, "cpu0"), "r")], 1: [Slot(WorkerDevice("cuda", 1, "cuda"), "r"), Slot(WorkerDevice("cpu", 0, "cpu"), "r")]}
    results = {}

    def node(rank):
        results[rank] = exchange_inventory(store, rank, 2, slots[rank])[1]

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results[0] == results[1] == [slots[0], slots[1]]
    # a second round on the same store never returns the first round's inventory
    slots[0] = [Slot(WorkerDevice("cpu", 1, "cpu1"), "r")]
    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert results[0][0] == [Slot(WorkerDevice("cpu", 1, "cpu1"), "r")]


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
    handler.local_slots = [Slot(WorkerDevice("cpu", 0, "cpu0"), "default"), Slot(WorkerDevice("cpu", 1, "cpu1"), "default")]
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert handler.inventories == [handler.local_slots]
        assert handler.get_run_id() == "unit" and handler.use_agent_store
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
    cuda = [d for d in discover(detail=True) if d.type == "cuda"]
    assert [d.key for d in cuda] == ["cuda:0", "cuda:1"]
    assert cuda[1].name == "NVIDIA H100 80GB HBM3" and cuda[1].memory_bytes == 81559 << 20
    assert cuda[1].bus_id == "0000:3b:00.0" and cuda[1].link == "PCIe5 x16"  # the kernel's form
    # CUDA_VISIBLE_DEVICES hides devices; the others keep their physical index
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cuda = [d for d in discover(detail=True) if d.type == "cuda"]
    assert [(d.key, d.bus_id) for d in cuda] == [("cuda:1", "0000:3b:00.0")]
    table = format_table(cuda)
    assert "79.6 GiB" in table and "PCIe5 x16" in table


def test_quota_mode_without_cgroups(tmp_path, monkeypatch):
    from kaitian.launcher.runtimes import cpu_limits

    monkeypatch.setattr(cpu_limits, "_CGROUP_CPU", str(tmp_path / "no-cgroup-here"))
    assert not cpu_limits.cgroups_writable()
    assert cpu_limits.quota_mode("auto") == "signal"
    with pytest.raises(cpu_limits.QuotaUnavailableError, match="not writable"):
        cpu_limits.quota_mode("cgroup")
