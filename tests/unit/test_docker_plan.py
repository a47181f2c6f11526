"""The docker runtime's planning step, with no Docker engine: what containers and
execs would be made from a run's workers and options."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kaitian.devices.device import WorkerDevice
from kaitian.errors import DeviceSelectionError
from kaitian.launcher.runtimes.base import WorkerLaunch
from kaitian.launcher.runtimes.docker.plan import (
    LABEL_AGENT_PID,
    LABEL_GROUP,
    LABEL_KEEP,
    LABEL_RUN_ID,
    LABEL_SPEC,
    LABEL_VENDOR,
    WRAPPER_SCRIPT,
    AgentIdentity,
    DockerOptionError,
    DockerOptions,
    Mount,
    exit_code_from_docker,
    image_for,
    parse_options,
    parse_volume,
    plan_container,
    plan_exec,
    stop_command,
    worker_env,
)

AGENT = AgentIdentity(host="node0", pid=4242, start="12345")


def _plan(workers, *, options=DockerOptions(), log_dirs=("/logs",), **kw):
    return plan_container(
        group=workers[0].device.group,
        workers=workers,
        image=kw.pop("image", "kaitian:cpu"),
        run_id="run-1",
        run_dir="/tmp/kaitian-0",
        cwd="/home/u/proj",
        log_dirs=log_dirs,
        options=options,
        agent=AGENT,
        **kw,
    )


def test_parse_volume_forms():
    assert parse_volume("/data:/data:ro") == Mount("/data", "/data", True)
    assert parse_volume("/data:/mnt") == Mount("/data", "/mnt", False)
    assert parse_volume("/data") == Mount("/data", "/data", False)
    rel = parse_volume("data:/x")
    assert rel.source == os.path.abspath("data") and rel.target == "/x"
    for bad in ("/a:/b:rx", "/a:b", ":/b", "/a:/b:ro:x"):
        with pytest.raises(DockerOptionError):
            parse_volume(bad)


def test_parse_options_checks_values():
    opts = parse_options({"images": {"cuda": "r/t:1"}, "keep_containers": True,
                          "volumes": ["/d:/d:ro"], "shm_size": "512m"})
    assert opts.images == {"cuda": "r/t:1"} and opts.keep_containers
    assert opts.volumes == (Mount("/d", "/d", True),) and opts.shm_size == "512m"
    assert parse_options({}).shm_size == "2g"
    with pytest.raises(DockerOptionError, match="--shm-size"):
        parse_options({"shm_size": "lots"})
    with pytest.raises(DockerOptionError, match="--image"):
        parse_options({"images": {"cpu": ""}})


def test_image_for_prefers_group_then_vendor_then_table():
    images = {"cpu1": "slow:img", "cpu": "cpu:img"}
    assert image_for("cpu1", "cpu", images) == "slow:img"
    assert image_for("cpu0", "cpu", images) == "cpu:img"
    assert image_for("cuda", "cuda", {}) == "kaitian:cuda"
    with pytest.raises(DockerOptionError, match="--image"):
        image_for("npu", "npu", {})


def test_cpu_group_container_pins_cpuset_and_quota_never_privileged():
    workers = [
        WorkerLaunch(0, 0, WorkerDevice("cpu", 0, "cpu0"), (0, 1), 1.5),
        WorkerLaunch(1, 1, WorkerDevice("cpu", 1, "cpu0"), (2, 3), 1.5),
    ]
    plan = _plan(workers)
    kw = plan.create_kwargs()
    assert kw["cpuset_cpus"] == "0-3"
    assert kw["cpu_quota"] == 150_000 and kw["cpu_period"] == 100_000
    assert kw["network_mode"] == "host" and kw["ipc_mode"] == "host"
    assert kw["privileged"] is False and kw["init"] is True
    assert kw["command"] == ["sleep", "infinity"]
    assert "device_requests" not in kw and kw["devices"] == []
    assert kw["cpu_shares"] == 2048  # two workers weigh as two local processes
    assert "cgroup_parent" not in kw
    nested = _plan(workers, cgroup_parent="/")
    assert nested.create_kwargs()["cgroup_parent"] == "/" and nested.spec != plan.spec
    labels = kw["labels"]
    assert labels[LABEL_RUN_ID] == "run-1" and labels[LABEL_VENDOR] == "cpu"
    assert labels[LABEL_GROUP] == "cpu0" and labels[LABEL_AGENT_PID] == "4242"
    assert labels[LABEL_KEEP] == "0"
    targets = {m["target"]: m for m in kw["mounts"]}
    # cwd, run dir and log dirs at identical paths (error files land on the host)
    for path in ("/home/u/proj", "/tmp/kaitian-0", "/logs"):
        assert targets[path]["source"] == path and not targets[path]["read_only"]


def test_unpinned_workers_leave_container_unpinned():
    plan = _plan([WorkerLaunch(0, 0, WorkerDevice("cpu", 0, "cpu"), (), None)])
    kw = plan.create_kwargs()
    assert "cpuset_cpus" not in kw and "cpu_quota" not in kw


def test_cuda_group_gets_exactly_its_gpus_and_renumbered_visibility():
    workers = [WorkerLaunch(0, 0, WorkerDevice("cuda", 3, "cuda")), WorkerLaunch(1, 1, WorkerDevice("cuda", 1, "cuda"))]
    plan = _plan(workers, image="kaitian:cuda")
    kw = plan.create_kwargs()
    assert kw["device_requests"] == [{"driver": "nvidia", "device_ids": ["1", "3"], "capabilities": [["gpu"]]}]
    assert plan.index_map == {1: 0, 3: 1}
    env = worker_env({"CUDA_VISIBLE_DEVICES": "3", "PATH": "/host/bin", "RANK": "0"},
                     vendor="cuda", index_map=plan.index_map, mounted=[])
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "RANK": "0"}


def test_mlu_group_gets_control_and_selected_device_nodes():
    present = ["/dev/cambricon_ctl", "/dev/cambricon_dev0", "/dev/cambricon_dev1",
               "/dev/cambricon_ipcm0", "/dev/cambricon_ipcm1"]
    plan = _plan([WorkerLaunch(0, 0, WorkerDevice("mlu", 1, "mlu"))], image="kaitian:mlu", device_nodes=present)
    assert plan.devices == ("/dev/cambricon_ctl:/dev/cambricon_ctl:rwm",
                            "/dev/cambricon_dev1:/dev/cambricon_dev1:rwm",
                            "/dev/cambricon_ipcm1:/dev/cambricon_ipcm1:rwm")
    with pytest.raises(DeviceSelectionError, match="cambricon_dev2"):
        _plan([WorkerLaunch(0, 0, WorkerDevice("mlu", 2, "mlu"))], device_nodes=present)


def test_group_must_be_one_vendor_and_one_quota():
    with pytest.raises(DockerOptionError, match="mixes"):
        _plan([WorkerLaunch(0, 0, WorkerDevice("cpu", 0, "g")), WorkerLaunch(1, 1, WorkerDevice("cuda", 0, "g"))])
    with pytest.raises(DockerOptionError, match="quotas"):
        _plan([WorkerLaunch(0, 0, WorkerDevice("cpu", 0, "g"), (0,), 1.0), WorkerLaunch(1, 1, WorkerDevice("cpu", 1, "g"), (1,), 2.0)])


def test_user_volumes_and_image_mounts_and_spec_hash():
    w = [WorkerLaunch(0, 0, WorkerDevice("cpu", 0, "cpu0"), (0,), None)]
    base = _plan(w)
    user = _plan(w, options=DockerOptions(volumes=(Mount("/data", "/data", True),)),
                 image_mounts=(Mount("/usr", "/usr", True),))
    targets = {m.target: m for m in user.mounts}
    assert targets["/data"].read_only and targets["/usr"].read_only
    assert base.spec != user.spec  # a different shape is never reused
    assert _plan(w).spec == base.spec  # the same shape is
    assert base.labels[LABEL_SPEC] == base.spec


def test_keep_containers_are_named_by_shape_not_run():
    w = [WorkerLaunch(0, 0, WorkerDevice("cpu", 0, "cpu0"), (0,), None)]
    kept = _plan(w, options=DockerOptions(keep_containers=True))
    assert kept.labels[LABEL_KEEP] == "1"
    assert kept.name == f"kaitian-cpu0-{kept.spec[:12]}"
    assert _plan(w).name == "kaitian-run-1-cpu0-4242"


def test_plan_exec_maps_host_python_and_keeps_job_env():
    w = WorkerLaunch(1, 5, WorkerDevice("cpu", 1, "cpu1"), (2, 3), None)
    container = _plan([w])
    env = {"PATH": "/h", "LD_LIBRARY_PATH": "/h/lib", "RANK": "5", "KAITIAN_GROUP": "cpu1",
           "TMPDIR": "/tmp/kaitian-0/x", "MASTER_PORT": "29500", "PYENV_VERSION": "3.11"}
    ex = plan_exec(worker=w, container=container, entrypoint="/host/bin/python3", args=("-u", "train.py", 3),
                   env=env, cwd="/home/u/proj", pid_file="/tmp/kaitian-0/1.pid", user="1000:1000",
                   host_python=["/host/bin/python3"], image_python="python3")
    assert ex.cmd[:3] == ("sh", "-c", WRAPPER_SCRIPT)
    assert ex.cmd[3:] == ("/tmp/kaitian-0/1.pid", "2-3", "python3", "-u", "train.py", "3")
    assert ex.env == {"RANK": "5", "KAITIAN_GROUP": "cpu1", "TMPDIR": "/tmp/kaitian-0/x", "MASTER_PORT": "29500"}
    assert ex.user == "1000:1000" and ex.workdir == "/home/u/proj"
    assert "RANK=5" in ex.env_list()
    other = plan_exec(worker=w, container=container, entrypoint="/opt/bin/tool", args=(), env={"TMPDIR": "/elsewhere"},
                      cwd="/", pid_file="/p", user="0:0", host_python=["/host/bin/python3"])
    assert other.cmd[5] == "/opt/bin/tool" and "TMPDIR" not in other.env


def test_stop_command_and_exit_codes():
    cmd = stop_command([7, 12], "SIGTERM")
    assert cmd[:2] == ("sh", "-c") and "kill -s TERM -- -7" in cmd[2] and "-- -12" in cmd[2]
    assert stop_command([], "SIGKILL") == ("sh", "-c", "true")
    assert exit_code_from_docker(0) == 0
    assert exit_code_from_docker(1) == 1
    assert exit_code_from_docker(137) == -9
    assert exit_code_from_docker(143) == -15
    assert exit_code_from_docker(None) == -9


def test_wrapper_records_pid_pins_and_makes_a_process_group(tmp_path):
    """The exec wrapper, run here as a plain subprocess (not a session leader):
    the pid it records is the worker's own pid and process group, and a signal
    to that group reaches the worker's children too."""
    pid_file = tmp_path / "w.pid"
    child_pid_file = tmp_path / "child.pid"
    script = (
        "import os, subprocess, sys, time\n"
        "c = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(child_pid_file)!r}, 'w').write(str(c.pid))\n"
        "print(os.getpid(), os.getpgid(0), sorted(os.sched_getaffinity(0)), flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen(["sh", "-c", WRAPPER_SCRIPT, str(pid_file), "0", sys.executable, "-c", script],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split(maxsplit=2)
        pid, pgid = int(line[0]), int(line[1])
        assert pid == proc.pid == pgid == int(pid_file.read_text())
        assert line[2].strip() == "[0]"
        deadline = time.time() + 10
        while not child_pid_file.exists() and time.time() < deadline:
            time.sleep(0.05)
        child = int(child_pid_file.read_text())
        subprocess.run(list(stop_command([pgid], "SIGTERM")), check=True)
        assert proc.wait(10) == -signal.SIGTERM
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            # the child is reaped by init; until then it may be a zombie
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the worker's child survived a TERM to the worker's process group")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_directories_inside_mounted_ones_are_not_mounted_again():
    w = [WorkerLaunch(0, 0, WorkerDevice("cpu", 0, "cpu0"), (0,), None)]
    plan = _plan(w, log_dirs=("/tmp/kaitian-0/run.123/logs", "/var/log/job"))
    targets = [m.target for m in plan.mounts]
    assert targets == ["/home/u/proj", "/tmp/kaitian-0", "/var/log/job"]
    # so a later run (new run directory, new log directory) has the same shape
    assert _plan(w, log_dirs=("/tmp/kaitian-0/run.456/logs", "/var/log/job")).spec == plan.spec


def test_run_path_entrypoint_becomes_python_in_the_container(tmp_path):
    from torch.distributed.run import run_script_path

    from kaitian.launcher.runtimes.docker.runtime import _as_binary

    script = tmp_path / "s.py"
    out = tmp_path / "argv.txt"
    script.write_text(f"import sys; open({str(out)!r}, 'w').write(repr(sys.argv)) if __name__ == '__main__' else None\n")
    binary, args = _as_binary(run_script_path, {0: (str(script), "--lr", "0.1")})
    assert binary == sys.executable
    subprocess.run([binary, *args[0]], check=True, timeout=60)
    assert out.read_text() == repr([str(script), "--lr", "0.1"])
    with pytest.raises(DockerOptionError, match="not Python functions"):
        _as_binary(print, {0: ()})
