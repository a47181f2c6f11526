"""A worker's environment, made in one place (kaitian.launcher.environment): a table of
worker + attempt -> environment for a local worker, a docker worker, continue mode and a
joiner. Pure: no process, no engine."""

from __future__ import annotations

import pytest

from kaitian.devices.device import ContainerDevices, WorkerDevice
from kaitian.launcher.attempt import Attempt
from kaitian.launcher.environment import worker_environment
from kaitian.launcher.workers import LocalWorker, NodeWorkers
from kaitian.launcher.request import LaunchRequest
from kaitian.version import versions

GPU = LocalWorker(1, WorkerDevice("cuda", 3, "cuda", "GPU-3"))
BOUND_GPU = LocalWorker(1, GPU.device, (8, 9, 10, 11))  # --numa-binding
CPU = LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (4, 5))
TORCH = {"RANK": "7", "LOCAL_RANK": "1", "TORCHELASTIC_RESTART_COUNT": "0", "CUDA_VISIBLE_DEVICES": "3"}
# The container of GPUs 2 and 3, as docker's NVIDIA request numbers them.
GPUS_2_3 = ContainerDevices(env={"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
                            index_map={2: 0, 3: 1})


def _attempt(**fields):
    base = dict(number=2, placement=None, workers_store=("10.0.0.1", 29500), agent_store=False, serves_store=True,
                job_key="k3y", elastic_run="5", start_dir="/run/start1",
                torchrun={0: ((), {"RANK": "6", "LOCAL_RANK": "0"}), 1: ((), TORCH)})
    return Attempt(**{**base, **fields})


def _request(**fields):
    base = dict(node=NodeWorkers((CPU, GPU), hide_other_vendors=True), run_dir=None, runtime=None,
                capabilities={"cuda:3": 4.0})
    return LaunchRequest(**{**base, **fields})


def _kaitian(device, **extra):
    return {"KAITIAN_DEVICE_TYPE": device.type, "KAITIAN_DEVICE_INDEX": str(device.index),
            **({"KAITIAN_DEVICE_UUID": device.uuid} if device.uuid else {}),
            **({"KAITIAN_GROUP": device.group} if device.explicit_group else {}),
            "KAITIAN_RUN_DIR": "/run/start1", "KAITIAN_JOB_KEY": "k3y", "KAITIAN_AGENT_VERSION": versions(), **extra}


CASES = {
    # a local GPU worker: torch's variables, kaitian's, and no other vendor's devices
    "local": (GPU, _attempt(), _request(), {}, None, {
        **TORCH, **_kaitian(GPU.device, KAITIAN_CAPABILITY="4.0"), "MLU_VISIBLE_DEVICES": "",
    }),
    # a pinned CPU worker: its cores as OpenMP threads
    "local cpu": (CPU, _attempt(), _request(), {}, None, {
        "RANK": "6", "LOCAL_RANK": "0", **_kaitian(CPU.device), "OMP_NUM_THREADS": "2",
        "CUDA_VISIBLE_DEVICES": "", "MLU_VISIBLE_DEVICES": "",
    }),
    # a GPU worker bound near its device (--numa-binding): torchrun's OpenMP threads, not its cores
    "local bound gpu": (BOUND_GPU, _attempt(), _request(), {}, None, {
        **TORCH, **_kaitian(GPU.device, KAITIAN_CAPABILITY="4.0"), "MLU_VISIBLE_DEVICES": "",
    }),
    # in a container: the container's view of its devices replaces the host's
    "docker": (GPU, _attempt(), _request(), {}, GPUS_2_3, {
        **TORCH, **_kaitian(GPU.device, KAITIAN_CAPABILITY="4.0"), "MLU_VISIBLE_DEVICES": "",
        "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "KAITIAN_VISIBLE_INDICES": "2,3",
    }),
    # continue mode: the member id and elastic run; an agent serves the store
    "continue": (GPU, _attempt(agent_store=True), _request(on_failure="continue", min_nodes=2), {}, None, {
        **TORCH, **_kaitian(GPU.device, KAITIAN_CAPABILITY="4.0"), "MLU_VISIBLE_DEVICES": "",
        "KAITIAN_ELASTIC_ID": "m", "KAITIAN_ELASTIC_RUN": "5", "KAITIAN_ELASTIC_MIN_NODES": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }),
    # a new node's worker joins the running job
    "joiner": (GPU, _attempt(joining=True, serves_store=False), _request(on_failure="continue"), {}, None, {
        **TORCH, **_kaitian(GPU.device, KAITIAN_CAPABILITY="4.0"), "MLU_VISIBLE_DEVICES": "",
        "KAITIAN_ELASTIC_ID": "m", "KAITIAN_ELASTIC_RUN": "5", "KAITIAN_ELASTIC_JOIN": "1",
    }),
    # a worker started again alone joins too, with its restart count
    "restarted alone": (GPU, _attempt(), _request(on_failure="continue", omp_from_user=True),
                        {"restart_count": 2}, None, {
        **TORCH, **_kaitian(GPU.device, KAITIAN_CAPABILITY="4.0"), "MLU_VISIBLE_DEVICES": "",
        "KAITIAN_ELASTIC_ID": "m", "KAITIAN_ELASTIC_RUN": "5", "KAITIAN_ELASTIC_JOIN": "1",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }),
    # --virtual-local-rank on the host: its own GPU only
    "own device": (GPU, _attempt(), _request(node=NodeWorkers((CPU, GPU), own_device_only=True)), {}, None, {
        **TORCH, **_kaitian(GPU.device, KAITIAN_CAPABILITY="4.0"), "CUDA_VISIBLE_DEVICES": "GPU-3",
    }),
}


@pytest.mark.parametrize("case", list(CASES))
def test_worker_environment(case):
    worker, attempt, request, extra, container, expected = CASES[case]
    env = worker_environment(worker, attempt, request, "m", container=container, **extra)
    assert env == expected
