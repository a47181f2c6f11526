"""examples/kubernetes/: the environment each manifest gives its pods makes kaitianrun form the intended world.

Each manifest is rendered into pods the way Kubernetes would run them: the
pod's host name (``<job>-<type>-<i>`` for a PyTorchJob, ``<job>-<i>`` with its
``<job>-<i>.<subdomain>`` DNS name for an Indexed Job), the container's env
plus what the Kubeflow training operator adds to a PyTorchJob pod
(``PYTHONUNBUFFERED``, ``MASTER_ADDR`` = ``<job>-master-0``, ``MASTER_PORT`` =
the master's ``pytorchjob-port``, ``WORLD_SIZE`` = number of pods, ``RANK``;
see its ``pkg/controller.v1/pytorch/envvar.go`` and ``master.go``) or what an
Indexed Job adds (``JOB_COMPLETION_INDEX``), and the command with ``$(VAR)``
expanded. Each pod then runs on its own host of the multi-host bed.

The bed has no GPUs or MLUs, so each pod gets stand-ins for its vendor's
tools on ``PATH`` answering for what the pod requests (``nvidia.com/gpu: N``
-> an ``nvidia-smi`` listing N GPUs, ``cambricon.com/mlu: N`` -> a ``cnmon``
listing N MLUs), which is how kaitian finds devices without torch; the
training script is replaced by ``workers/envdump.py``, which records what each
worker was given. Everything else is the manifest's.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List

import pytest
import yaml

from support import REPO, worker
from support.cluster_results import agent_env
from support.netns import available, bed
from support.vendor_tools import stand_in_tools

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason=f"{available()} (CI runs these as root)")

MANIFESTS = os.path.join(REPO, "examples", "kubernetes")
ACCELERATORS = {"nvidia.com/gpu": "cuda", "cambricon.com/mlu": "mlu"}


@dataclass
class Pod:
    name: str
    env: Dict[str, str]
    argv: List[str]
    vendor: str
    devices: int
    aliases: List[str] = field(default_factory=list)


def _expand(words, env):
    """Kubernetes' ``$(VAR)`` expansion in command and args."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), w) for w in words]


def _pod(name, container, extra_env, aliases=()):
    env = {e["name"]: str(e["value"]) for e in container.get("env", [])}
    env.update(extra_env)
    limits = container.get("resources", {}).get("limits", {})
    ((resource, count),) = [(r, int(n)) for r, n in limits.items() if r in ACCELERATORS]
    argv = _expand([*container.get("command", []), *container.get("args", [])], env)
    return Pod(name, env, argv, ACCELERATORS[resource], count, list(aliases))


