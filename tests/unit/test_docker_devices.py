"""Containers get exactly the planned physical devices, numbered as the container
sees them: the planned container specs and worker environments for 1, 2 and
8-GPU hosts (with and without the host's CUDA_VISIBLE_DEVICES, by UUID and by
index, with --virtual-local-rank) and for MLU device nodes. No engine needed."""

from __future__ import annotations

import pytest

from kaitian.errors import DockerOptionError
from kaitian.launcher.runtimes.base import WorkerLaunch
from kaitian.launcher.runtimes.docker.devices import PhysicalDevice, physical_device
from kaitian.launcher.runtimes.docker.labels import AgentIdentity
from kaitian.launcher.runtimes.docker.options import DockerOptions
from kaitian.launcher.runtimes.docker.plan import plan_container, plan_exec

AGENT = AgentIdentity(host="node0", pid=4242, start="1")
# An 8-GPU host as NVML / nvidia-smi numbers it (physical index -> UUID).
UUIDS8 = {i: f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(8)}


def _gpu_plan(indices, host_env, uuids=None, vendor="cuda", nodes=()):
    workers = [WorkerLaunch(r, r, vendor, i, vendor) for r, i in enumerate(indices)]
    physical = [physical_device(vendor, w.device_index, host_env, uuids) for w in workers]
    plan = plan_container(group=vendor, workers=workers, image=f"kaitian:{vendor}", run_id="r", run_dir="/run",
                          cwd="/w", log_dirs=(), options=DockerOptions(), agent=AGENT, user="1000:1000",
                          physical=physical, device_nodes=nodes)
    return plan, workers


def _worker_env(plan, worker, env):
    ex = plan_exec(worker=worker, container=plan, entrypoint="python", args=(), env=env, cwd="/w", pid_file="/p")
    return ex.env


def _requested(plan):
    (request,) = plan.create_kwargs()["device_requests"]
    assert request["driver"] == "nvidia" and request["capabilities"] == [["gpu"]]
    return request["device_ids"]


