"""``--numa-binding``: the cores each worker is bound to, from its device's near cores and the CPU topology
(kaitian.devices.numa), on a made-up host: two sockets, NUMA nodes 0 (cores 0-3) and 1 (4-5) on socket 0,
node 2 (6-7) on socket 1; hyperthread pairs 0+2, 1+3, 4+5, 6+7; one L3 per node."""

from __future__ import annotations

import os

import pytest

from kaitian.devices.device import Device
from kaitian.devices.numa import numa_binding
from kaitian.errors import NodeWorkersError
from kaitian.launcher.workers import node_workers

SIBLINGS = {0: "0,2", 2: "0,2", 1: "1,3", 3: "1,3", 4: "4-5", 5: "4-5", 6: "6-7", 7: "6-7"}
L3 = {c: "0-3" for c in range(4)} | {4: "4-5", 5: "4-5", 6: "6-7", 7: "6-7"}
ALL = tuple(range(8))


@pytest.fixture
def cpu_root(tmp_path):
    for c in ALL:
        (tmp_path / f"cpu{c}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{c}" / "cache" / "index3").mkdir(parents=True)
        (tmp_path / f"cpu{c}" / "topology" / "physical_package_id").write_text(f"{0 if c < 6 else 1}\n")
        (tmp_path / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(SIBLINGS[c] + "\n")
        (tmp_path / f"cpu{c}" / "cache" / "index3" / "shared_cpu_list").write_text(L3[c] + "\n")
    return str(tmp_path)


# two GPUs on node 0, an MLU on node 1 (same socket), a GPU on node 2
DEVICES = [Device("cuda", 0, "g", cpus=(0, 1, 2, 3)), Device("cuda", 1, "g", cpus=(0, 1, 2, 3)),
           Device("mlu", 0, "m", cpus=(4, 5)), Device("cuda", 2, "g", cpus=(6, 7))]


@pytest.mark.parametrize("mode, expected", [
    ("node", [(0, 1, 2, 3), (0, 1, 2, 3), (4, 5), (6, 7)]),
    ("socket", [(0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 5), (6, 7)]),
    # node 0's physical cores (0+2, 1+3) split between its two GPUs, hyperthreads kept together
    ("exclusive", [(0, 2), (1, 3), (4, 5), (6, 7)]),
    # node 0 has one L3: both its GPUs get it (a different complex only where there are enough)
    ("core-complex", [(0, 1, 2, 3), (0, 1, 2, 3), (4, 5), (6, 7)]),
])
def test_each_mode_binds_by_the_workers_own_device_not_its_local_rank(cpu_root, mode, expected):
    assert numa_binding(DEVICES, mode, allowed=ALL, cpu_root=cpu_root) == expected


def test_core_complexes_are_dealt_out_and_nothing_outside_the_allowed_cores_is_chosen(cpu_root, tmp_path):
    for c in range(4):  # node 0 with two L3 groups
        (tmp_path / f"cpu{c}" / "cache" / "index3" / "shared_cpu_list").write_text(SIBLINGS[c] + "\n")
    assert numa_binding(DEVICES[:2], "core-complex", allowed=ALL, cpu_root=cpu_root) == [(0, 2), (1, 3)]
    allowed = (0, 1, 2, 3, 6)
    assert numa_binding([DEVICES[0], DEVICES[3]], "node", allowed=allowed, cpu_root=cpu_root) == [(0, 1, 2, 3), (6,)]
    assert numa_binding(DEVICES[:1], "socket", allowed=allowed, cpu_root=cpu_root) == [(0, 1, 2, 3)]


def test_workers_sharing_one_device_split_its_node_and_too_many_is_an_error(cpu_root):
    gpu = DEVICES[0]
    assert numa_binding([gpu, gpu], "exclusive", allowed=ALL, cpu_root=cpu_root) == [(0, 2), (1, 3)]
    with pytest.raises(NodeWorkersError, match="3 workers share the 2 physical cores near cuda:0"):
        numa_binding([gpu, gpu, gpu], "exclusive", allowed=ALL, cpu_root=cpu_root)


def test_a_device_whose_near_cores_are_unknown_is_an_error_naming_it(cpu_root):
    with pytest.raises(NodeWorkersError, match="the host cores near mlu:3 are unknown"):
        numa_binding([DEVICES[0], Device("mlu", 3, "m")], "node", allowed=ALL, cpu_root=cpu_root)
    with pytest.raises(NodeWorkersError, match="near cuda:2 are unknown"):  # none of them allowed
        numa_binding([DEVICES[3]], "node", allowed=(0, 1), cpu_root=cpu_root)


def test_node_workers_binds_accelerators_keeps_cpu_slots_and_refuses_plain_cpu_workers():
    slot = Device("cpu", 0, "c", cpus=tuple(sorted(os.sched_getaffinity(0))))
    gpu = Device("cuda", 0, "g", cpus=slot.cpus)
    node = node_workers(nproc_auto=True, nproc_per_node=None, numa_binding="node", devices=[gpu, slot],
                        env={"USE_CUDA": "0", "USE_CPU": "0"})
    assert [(w.device.key, w.cpus) for w in node.workers] == [("cuda:0", gpu.cpus), ("cpu:0", slot.cpus)]
    unbound = node_workers(nproc_auto=True, nproc_per_node=None, devices=[gpu, slot],
                           env={"USE_CUDA": "0", "USE_CPU": "0"})
    assert [w.cpus for w in unbound.workers] == [(), slot.cpus]
    with pytest.raises(NodeWorkersError, match="CPU workers are bound as CPU slots"):
        node_workers(nproc_auto=False, nproc_per_node=2, numa_binding="node", devices=[slot], env={})