def _pytorchjob_pods(doc):
    job = doc["metadata"]["name"]
    specs = doc["spec"]["pytorchReplicaSpecs"]
    total = sum(int(s["replicas"]) for s in specs.values())
    master = next(c for c in specs["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch")
    port = next(p["containerPort"] for p in master["ports"] if p["name"] == "pytorchjob-port")
    pods = []
    for rtype in ("Master", "Worker"):
        spec = specs[rtype]
        container = next(c for c in spec["template"]["spec"]["containers"] if c["name"] == "pytorch")
        for i in range(int(spec["replicas"])):
            pods.append(_pod(f"{job}-{rtype.lower()}-{i}", container, {
                "PYTHONUNBUFFERED": "0", "MASTER_PORT": str(port), "MASTER_ADDR": f"{job}-master-0",
                "WORLD_SIZE": str(total), "RANK": str(i + (1 if rtype == "Worker" else 0)),
            }))
    return pods


def _indexed_job_pods(docs):
    pods = []
    for doc in docs:
        if doc["kind"] != "Job":
            continue
        job, spec = doc["metadata"]["name"], doc["spec"]
        assert spec["completionMode"] == "Indexed"
        template = spec["template"]["spec"]
        for i in range(int(spec["completions"])):
            name = f"{job}-{i}"
            pods.append(_pod(name, template["containers"][0], {"JOB_COMPLETION_INDEX": str(i)},
                             aliases=[f"{name}.{template['subdomain']}"]))
    return pods


def _run_pods(pods, tmp_path, timeout=240):
    """Runs every pod's kaitianrun on its own bed host; returns each pod's workers' env dumps."""
    with bed(len(pods), names=[p.name for p in pods], aliases={p.name: p.aliases for p in pods}) as net:
        procs = []
        for pod, host in zip(pods, net.hosts):
            assert pod.argv[0] == "kaitianrun" and pod.argv[-1] == "/workspace/train.py", pod.argv
            out = tmp_path / pod.name
            out.mkdir()
            argv = [sys.executable, "-m", "kaitian.launcher.cli", *pod.argv[1:-1], worker("envdump"), str(out)]
            stand_in_tools(tmp_path / f"{pod.name}-bin", pod.vendor, pod.devices)
            env = agent_env(**pod.env)
            env["PATH"] = os.pathsep.join([str(tmp_path / f"{pod.name}-bin"), env["PATH"]])
            procs.append(host.popen(argv, env=env))
        outs = net.finish(procs, timeout)
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(pods), f"pod exits {codes}:\n" + "\n-----\n".join(o[-2000:] for o in outs)
    return {pod.name: [json.load(open(f)) for f in sorted(glob.glob(str(tmp_path / pod.name / "env.*.json")))]
            for pod in pods}


def _check_world(dumps, pods, run_id):
    world = sum(p.devices for p in pods)
    ranks = sorted(int(e["RANK"]) for envs in dumps.values() for e in envs)
    assert ranks == list(range(world))
    node0_names = {pods[0].name, *pods[0].aliases}  # torch publishes node 0's FQDN
    for node, pod in enumerate(pods):  # node ranks follow the pod names (the rendezvous sorts them)
        envs = dumps[pod.name]
        assert len(envs) == pod.devices, pod.name  # one worker per device
        for e in envs:
            assert e["WORLD_SIZE"] == str(world) and e["GROUP_WORLD_SIZE"] == str(len(pods))
            assert e["LOCAL_WORLD_SIZE"] == str(pod.devices) and e["GROUP_RANK"] == str(node)
            assert e["TORCHELASTIC_RUN_ID"] == run_id and e["TORCHELASTIC_MAX_RESTARTS"] == "3"
            assert e["MASTER_ADDR"] in node0_names and e["MASTER_PORT"] == "29500"  # node 0, the fixed store port
            assert e["KAITIAN_BRIDGE_PORTS"] == "29600-29663"
            assert e["KAITIAN_DEVICE_TYPE"] == pod.vendor  # the pod's image's vendor, found without torch
        assert sorted(int(e["KAITIAN_DEVICE_INDEX"]) for e in envs) == list(range(pod.devices))
    # ranks grouped by vendor across pods: CUDA first, then MLU, in pod order
    by_rank = sorted((int(e["RANK"]), e["KAITIAN_DEVICE_TYPE"], int(e["GROUP_RANK"]))
                     for envs in dumps.values() for e in envs)
    assert [v for _, v, _ in by_rank] == sorted((p.vendor for p in pods for _ in range(p.devices)),
                                                key=["cuda", "mlu"].index)
    assert [g for _, _, g in by_rank] == sorted(g for _, _, g in by_rank)


def test_pytorchjob_pods_form_the_intended_world(tmp_path):
    """Master (CUDA image, 2 GPUs) + 2 Workers (MLU image, 2 MLUs each): 3 nodes, 6 ranks."""
    (doc,) = yaml.safe_load_all(open(os.path.join(MANIFESTS, "pytorchjob.yaml")))
    pods = _pytorchjob_pods(doc)
    assert [p.name for p in pods] == ["kaitian-hetero-master-0", "kaitian-hetero-worker-0", "kaitian-hetero-worker-1"]
    images = {c["image"] for s in doc["spec"]["pytorchReplicaSpecs"].values() for c in s["template"]["spec"]["containers"]}
    assert images == {"kaitian:cuda", "kaitian:mlu"}  # one replica spec per vendor image
    _check_world(_run_pods(pods, tmp_path), pods, "kaitian-hetero")


def test_indexed_job_pods_form_the_intended_world(tmp_path):
    """One Indexed Job per vendor image behind a headless Service; every kaitianrun flag from PET_*."""
    docs = list(yaml.safe_load_all(open(os.path.join(MANIFESTS, "indexed-jobs.yaml"))))
    pods = _indexed_job_pods(docs)
    assert [p.name for p in pods] == ["kaitian-cuda-0", "kaitian-mlu-0", "kaitian-mlu-1"]
    assert all(p.argv == ["kaitianrun", "/workspace/train.py"] for p in pods)  # flags only as PET_*
    _check_world(_run_pods(pods, tmp_path), pods, "kaitian-job")