def test_one_gpu_host():
    plan, (w,) = _gpu_plan([0], {}, {0: UUIDS8[0]})
    assert _requested(plan) == [UUIDS8[0]]
    env = _worker_env(plan, w, {"KAITIAN_DEVICE_INDEX": "0"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["KAITIAN_DEVICE_INDEX"] == "0"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_two_gpu_host_second_gpu_only():
    plan, (w,) = _gpu_plan([1], {}, {0: UUIDS8[0], 1: UUIDS8[1]})
    assert _requested(plan) == [UUIDS8[1]]
    env = _worker_env(plan, w, {"KAITIAN_DEVICE_INDEX": "1"})
    # the container holds one GPU: the worker's device is its cuda:0
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["KAITIAN_DEVICE_INDEX"] == "0"


def test_eight_gpu_host_use_cuda_1_3_lands_each_worker_on_its_gpu():
    """USE_CUDA=1,3: the container holds GPUs 1 and 3; the worker planned on
    GPU 3 asks for the container's cuda:1 (it used to ask for cuda:3)."""
    plan, workers = _gpu_plan([1, 3], {}, UUIDS8)
    assert _requested(plan) == [UUIDS8[1], UUIDS8[3]]
    envs = [_worker_env(plan, w, {"KAITIAN_DEVICE_INDEX": str(w.device_index)}) for w in workers]
    assert [e["KAITIAN_DEVICE_INDEX"] for e in envs] == ["0", "1"]
    assert all(e["CUDA_VISIBLE_DEVICES"] == "0,1" for e in envs)


def test_eight_gpu_host_all_gpus_in_bus_order_whatever_the_rank_order():
    plan, workers = _gpu_plan([7, 6, 5, 4, 3, 2, 1, 0], {}, UUIDS8)
    assert _requested(plan) == [UUIDS8[i] for i in range(8)]
    assert [plan.devices.container_index(w.device_index) for w in workers] == [7, 6, 5, 4, 3, 2, 1, 0]


def test_host_cuda_visible_devices_is_respected_and_renumbered():
    """Host CUDA_VISIBLE_DEVICES=2,3: the agent's cuda:0/1 are physical GPUs 2/3;
    the container gets exactly those and sees CUDA_VISIBLE_DEVICES=0,1 (it used
    to get GPUs 0,1 and still see 2,3)."""
    host = {"CUDA_VISIBLE_DEVICES": "2,3"}
    plan, workers = _gpu_plan([0, 1], host, UUIDS8)
    assert _requested(plan) == [UUIDS8[2], UUIDS8[3]]
    envs = [_worker_env(plan, w, {**host, "KAITIAN_DEVICE_INDEX": str(w.device_index)}) for w in workers]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1"]
    assert [e["KAITIAN_DEVICE_INDEX"] for e in envs] == ["0", "1"]


def test_without_uuids_gpus_are_requested_by_physical_index():
    plan, _ = _gpu_plan([0, 1], {"CUDA_VISIBLE_DEVICES": "5,2"})
    assert _requested(plan) == ["2", "5"]  # bus order: the container's cuda:0 is GPU 2
    assert plan.devices.container_index(0) == 1 and plan.devices.container_index(1) == 0


def test_host_visibility_by_uuid():
    host = {"CUDA_VISIBLE_DEVICES": f"{UUIDS8[6]},{UUIDS8[4]}"}
    assert physical_device("cuda", 0, host, UUIDS8) == PhysicalDevice("cuda", 0, 6, UUIDS8[6])
    plan, workers = _gpu_plan([0, 1], host, UUIDS8)
    assert _requested(plan) == [UUIDS8[4], UUIDS8[6]]
    env = _worker_env(plan, workers[0], {**host, "KAITIAN_DEVICE_INDEX": "0"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["KAITIAN_DEVICE_INDEX"] == "1"


def test_virtual_local_rank_sees_only_its_own_gpu():
    """--virtual-local-rank: the agent gives each worker its one GPU (host id);
    inside, that is the container's index of it, and LOCAL_RANK=0 is right."""
    plan, workers = _gpu_plan([1, 3], {}, UUIDS8)
    env = _worker_env(plan, workers[1], {"CUDA_VISIBLE_DEVICES": "3", "LOCAL_RANK": "0", "KAITIAN_DEVICE_INDEX": "3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["KAITIAN_DEVICE_INDEX"] == "1" and env["LOCAL_RANK"] == "0"


def test_a_device_outside_the_host_visibility_is_one_clear_error():
    with pytest.raises(DockerOptionError, match=r"cuda:2 is not visible under CUDA_VISIBLE_DEVICES=0,1"):
        physical_device("cuda", 2, {"CUDA_VISIBLE_DEVICES": "0,1"})


MLU_NODES = ["/dev/cambricon_ctl"] + [f"/dev/cambricon_dev{i}" for i in range(4)] + \
            [f"/dev/cambricon_ipcm{i}" for i in range(4)]


def test_mlu_group_gets_control_and_exactly_its_device_nodes_renumbered_visibility():
    plan, workers = _gpu_plan([3, 1], {}, vendor="mlu", nodes=MLU_NODES)
    assert plan.devices.device_nodes == (
        "/dev/cambricon_ctl:/dev/cambricon_ctl:rwm",
        "/dev/cambricon_dev1:/dev/cambricon_dev1:rwm", "/dev/cambricon_ipcm1:/dev/cambricon_ipcm1:rwm",
        "/dev/cambricon_dev3:/dev/cambricon_dev3:rwm", "/dev/cambricon_ipcm3:/dev/cambricon_ipcm3:rwm",
    )
    assert "device_requests" not in plan.create_kwargs()
    env = _worker_env(plan, workers[0], {"KAITIAN_DEVICE_INDEX": "3", "MLU_VISIBLE_DEVICES": "1,3"})
    assert env["MLU_VISIBLE_DEVICES"] == "0,1" and env["KAITIAN_DEVICE_INDEX"] == "1"
    assert "CUDA_DEVICE_ORDER" not in env


def test_mlu_host_visibility_and_missing_nodes():
    plan, _ = _gpu_plan([0], {"MLU_VISIBLE_DEVICES": "2"}, vendor="mlu", nodes=MLU_NODES)
    assert "/dev/cambricon_dev2:/dev/cambricon_dev2:rwm" in plan.devices.device_nodes
    with pytest.raises(DockerOptionError, match="cambricon_dev5"):
        _gpu_plan([5], {}, vendor="mlu", nodes=MLU_NODES)


def _agent_env(plans, local_rank, host_env, monkeypatch):
    """The torchrun part of a worker's environment under --virtual-local-rank."""
    from types import SimpleNamespace

    from kaitian.launcher.agent import KaitianAgent

    for k in ("CUDA_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in host_env.items():
        monkeypatch.setenv(k, v)
    rdzv = SimpleNamespace(get_run_id=lambda: "r", use_agent_store=False)
    spec = SimpleNamespace(role="trainer", local_world_size=len(plans), max_restarts=0, rdzv_handler=rdzv,
                           virtual_local_rank=True)
    group = SimpleNamespace(spec=spec, group_rank=0, group_world_size=1, master_addr="h", master_port=1)
    worker = SimpleNamespace(local_rank=local_rank, global_rank=local_rank, role_rank=local_rank,
                             world_size=len(plans), role_world_size=len(plans))
    return KaitianAgent._torchrun_env(SimpleNamespace(_plans=plans), group, worker, 0)


def test_virtual_local_rank_gives_each_worker_its_planned_device(monkeypatch):
    """USE_CUDA=1,3 --virtual-local-rank: local rank 1 sees GPU 3 (torch gave it
    GPU 1, the local rank-th); under host CUDA_VISIBLE_DEVICES the entry of its
    planned device; an MLU worker its MLU."""
    from kaitian.launcher.plan import WorkerPlan

    plans = [WorkerPlan("cuda", 1, "cuda"), WorkerPlan("cuda", 3, "cuda")]
    env = _agent_env(plans, 1, {}, monkeypatch)
    assert env["LOCAL_RANK"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "3"
    plans = [WorkerPlan("cuda", 0, "cuda"), WorkerPlan("cuda", 1, "cuda")]
    assert _agent_env(plans, 1, {"CUDA_VISIBLE_DEVICES": "2,5"}, monkeypatch)["CUDA_VISIBLE_DEVICES"] == "5"
    mlu = _agent_env([WorkerPlan("mlu", 2, "mlu")], 0, {}, monkeypatch)
    assert mlu["MLU_VISIBLE_DEVICES"] == "2" and "CUDA_VISIBLE_DEVICES" not in mlu
