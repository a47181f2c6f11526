"""Containers get exactly the planned physical devices, numbered as the container
sees them: the planned container specs and worker environments for 1, 2 and
8-GPU hosts (by UUID and by index, with the host's CUDA_VISIBLE_DEVICES, with
--virtual-local-rank) and for MLU device nodes. Each worker's environment is
checked the way the worker reads it (kaitian.devices.visible.torch_ordinal).
No engine needed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kaitian.devices.device import WorkerDevice
from kaitian.devices.visible import torch_ordinal, worker_visibility
from kaitian.errors import DeviceSelectionError
from kaitian.settings import Settings
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.runtimes.base import RunContext
from kaitian.launcher.runtimes.docker.start import AgentIdentity, DockerHost
from kaitian.launcher.runtimes.docker.options import DockerOptions
from kaitian.launcher.runtimes.docker.start import container_spec, exec_spec

AGENT = AgentIdentity(host="node0", pid=4242, start="1")
HOST = DockerHost(RunContext("r", "/run", None, "/w"), AGENT, "1000:1000")
# An 8-GPU host as NVML numbers it (physical index -> UUID).
UUIDS8 = {i: f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(8)}
MLU_NODES = ["/dev/cambricon_ctl"] + [f"/dev/cambricon_dev{i}" for i in range(4)] + \
            [f"/dev/cambricon_ipcm{i}" for i in range(4)]


def _container(indices, kind="cuda", uuids=None, nodes=()):
    workers = [LocalWorker(r, WorkerDevice(kind, i, kind, (uuids or {}).get(i))) for r, i in enumerate(indices)]
    container = container_spec(kind, workers, replace(HOST, device_nodes=tuple(nodes)), DockerOptions())
    return container, workers


def _env(container, worker, agent_env=None, **visibility):
    """The worker's environment in the container, as the docker runtime builds it: the agent's
    (which names its physical device) under what it sees of the container's devices."""
    env = {**Settings.for_device(worker.device).to_env(), **(agent_env or {}),
           **worker_visibility(worker.device, container=container.devices, **visibility)}
    return exec_spec(worker, container, ("python",), env, HOST).env


def _lands_on(container, worker, agent_env=None, **visibility):
    """The container's torch ordinal the worker computes on, and which physical device that is."""
    env = _env(container, worker, agent_env, **visibility)
    device = Settings.from_env(env).device
    ordinal = torch_ordinal(device, "CUDA_VISIBLE_DEVICES" if device.type == "cuda" else "MLU_VISIBLE_DEVICES", env)
    container_order = sorted(container.devices.index_map, key=container.devices.index_map.get)
    visible = env.get("KAITIAN_VISIBLE_INDICES", "").split(",")
    return ordinal, int(visible[ordinal]) if visible != [""] else container_order[ordinal]


def _requested(container):
    (request,) = container.create_kwargs()["device_requests"]
    assert request["driver"] == "nvidia" and request["capabilities"] == [["gpu"]]
    return request["device_ids"]


def test_one_gpu_host():
    container, (w,) = _container([0], uuids=UUIDS8)
    assert _requested(container) == [UUIDS8[0]]
    assert _lands_on(container, w) == (0, 0)
    assert _env(container, w)["KAITIAN_DEVICE_INDEX"] == "0"


def test_two_gpu_host_second_gpu_only():
    container, (w,) = _container([1], uuids=UUIDS8)
    assert _requested(container) == [UUIDS8[1]]
    env = _env(container, w)
    assert env["CUDA_VISIBLE_DEVICES"] == UUIDS8[1] and env["KAITIAN_VISIBLE_INDICES"] == "1"
    assert _lands_on(container, w) == (0, 1)  # the container's cuda:0 is the host's GPU 1


def test_eight_gpu_host_use_cuda_1_3_lands_each_worker_on_its_gpu():
    """USE_CUDA=1,3: the container holds exactly GPUs 1 and 3; the worker on GPU 3
    computes on the container's cuda:1 (it used to ask for cuda:3)."""
    container, workers = _container([1, 3], uuids=UUIDS8)
    assert _requested(container) == [UUIDS8[1], UUIDS8[3]]
    assert [_lands_on(container, w) for w in workers] == [(0, 1), (1, 3)]


