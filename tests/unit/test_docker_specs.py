"""The docker runtime's specs, with no Docker engine: what containers and execs
would be made from a run's workers and options."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kaitian.errors import DockerOptionError
from kaitian.devices.device import WorkerDevice
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.runtimes.base import RunContext
from kaitian.launcher.runtimes.docker.start import (
    LABEL_AGENT_PID,
    LABEL_GROUP,
    LABEL_KEEP,
    LABEL_RUN_ID,
    LABEL_SPEC,
    LABEL_VENDOR,
    AgentIdentity,
    DockerHost,
    ImageInfo,
)
from kaitian.launcher.runtimes.docker.options import DockerOptions, Mount, parse_volume
from kaitian.launcher.runtimes.docker.exec import exit_code_from_docker
from kaitian.launcher.runtimes.docker.start import (
    choose_user,
    container_spec,
    exec_spec,
    image_for,
)
from kaitian.launcher.runtimes.docker.start import MAIN_KEPT, MAIN_TIED, WRAPPER_SCRIPT
from kaitian.launcher.runtimes.docker.exec import stop_command

AGENT = AgentIdentity(host="node0", pid=4242, start="12345")


def _host(run_dir="/tmp/kaitian-0", cwd="/home/u/proj", cpu_quotas={}, user="0:0", image_mounts=(), **kw):
    return DockerHost(RunContext("run-1", run_dir, None, cwd, cpu_quotas=cpu_quotas), AGENT, user,
                      images={"kaitian:cpu": ImageInfo(tuple(image_mounts))}, **kw)


def _container(workers, *, options=DockerOptions(), log_dirs=("/logs",), cpu_quota=None, **kw):
    group = workers[0].device.group
    host = _host(cpu_quotas={group: cpu_quota} if cpu_quota is not None else {}, **kw)
    return container_spec(group, workers, host, options, log_dirs)


def test_parse_volume_forms():
    assert parse_volume("/data:/data:ro") == Mount("/data", "/data", True)
    assert parse_volume("/data:/mnt") == Mount("/data", "/mnt", False)
    assert parse_volume("/data") == Mount("/data", "/data", False)
    rel = parse_volume("data:/x")
    assert rel.source == os.path.abspath("data") and rel.target == "/x"
    for bad in ("/a:/b:rx", "/a:b", ":/b", "/a:/b:ro:x"):
        with pytest.raises(DockerOptionError):
            parse_volume(bad)


def test_options_from_flags_checks_values():
    opts = DockerOptions.from_flags(images=["cuda=r/t:1"], keep_containers=True,
                                    volumes=["/d:/d:ro"], shm_size="512m", container_user="1000")
    assert opts.images == {"cuda": "r/t:1"} and opts.keep_containers
    assert opts.volumes == (Mount("/d", "/d", True),) and opts.shm_size == "512m"
    assert opts.user == "1000:1000"
    assert DockerOptions.from_flags(container_user="root").user == "0:0"
    assert DockerOptions.from_flags(container_user="5:6").user == "5:6"
    assert DockerOptions.from_flags().shm_size == "2g" and DockerOptions().user is None
    with pytest.raises(DockerOptionError, match="--shm-size"):
        DockerOptions.from_flags(shm_size="lots")
    with pytest.raises(DockerOptionError, match="--image 'cpu='"):
        DockerOptions.from_flags(images=["cpu="])
    with pytest.raises(DockerOptionError, match="--image 'kaitian:cuda'"):
        DockerOptions.from_flags(images=["kaitian:cuda"])
    with pytest.raises(DockerOptionError, match="--container-user"):
        DockerOptions.from_flags(container_user="alice")


def test_runtime_options_are_typed_and_built_once_from_the_command_line():
    from kaitian.launcher.cli import build_parser
    from kaitian.launcher.runtimes import RuntimeOptions, options_from_args

    args = build_parser().parse_args(["--runtime", "docker", "--image", "cpu=x:1", "-v", "/d:/e:ro",
                                      "--container-user", "root", "--keep-containers", "t.py"])
    config = type("Config", (), {"duplicate_stdout_filters": ["a"], "duplicate_stderr_filters": None})()
    opts = options_from_args(args, config)
    assert isinstance(opts, RuntimeOptions) and opts.duplicate_stdout_filters == ["a"]
    assert opts.of("docker", DockerOptions) == DockerOptions(images={"cpu": "x:1"}, keep_containers=True,
                                                             volumes=(Mount("/d", "/e", True),), user="0:0")
    assert RuntimeOptions().of("docker", DockerOptions) == DockerOptions()  # a runtime's defaults


def test_image_for_prefers_group_then_vendor_then_table():
    images = {"cpu1": "slow:img", "cpu": "cpu:img"}
    assert image_for("cpu1", "cpu", images) == "slow:img"
    assert image_for("cpu0", "cpu", images) == "cpu:img"
    assert image_for("cuda", "cuda", {}) == "kaitian:cuda"
    with pytest.raises(DockerOptionError, match="--image"):
        image_for("npu", "npu", {})


def test_cpu_group_container_pins_cpuset_and_quota_never_privileged():
    workers = [
        LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0, 1)),
        LocalWorker(1, WorkerDevice("cpu", 1, "cpu0"), (2, 3)),
    ]
    container = _container(workers, cpu_quota=1.5)
    kw = container.create_kwargs()
    assert kw["cpuset_cpus"] == "0-3"
    # the local runtime's period: a quota'd container is as uniformly slow as a quota'd local worker
    assert kw["cpu_quota"] == 15_000 and kw["cpu_period"] == 10_000
    small = _container(workers, cpu_quota=0.05).create_kwargs()
    assert (small["cpu_period"], small["cpu_quota"]) == (20_000, 1_000)  # exact below 0.1 core too
    assert kw["network_mode"] == "host" and kw["ipc_mode"] == "host"
    assert kw["privileged"] is False and kw["init"] is True
    assert kw["command"] == list(MAIN_TIED)  # lives as long as the agent's stdin attach
    assert kw["stdin_open"] is True and kw["detach"] is False and kw["auto_remove"] is True
    assert "device_requests" not in kw and kw["devices"] == []
    assert kw["cpu_shares"] == 2048  # two workers weigh as two local processes
    assert "cgroup_parent" not in kw
    nested = _container(workers, cpu_quota=1.5, cgroup_parent="/")
    assert nested.create_kwargs()["cgroup_parent"] == "/" and nested.digest != container.digest
    labels = kw["labels"]
    assert labels[LABEL_RUN_ID] == "run-1" and labels[LABEL_VENDOR] == "cpu"
    assert labels[LABEL_GROUP] == "cpu0" and labels[LABEL_AGENT_PID] == "4242"
    assert labels[LABEL_KEEP] == "0"
    targets = {m["Target"]: m for m in kw["mounts"]}
    # cwd, run dir and log dirs at identical paths (error files land on the host)
    for path in ("/home/u/proj", "/tmp/kaitian-0", "/logs"):
        assert targets[path]["Source"] == path and targets[path]["ReadOnly"] is False


def test_unpinned_workers_leave_container_unpinned():
    container = _container([LocalWorker(0, WorkerDevice("cpu", 0, "cpu"))])
    kw = container.create_kwargs()
    assert "cpuset_cpus" not in kw and "cpu_quota" not in kw


def test_group_must_be_one_vendor():
    with pytest.raises(DockerOptionError, match="mixes"):
        _container([LocalWorker(0, WorkerDevice("cpu", 0, "g")), LocalWorker(1, WorkerDevice("cuda", 0, "g"))])


def test_user_volumes_and_image_mounts_and_digest():
    w = [LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,))]
    base = _container(w)
    user = _container(w, options=DockerOptions(volumes=(Mount("/data", "/data", True),)),
                 image_mounts=(Mount("/usr", "/usr", True),))
    targets = {m.target: m for m in user.mounts}
    assert targets["/data"].read_only and targets["/usr"].read_only
    assert base.digest != user.digest  # a different shape is never reused
    assert _container(w).digest == base.digest  # the same shape is
    assert base.labels[LABEL_SPEC] == base.digest


def test_keep_containers_are_named_by_shape_not_run():
    w = [LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,))]
    kept = _container(w, options=DockerOptions(keep_containers=True))
    assert kept.labels[LABEL_KEEP] == "1"
    kw = kept.create_kwargs()
    assert kw["command"] == list(MAIN_KEPT) and not kw["auto_remove"] and not kw["stdin_open"]
    assert kept.name == f"kaitian-cpu0-{kept.digest[:12]}"
    assert _container(w).name == "kaitian-run-1-cpu0-4242"


def test_exec_spec_maps_host_python_and_keeps_job_env():
    w = LocalWorker(1, WorkerDevice("cpu", 1, "cpu1"), (2, 3))
    container = _container([w], user="1000:1000")
    host = _host(host_python=("/host/bin/python3",))
    env = {"PATH": "/h", "LD_LIBRARY_PATH": "/h/lib", "RANK": "5", "KAITIAN_GROUP": "cpu1",
           "TMPDIR": "/tmp/kaitian-0/x", "MASTER_PORT": "29500", "PYENV_VERSION": "3.11", "HOME": "/root",
           "VIRTUAL_ENV": "/venv"}
    ex = exec_spec(w, container, ("/host/bin/python3", "-u", "train.py", 3), env, host)
    assert ex.cmd[:3] == ("sh", "-c", WRAPPER_SCRIPT)
    assert ex.cmd[3:] == ("/tmp/kaitian-0/docker-pids/1.pid", "2-3", "", "", "python3", "-u", "train.py", "3")
    assert ex.env == {"RANK": "5", "KAITIAN_GROUP": "cpu1", "TMPDIR": "/tmp/kaitian-0/x", "MASTER_PORT": "29500",
                      "HOME": "/tmp"}  # HOME: the container's private tmpfs
    assert ex.user == "1000:1000" and ex.workdir == "/home/u/proj"
    other = exec_spec(w, container, ("/opt/bin/tool",), {"TMPDIR": "/elsewhere"}, host)
    assert other.cmd[7] == "/opt/bin/tool" and "TMPDIR" not in other.env
    # Log files the container sees are written by the worker itself; others come through the stream.
    mounted = container.mounts[0].target
    logged = exec_spec(w, container, ("/opt/bin/tool",), {}, host, os.path.join(mounted, "0", "stdout.log"),
                       "/not/mounted/err.log")
    assert (logged.stdout, logged.stderr) == (os.path.join(mounted, "0", "stdout.log"), "")
    assert logged.cmd[5:7] == (logged.stdout, "")


def test_stop_command_and_exit_codes():
    cmd = stop_command([7, 12], signal.SIGTERM)
    assert cmd[:2] == ("sh", "-c") and "kill -s TERM -- -7" in cmd[2] and "-- -12" in cmd[2]
    assert stop_command([], signal.SIGKILL) == ("sh", "-c", "true")
    assert exit_code_from_docker(0) == 0
    assert exit_code_from_docker(1) == 1
    assert exit_code_from_docker(137) == -9
    assert exit_code_from_docker(143) == -15
    assert exit_code_from_docker(None) == -9


def test_wrapper_writes_the_workers_output_to_its_log_files(tmp_path):
    """Given log files, the worker's own output goes there, appended, and nothing
    through the exec's stream, which can drop the last lines of a process that
    exits (CI lost "crash-log from rank 0" of a failed job's kept logs)."""
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    out.write_text("earlier\n")
    script = "import sys; print('last words'); sys.stderr.write('traceback\\n'); raise SystemExit(3)"
    proc = subprocess.run(["sh", "-c", WRAPPER_SCRIPT, str(tmp_path / "pid"), "", str(out), str(err),
                           sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stdout == proc.stderr == ""
    assert out.read_text() == "earlier\nlast words\n" and err.read_text() == "traceback\n"


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
    proc = subprocess.Popen(["sh", "-c", WRAPPER_SCRIPT, str(pid_file), "0", "", "", sys.executable, "-c", script],
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
        subprocess.run(list(stop_command([pgid], signal.SIGTERM)), check=True)
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
    w = [LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,))]
    container = _container(w, log_dirs=("/tmp/kaitian-0/run.123/logs", "/var/log/job"))
    targets = [m.target for m in container.mounts]
    assert targets == ["/home/u/proj", "/tmp/kaitian-0", "/var/log/job"]
    # so a later run (new run directory, new log directory) has the same shape
    assert _container(w, log_dirs=("/tmp/kaitian-0/run.456/logs", "/var/log/job")).digest == container.digest


def test_mounts_are_exactly_the_run_directories_never_a_parent():
    """--log-dir /tmp/x mounts /tmp/x (not the host's /tmp); nothing else of
    the host is visible but the image's read-only mounts and user volumes."""
    w = [LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,))]
    host = _host(run_dir="/tmp/kaitian-0/r.1.abc", image_mounts=(Mount("/usr", "/usr", True),))
    container = container_spec("cpu0", w, host, DockerOptions(), ("/tmp/x",))
    mounts = {m.target: m for m in container.mounts}
    assert sorted(mounts) == ["/home/u/proj", "/tmp/kaitian-0/r.1.abc", "/tmp/x", "/usr"]
    assert all(m.source == m.target for m in mounts.values())
    assert mounts["/usr"].read_only and not mounts["/tmp/x"].read_only
    assert mounts["/usr"].to_docker() == {"Type": "bind", "Source": "/usr", "Target": "/usr", "ReadOnly": True}


