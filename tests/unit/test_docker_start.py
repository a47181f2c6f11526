"""The docker start as a pure plan (kaitian.launcher.runtimes.docker.start): containers and
execs from one start's workers, what the runtime read of the host, and the options; and a
container's digest, which covers every setting. No engine."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

from kaitian.devices.device import ContainerDevices, WorkerDevice
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.runtimes.base import RunContext, WorkerStart
from kaitian.launcher.runtimes.docker.start import LABEL_SPEC, AgentIdentity
from kaitian.launcher.runtimes.docker.options import DockerOptions, Mount
from kaitian.launcher.runtimes.docker.start import (
    ContainerSpec, DockerHost, ImageInfo, LogFiles, container_spec, docker_start,
)

AGENT = AgentIdentity(host="node0", pid=4242, start="1")
WORKERS = {
    0: LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,)),
    1: LocalWorker(1, WorkerDevice("cpu", 1, "cpu0"), (1,)),
    2: LocalWorker(2, WorkerDevice("cpu", 2, "cpu1"), (2,)),
}


def _host(**fields):
    base = dict(run=RunContext("run-1", "/runs/r1", None, "/home/u/proj", cpu_quotas={"cpu1": 0.5}), agent=AGENT,
                user="1000:1000", images={"kaitian:cpu": ImageInfo((Mount("/usr", "/usr", True),), "/opt/py/bin/python")},
                host_python=("/venv/bin/python",), device_nodes=())
    return DockerHost(**{**base, **fields})


def _job(workers, entrypoint, args, envs, log_dir=None):
    return WorkerStart("w", entrypoint, args, envs, SimpleNamespace(root_log_dir=log_dir), workers)


# One value other than the default for each of a container's settings.
OTHER = {
    "image": "other:img", "vendor": "cuda", "mounts": (Mount("/x", "/x"),), "user": "5:5",
    "devices": ContainerDevices(device_nodes=("/dev/x:/dev/x:rwm",)), "capabilities": ("DAC_OVERRIDE",),
    "tied": False, "cpuset": "7", "cpu_quota": 2.0, "cpu_period_us": 100_000, "cgroup_parent": "/agent",
    "shm_size": "1g",
}


def test_every_container_setting_is_in_its_digest():
    """The digest is computed from the spec's fields: a setting added to ContainerSpec is in it
    (this table must name it, or the test fails), and changing any one makes another container."""
    spec = container_spec("cpu0", [WORKERS[0]], _host(run=RunContext("r", "/runs/r1", None, "/w")), DockerOptions())
    settings = {f.name for f in dataclasses.fields(ContainerSpec)} - set(ContainerSpec.IDENTITY)
    assert set(OTHER) == settings == set(spec.settings)
    for name, value in OTHER.items():
        changed = dataclasses.replace(spec, **{name: value})
        assert changed.digest != spec.digest, name
        assert changed.labels[LABEL_SPEC] == changed.digest
    # who owns it is not its shape: a kept container serves later runs and agents
    same = dataclasses.replace(spec, run_id="r2", agent=AgentIdentity("node1", 1, "2"), cpu_shares=4096)
    assert same.digest == spec.digest


def test_docker_start_plans_a_container_per_group_and_an_exec_per_worker():
    envs = {k: {"RANK": str(k), "KAITIAN_RUN_DIR": "/runs/r1/start0", "PATH": "/host/bin"} for k in WORKERS}
    plan = docker_start(_job(WORKERS, "/venv/bin/python", {k: ("-u", "train.py") for k in WORKERS}, envs, "/logs"),
                        LogFiles(stdouts={0: "/logs/0/stdout.log"}, error_files={2: "/logs/a/2/error.json"}),
                        _host(hands_over=True, agent_env={"SHARED": "a", "RANK": "x", "LD_PRELOAD": "/h.so"}),
                        DockerOptions())
    assert [c.group for c in plan.containers] == ["cpu0", "cpu1"]
    cpu0, cpu1 = plan.containers
    assert cpu0.cpuset == "0-1" and cpu0.cpu_shares == 2048 and cpu0.cpu_quota is None
    assert cpu1.cpu_quota == 0.5 and cpu1.cpu_shares == 1024
    assert [m.target for m in cpu0.mounts] == ["/home/u/proj", "/logs", "/runs/r1", "/usr"]
    ex = plan.execs[1]
    assert ex.group == "cpu0" and ex.user == "1000:1000" and ex.workdir == "/home/u/proj"
    assert ex.cmd[3:] == ("/runs/r1/docker-pids/1.pid", "1", "", "", "/opt/py/bin/python", "-u", "train.py")
    assert ex.env["RANK"] == "1" and "PATH" not in ex.env and ex.env["HOME"] == "/tmp"
    assert ex.env["SHARED"] == "a" and "LD_PRELOAD" not in ex.env  # the agent's, beneath; not the host's software
    assert plan.execs[0].stdout == "/logs/0/stdout.log"  # written by the worker: the mount shows it
    # a root agent hands the workers' directories to them; never the --log-dir itself
    assert plan.hand_over == ("/logs/a", "/logs/a/2", "/runs/r1", "/runs/r1/docker-pids", "/runs/r1/start0")
    text = plan.to_text(inherited={"RANK": "2"})
    assert f"- name: {cpu0.name}" in text and f"  container: \"{cpu1.name}\"" in text
    assert '    RANK: "1"' in text and '    RANK: "2"' not in text  # only what the worker does not inherit
    assert '  argv: ["/opt/py/bin/python", "-u", "train.py"]' in text


def test_kept_containers_mount_the_directory_of_all_runs():
    plan = docker_start(_job({0: WORKERS[0]}, "/bin/tool", {0: ()}, {0: {}}), LogFiles(), _host(),
                        DockerOptions(keep_containers=True))
    (container,) = plan.containers
    assert "/runs" in [m.target for m in container.mounts] and not container.tied
    assert plan.hand_over == ()  # not a root agent
    assert os.path.basename(plan.execs[0].pid_file) == "0.pid"