def test_eight_gpu_host_all_gpus_whatever_the_rank_order():
    container, workers = _container([7, 6, 5, 4, 3, 2, 1, 0], uuids=UUIDS8)
    assert _requested(container) == [UUIDS8[i] for i in range(8)]
    assert [_lands_on(container, w) for w in workers] == [(i, i) for i in (7, 6, 5, 4, 3, 2, 1, 0)]


def test_without_uuids_gpus_are_requested_by_index_and_renumbered_in_bus_order():
    container, workers = _container([5, 2])
    assert _requested(container) == ["2", "5"]
    env = _env(container, workers[0])
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert [_lands_on(container, w) for w in workers] == [(1, 5), (0, 2)]


def test_host_cuda_visible_devices_is_replaced_by_the_containers_view():
    """Host CUDA_VISIBLE_DEVICES=2,3 (the agent planned GPUs 2 and 3): the container
    gets exactly those, and its workers no longer see the host's 2,3."""
    container, workers = _container([2, 3])
    host = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert _requested(container) == ["2", "3"]
    assert all(_env(container, w, host)["CUDA_VISIBLE_DEVICES"] == "0,1" for w in workers)
    assert [_lands_on(container, w, host) for w in workers] == [(0, 2), (1, 3)]


def test_virtual_local_rank_sees_only_its_own_gpu():
    """--virtual-local-rank: each worker sees only its planned GPU, in the container
    as the container numbers it (LOCAL_RANK=0 is the right device), whatever torch's
    agent set (worker 1 of 2: the host's second GPU)."""
    container, workers = _container([1, 3], uuids=UUIDS8)
    torchrun = {"CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "0"}
    env = _env(container, workers[1], torchrun, own_device_only=True)
    assert env["CUDA_VISIBLE_DEVICES"] == UUIDS8[3] and env["KAITIAN_VISIBLE_INDICES"] == "3"
    assert _lands_on(container, workers[1], torchrun, own_device_only=True) == (0, 3)
    by_index, workers = _container([1, 3])
    env = _env(by_index, workers[1], torchrun, own_device_only=True)
    assert env["CUDA_VISIBLE_DEVICES"] == "1"  # the container's number for GPU 3
    assert _lands_on(by_index, workers[1], torchrun, own_device_only=True) == (0, 3)
    assert _lands_on(by_index, workers[0], torchrun, own_device_only=True) == (0, 1)


def test_mlu_group_gets_control_and_exactly_its_device_nodes():
    container, workers = _container([3, 1], kind="mlu", nodes=MLU_NODES)
    assert container.devices.device_nodes == (
        "/dev/cambricon_ctl:/dev/cambricon_ctl:rwm",
        "/dev/cambricon_dev1:/dev/cambricon_dev1:rwm", "/dev/cambricon_ipcm1:/dev/cambricon_ipcm1:rwm",
        "/dev/cambricon_dev3:/dev/cambricon_dev3:rwm", "/dev/cambricon_ipcm3:/dev/cambricon_ipcm3:rwm",
    )
    kw = container.create_kwargs()
    assert "device_requests" not in kw and kw["devices"] == list(container.devices.device_nodes)
    env = _env(container, workers[0], {"MLU_VISIBLE_DEVICES": "1,3"})
    assert env["MLU_VISIBLE_DEVICES"] == "0,1" and "CUDA_DEVICE_ORDER" not in env
    assert [_lands_on(container, w) for w in workers] == [(1, 3), (0, 1)]


def test_missing_mlu_node_is_one_clear_error():
    with pytest.raises(DeviceSelectionError, match="cambricon_dev5"):
        _container([5], kind="mlu", nodes=MLU_NODES)


def test_cpu_groups_get_no_devices():
    container, (w,) = _container([0], kind="cpu")
    kw = container.create_kwargs()
    assert "device_requests" not in kw and kw["devices"] == []
    env = _env(container, w, {"CUDA_VISIBLE_DEVICES": "2,3"}, hide_other_vendors=True)  # --nproc-auto
    assert env["CUDA_VISIBLE_DEVICES"] == env["MLU_VISIBLE_DEVICES"] == "" and "KAITIAN_VISIBLE_INDICES" not in env