def test_the_root_directory_is_never_mounted():
    w = [LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,))]
    with pytest.raises(DockerOptionError, match="not /"):
        container_spec("cpu0", w, _host(run_dir="/tmp/kaitian-0/r", cwd="/"), DockerOptions())


@pytest.mark.parametrize("user,asked,caps", [
    ("1000:1000", None, []),  # a user's agent, or sudo in a user's project
    ("0:0", None, []),  # a root agent in a root-owned directory: root, gaining nothing
    ("0:0", "root", ["DAC_OVERRIDE"]),  # --container-user root: writes a user agent's directories
])
def test_containers_are_hardened(user, asked, caps):
    options = DockerOptions.from_flags(container_user=asked)
    kw = _container([LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,))],
               options=options, user=user).create_kwargs()
    assert kw["cap_drop"] == ["ALL"] and kw["cap_add"] == caps
    assert kw["security_opt"] == ["no-new-privileges"]
    assert kw["read_only"] is True and list(kw["tmpfs"]) == ["/tmp"]
    assert kw["user"] == user and kw["privileged"] is False


def test_worker_user_is_the_agent_unless_asked():
    assert choose_user(None, 1000, 1001, (0, 0)) == "1000:1001"  # a user's agent: that user
    assert choose_user(None, 0, 0, (1000, 100)) == "1000:100"  # sudo in a user's project: its owner
    assert choose_user(None, 0, 0, (0, 0)) == "0:0"  # root in root's directory: the agent, as local workers
    assert choose_user("0:0", 1000, 1000, (1000, 1000)) == "0:0"  # root for a user's agent only when asked
    assert choose_user("5:6", 0, 0, (0, 0)) == "5:6"


def test_run_path_entrypoint_becomes_python_in_the_container(tmp_path):
    from torch.distributed.run import run_script_path

    from kaitian.launcher.runtimes.docker.start import as_binary as _as_binary

    script = tmp_path / "s.py"
    out = tmp_path / "argv.txt"
    script.write_text(f"import sys; open({str(out)!r}, 'w').write(repr(sys.argv)) if __name__ == '__main__' else None\n")
    binary, args = _as_binary(run_script_path, {0: (str(script), "--lr", "0.1")})
    assert binary == sys.executable
    subprocess.run([binary, *args[0]], check=True, timeout=60)
    assert out.read_text() == repr([str(script), "--lr", "0.1"])
    with pytest.raises(DockerOptionError, match="not Python functions"):
        _as_binary(print, {0: ()})


def test_path_containment_is_by_component_not_by_prefix():
    from kaitian.launcher.runtimes.docker.start import inside, outermost

    assert inside("/a/b", "/a") and inside("/a", "/a") and inside("/a/b", "/a/")
    assert not inside("/ab", "/a") and not inside("/a", "/a/b")
    assert sorted(outermost(["/a/b/c", "/x", "/a", "/ab", "/a/b"])) == ["/a", "/ab", "/x"]


def test_a_worker_seen_ended_by_the_engine_keeps_the_output_its_stream_still_carries(tmp_path):
    """The Engine may report a worker's exit before its output stream is drained
    (a CPU-starved agent): the last lines still reach its log (CI on c46cb40 lost
    "crash-log from rank 1" of a failed job's kept logs)."""
    from types import SimpleNamespace

    from kaitian.launcher.runtimes.docker.exec import _Exec

    release = threading.Event()

    def stream():
        release.wait(10)  # the output arrives after the Engine already says "exited"
        yield b"last words\n", None

    api = SimpleNamespace(
        exec_create=lambda *a, **k: {"Id": "exec-1"},
        exec_start=lambda *a, **k: stream(),
        exec_inspect=lambda _id: {"Running": False, "ExitCode": 3, "Pid": 4242},
    )
    (tmp_path / "pid").write_text("42")
    spec = SimpleNamespace(cmd=["true"], env={}, workdir="/", user="0:0", local_rank=1,
                           pid_file=str(tmp_path / "pid"))
    ex = _Exec(SimpleNamespace(api=api), "container", spec, str(tmp_path / "out.log"), str(tmp_path / "err.log"), "")
    ex.thread.start()
    assert ex.started.wait(10)
    threading.Timer(0.5, release.set).start()
    ex.poll_engine()  # the agent's periodic question, while the stream still carries output
    assert ex.done.is_set() and ex.exit_code == 3
    assert (tmp_path / "out.log").read_text() == "last words\n"
