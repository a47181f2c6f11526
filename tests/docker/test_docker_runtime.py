"""The docker runtime against a real Docker engine, driven directly (as the agent
drives it): containers per group, docker exec workers, logs, error files,
signals, stale containers and the errors users meet."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from dataclasses import replace

import pytest
import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

from support import REPO, TESTS, worker
from support.docker import TEST_IMAGE, WORKER_UID, engine, inspect, kaitian_containers, own, test_image
from kaitian.errors import DockerRuntimeError, DockerUnavailableError, ImageNotFoundError
from kaitian.devices.device import WorkerDevice
from kaitian.launcher.workers import LocalWorker
from kaitian.launcher.runtimes.base import RunContext, WorkerStart
from kaitian.launcher.runtimes.docker.runtime import connect
from kaitian.launcher.runtimes.docker.runtime import DockerRuntime
from kaitian.launcher.runtimes.docker.options import DockerOptions
from kaitian.launcher.runtimes.options import RuntimeOptions
from kaitian.settings import Settings

WORKER = worker("docker_runtime")


@pytest.fixture(scope="module")
def image():
    return test_image()


@pytest.fixture
def run(tmp_path, image):
    """Builds runtimes for one test and removes whatever they left."""
    made = []

    def make(images=None, hand_over=True, cpu_quotas=None, **options):
        run_id = f"t{uuid.uuid4().hex[:8]}"
        run_dir = tmp_path / "run"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        ctx = RunContext(
            run_id=run_id, run_dir=str(run_dir), log_dir=None,
            cwd=own(str(tmp_path)) if hand_over else str(tmp_path),
            options=RuntimeOptions(own={"docker": DockerOptions(images=images or {"cpu": image}, **options)}),
            cpu_quotas=cpu_quotas or {},
        )
        rt = DockerRuntime(ctx)
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.shutdown()
        for c in kaitian_containers(run_id=rt.ctx.run_id):
            c.remove(force=True)


def _start(rt, tmp_path, workers, mode, extra_env=None, redirects=Std.ALL, tee=Std.NONE, log_dir=None):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    if os.stat(rt.ctx.cwd).st_uid == WORKER_UID:  # handed to the workers: so is out
        own(str(out))
    envs = {}
    for r, w in workers.items():
        envs[r] = {
            **os.environ,
            "PATH": "/host-only-marker:" + os.environ["PATH"],
            "PYTHONPATH": f"{REPO}:{TESTS}",
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(len(workers)),
            **Settings.for_device(w.device).to_env(),
            "TORCHELASTIC_RUN_ID": rt.ctx.run_id, "TORCHELASTIC_RESTART_COUNT": "0",
            "DOCKER_TEST_MODE": mode, "DOCKER_TEST_OUT": str(out),
            "JOB_VARIABLE": f"passed-{r}",
            **(extra_env or {}),
        }
    logs = DefaultLogsSpecs(log_dir=str(log_dir or tmp_path / "logs"), redirects=redirects, tee=tee)
    pc = rt.start(WorkerStart(
        name="trainer", entrypoint=sys.executable,
        args={r: ("-u", WORKER) for r in workers}, envs=envs, logs_specs=logs, workers=workers,
        log_line_prefixes={r: f"[{w.device.group}]:{r}: " for r, w in workers.items()},
    ))
    return pc, out


def _two_groups():
    return {
        0: LocalWorker(0, WorkerDevice("cpu", 0, "cpu0"), (0,)),
        1: LocalWorker(1, WorkerDevice("cpu", 1, "cpu1"), (1,)),
    }


def _cpu_cgroup(proc_cgroup: str) -> str:
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return ""


def _read(out, name, rank):
    with open(out / f"{name}.{rank}.json") as f:
        return json.load(f)


def _wait_file(path, timeout=60):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            pytest.fail(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)


def test_one_container_per_group_with_exact_access_env_and_logs(run, tmp_path):
    rt = run(shm_size="256m", cpu_quotas={"cpu1": 0.5})
    pc, out = _start(rt, tmp_path, _two_groups(), "env")
    try:
        host_pids = pc.pids()
        result = pc.wait(120, period=0.1)
        assert result is not None and not result.is_failed(), result
    finally:
        pc.close()

    containers = {c.labels["org.kaitian.group"]: c for c in kaitian_containers(run_id=rt.ctx.run_id)}
    assert sorted(containers) == ["cpu0", "cpu1"]
    for group, c in containers.items():
        c.reload()
        hc = c.attrs["HostConfig"]
        assert c.status == "running" and c.image.tags == [TEST_IMAGE]
        assert c.labels["org.kaitian.vendor"] == "cpu"
        assert c.labels["org.kaitian.agent-pid"] == str(os.getpid())
        assert hc["NetworkMode"] == "host" and hc["IpcMode"] == "host"
        assert hc["Privileged"] is False and hc["Init"] is True
        assert hc["ShmSize"] == 256 * 2**20
        assert hc["CpusetCpus"] == group[-1]  # slot cpu0 -> core 0, cpu1 -> core 1
        assert hc["CpuShares"] == 1024  # one worker each
        _assert_hardened(c, image_mounts=engine().images.get(TEST_IMAGE).labels["org.kaitian.host-mounts"])
        # the run and log directories are inside the working directory: one mount
        assert _own_mounts(c) == [str(tmp_path)]
    # half a core in the local runtime's 10 ms periods: as uniformly slow as a local worker
    assert containers["cpu1"].attrs["HostConfig"]["CpuQuota"] == 5_000
    assert containers["cpu1"].attrs["HostConfig"]["CpuPeriod"] == 10_000
    assert containers["cpu0"].attrs["HostConfig"]["CpuQuota"] == 0

    own_ns = {k: os.readlink(f"/proc/self/ns/{k}") for k in ("net", "ipc", "mnt")}
    for rank in (0, 1):
        info = _read(out, "env", rank)
        env = info["env"]
        assert env["RANK"] == str(rank) and env["JOB_VARIABLE"] == f"passed-{rank}"
        assert env["KAITIAN_GROUP"] == f"cpu{rank}"
        assert "/host-only-marker" not in env["PATH"]  # the image's PATH, not the host's
        assert info["pid"] == info["pgid"]  # its own process group
        assert info["uid"] == WORKER_UID != 0 and info["cwd"] == str(tmp_path)  # not root
        assert env["HOME"] == "/tmp"
        # the agent's Python environment (a venv's or conda env's, not its base interpreter)
        assert info["prefix"] == sys.prefix and info["executable"] == os.path.abspath(sys.executable)
        assert env.get("VIRTUAL_ENV") == (sys.prefix if sys.prefix != sys.base_prefix else "")  # activated
        assert info["affinity"] == [rank]
        assert info["hostname_ns"] == own_ns["net"] and info["ipc_ns"] == own_ns["ipc"]
        assert info["mnt_ns"] != own_ns["mnt"]  # really inside a container
        assert containers[f"cpu{rank}"].id in _cpu_cgroup(info["cgroup"])
        if engine().info().get("CgroupDriver") == "cgroupfs" and str(engine().info().get("CgroupVersion")) == "1":
            # created in the agent's cgroup, so it competes for CPU as local workers do
            mine = _cpu_cgroup(open("/proc/self/cgroup").read())
            assert _cpu_cgroup(info["cgroup"]) == os.path.join(mine, containers[f"cpu{rank}"].id)
        assert host_pids[rank] > 0 and host_pids[rank] != info["pid"]
        assert f"hello from rank {rank}" in open(pc.stdouts[rank]).read()
        assert f"warning from rank {rank}" in open(pc.stderrs[rank]).read()

    # A restart reuses the group's container.
    ids = {g: c.id for g, c in containers.items()}
    pc2, _ = _start(rt, tmp_path, _two_groups(), "env")
    try:
        assert not pc2.wait(120, period=0.1).is_failed()
    finally:
        pc2.close()
    again = {c.labels["org.kaitian.group"]: c.id for c in kaitian_containers(run_id=rt.ctx.run_id)}
    assert again == ids

    rt.shutdown()
    assert kaitian_containers(run_id=rt.ctx.run_id) == []


def _own_mounts(container):
    """Bind mounts other than the image's (read-only host Python) ones."""
    return sorted(m["Destination"] for m in inspect(container)["Mounts"] if m["RW"])


def _assert_hardened(container, image_mounts, user=f"{WORKER_UID}:{WORKER_UID}"):
    """What `docker inspect` must show for every container kaitian creates."""
    attrs = inspect(container)
    hc, config = attrs["HostConfig"], attrs["Config"]
    assert hc["CapDrop"] == ["ALL"] and not hc["CapAdd"]
    assert "no-new-privileges" in hc["SecurityOpt"]  # (the engine adds label=disable for host IPC)
    assert hc["ReadonlyRootfs"] is True and "/tmp" in hc["Tmpfs"]
    assert config["User"] == user
    # tied to the agent: stdin held by the agent's attach, removed when it stops
    assert hc["AutoRemove"] is True and config["OpenStdin"] is True and config["StdinOnce"] is True
    declared = {spec.split(":")[1] for spec in image_mounts.split(",") if spec}
    read_only = {m["Destination"] for m in attrs["Mounts"] if not m["RW"]}
    assert read_only == declared  # exactly the image's host paths, all read-only
    for m in attrs["Mounts"]:
        assert m["Destination"] not in ("/", "/tmp", "/root", "/home", os.path.expanduser("~")), m


def test_mounts_are_exactly_the_run_directories_never_their_parents(run, tmp_path, tmp_path_factory):
    """A run directory and a log directory outside the working directory are
    mounted themselves: --log-dir /tmp/x mounts /tmp/x, not the host's /tmp."""
    rt = run()
    run_dir = tmp_path_factory.mktemp("elsewhere-run")
    log_dir = own(str(tmp_path_factory.mktemp("elsewhere-logs")))
    rt.ctx = replace(rt.ctx, run_dir=str(run_dir), log_dir=log_dir)
    pc, _ = _start(rt, tmp_path, _two_groups(), "fail", log_dir=log_dir)
    try:
        result = pc.wait(120, period=0.1)
    finally:
        pc.close()
    # the worker (not root) wrote its error file into the mounted log directory
    assert result.failures[1].error_file.startswith(log_dir)
    assert "deliberate failure" in result.failures[1].message["message"]
    for c in kaitian_containers(run_id=rt.ctx.run_id):
        assert _own_mounts(c) == sorted([str(tmp_path), str(run_dir), log_dir])


def test_console_lines_carry_rank_prefixes(run, tmp_path, capfd):
    rt = run()
    pc, _ = _start(rt, tmp_path, _two_groups(), "env", redirects=Std.NONE)
    try:
        assert not pc.wait(120, period=0.1).is_failed()
    finally:
        pc.close()
    captured = capfd.readouterr()
    assert "[cpu0]:0: hello from rank 0" in captured.out
    assert "[cpu1]:1: hello from rank 1" in captured.out
    assert "[cpu1]:1: warning from rank 1" in captured.err


def test_failure_reports_exit_code_and_error_file_from_the_container(run, tmp_path):
    rt = run()
    pc, _ = _start(rt, tmp_path, _two_groups(), "fail")
    try:
        result = pc.wait(120, period=0.1)
    finally:
        pc.close()
    assert result.is_failed() and 1 in result.failures
    # rank 0 either finished first or was stopped because rank 1 failed
    assert 0 not in result.failures or result.failures[0].exitcode == -signal.SIGTERM
    failure = result.failures[1]
    assert failure.exitcode == 1
    assert failure.error_file.startswith(str(tmp_path / "logs"))
    assert "deliberate failure on rank 1" in failure.message["message"]


@pytest.mark.parametrize("mode,expected", [("sleep", -signal.SIGTERM), ("ignore-term", -signal.SIGKILL)])
def test_close_stops_whole_process_groups_inside_the_container(run, tmp_path, mode, expected):
    rt = run()
    pc, out = _start(rt, tmp_path, _two_groups(), mode)
    try:
        for rank in (0, 1):
            _wait_file(out / f"sleep.{rank}.json")
        containers = kaitian_containers(run_id=rt.ctx.run_id)
        assert all(len(c.top()["Processes"]) >= 4 for c in containers)  # init, idle, worker, child
        began = time.monotonic()
        pc.close(signal.SIGTERM, timeout=2)
        took = time.monotonic() - began
        result = pc._poll()
    finally:
        pc.close()
    assert result.is_failed()
    assert {f.exitcode for f in result.failures.values()} == {expected}
    if mode == "ignore-term":
        assert took >= 2  # TERM first, KILL only after the timeout
    for c in containers:
        procs = [p[-1] for p in c.top()["Processes"]]
        assert len(procs) == 2, procs  # only docker-init and the idle sleep are left
    assert kaitian_containers(run_id=rt.ctx.run_id)  # containers outlive a worker group


def test_a_signal_while_the_workers_start_stops_them_and_their_log_threads(run, tmp_path, monkeypatch):
    """Ctrl-C while torch starts the log tails (the workers already run): the
    agent never gets the context, so the runtime must close it, or the tails
    keep the agent from exiting and the workers keep running (seen in CI)."""
    from torch.distributed.elastic.multiprocessing import tail_log
    from torch.distributed.elastic.multiprocessing.api import SignalException

    started = tail_log.TailLog.start
    calls = []

    def start_then_signal(self):
        calls.append(self)
        if len(calls) == 2:  # the first tail's threads run: the signal lands here
            raise SignalException("got signal: 2", sigval=signal.SIGINT)
        return started(self)

    monkeypatch.setattr(tail_log.TailLog, "start", start_then_signal)
    rt = run()
    try:
        with pytest.raises(SignalException):
            _start(rt, tmp_path, _two_groups(), "sleep", tee=Std.ALL)
    finally:
        left = [t.name for t in threading.enumerate() if t.name.startswith("TailLog")]
        for tail in calls[:1]:  # (stop is idempotent) so that a failure here does not hang pytest's exit
            tail.stop()
    assert len(calls) == 2
    assert not left
    for c in kaitian_containers(run_id=rt.ctx.run_id):
        procs = [p[-1] for p in c.top()["Processes"]]
        assert len(procs) == 2, procs  # only docker-init and the idle sleep are left


def test_shared_memory_and_host_network_work_across_containers(run, tmp_path):
    rt = run()
    shm_name = f"kaitian-test-{uuid.uuid4().hex[:8]}"
    pc, out = _start(rt, tmp_path, _two_groups(), "shm", {"DOCKER_TEST_SHM": shm_name})
    try:
        assert not pc.wait(120, period=0.1).is_failed()
    finally:
        pc.close()
    assert _read(out, "shm", 0) == {"ok": True} and _read(out, "shm", 1) == {"ok": True}
    assert not os.path.exists(f"/dev/shm/{shm_name}")

    with socket.socket() as s:  # a free port for the TCP store (host network)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pc, out = _start(rt, tmp_path, _two_groups(), "gloo",
                     {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        assert not pc.wait(180, period=0.1).is_failed()
    finally:
        pc.close()
    assert _read(out, "gloo", 1) == {"sum": [3.0] * 4, "world": 2}


def test_removing_containers_removes_the_shared_memory_their_workers_left(run, tmp_path):
    rt = run()
    pc, out = _start(rt, tmp_path, _two_groups(), "segment")
    try:
        for rank in (0, 1):
            _wait_file(out / f"segment.{rank}.json")
        names = [_read(out, "segment", rank)["name"] for rank in (0, 1)]
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
    finally:
        pc.close(timeout=5)
    rt.shutdown()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names), names
    assert kaitian_containers(run_id=rt.ctx.run_id) == []


_KILLED_AGENT = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = [{repo!r}, {tests!r}, {here!r}]
    import test_docker_runtime as t
    from kaitian.launcher.runtimes.base import RunContext
    from kaitian.launcher.runtimes.docker.runtime import DockerRuntime
    from kaitian.launcher.runtimes.docker.options import DockerOptions
    from kaitian.launcher.runtimes.options import RuntimeOptions
    import pathlib
    from kaitian.launcher.rundir import RunDir
    tmp = pathlib.Path({tmp!r})
    run_dir = RunDir({run_id!r})  # a real one: the next start collects it
    ctx = RunContext(run_id={run_id!r}, run_dir=run_dir.path, log_dir=None, cwd=str(tmp),
                     options=RuntimeOptions(own={{"docker": DockerOptions(images={{"cpu": {image!r}}})}}))
    pc, out = t._start(DockerRuntime(ctx), tmp, t._two_groups(), "segment")
    print(run_dir.path, flush=True)
    time.sleep(300)
""")


def _gone_within(seconds, check):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def test_containers_die_with_their_agent_killed_by_sigkill(tmp_path, image):
    """No orphans: the containers hold the agent's stdin attach, so a SIGKILL'd
    agent takes them and their workers down within seconds; the next start
    finds no container to collect, and removes the run directory and the
    shared memory the workers left in the host's IPC namespace."""
    from kaitian.launcher import rundir

    run_id = f"t{uuid.uuid4().hex[:8]}"
    own(str(tmp_path))
    code = _KILLED_AGENT.format(repo=REPO, tests=TESTS, here=os.path.dirname(os.path.abspath(__file__)),
                                tmp=str(tmp_path), run_id=run_id, image=image)
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        run_dir = agent.stdout.readline().strip()
        assert os.path.isdir(run_dir), run_dir
        for rank in (0, 1):
            _wait_file(tmp_path / "out" / f"segment.{rank}.json")
        segments = [_read(tmp_path / "out", "segment", rank)["name"] for rank in (0, 1)]
        left = kaitian_containers(run_id=run_id)
        assert len(left) == 2 and {c.labels["org.kaitian.agent-pid"] for c in left} == {str(agent.pid)}
        # A live agent's containers are not stale.
        assert not set(DockerRuntime.collect_stale()) & {c.name for c in left}
        agent.kill()
        agent.wait()
        assert _gone_within(5, lambda: kaitian_containers(run_id=run_id) == []), kaitian_containers(run_id=run_id)
        assert _gone_within(5, lambda: WORKER not in subprocess.run(
            ["ps", "-eo", "args"], capture_output=True, text=True).stdout)
        assert DockerRuntime.collect_stale() == []  # no container left for the next start
        # The segments (host IPC) outlive the container; the next start removes
        # them with the run directory. (Another kaitianrun starting on this host
        # meanwhile may be that next start: check the outcome, not who did it.)
        rundir.collect_stale()
        assert not os.path.exists(run_dir)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in segments)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for c in kaitian_containers(run_id=run_id):
            c.remove(force=True)


def test_untied_containers_of_a_dead_agent_are_collected_at_next_start(image):
    """An agent killed between creating a container and tying it leaves it
    behind; the next start removes it (and leaves live agents' and kept ones)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    labels = {"org.kaitian.managed": "1", "org.kaitian.keep": "0", "org.kaitian.run-id": "stale-test",
              "org.kaitian.agent-host": socket.gethostname(), "org.kaitian.agent-pid": str(dead.pid),
              "org.kaitian.agent-start": "1"}
    stale = engine().containers.create(image, ["sleep", "infinity"], labels=labels, detach=True)
    kept = engine().containers.create(image, ["sleep", "infinity"], detach=True,
                                      labels={**labels, "org.kaitian.keep": "1", "org.kaitian.run-id": "kept-test"})
    try:
        assert stale.name in DockerRuntime.collect_stale()
        assert kaitian_containers(run_id="stale-test") == []
        assert kaitian_containers(run_id="kept-test")
    finally:
        for c in (stale, kept):
            try:
                c.remove(force=True)
            except Exception:  # noqa: BLE001 (removed by the test already)
                pass


def test_missing_image_is_one_clear_line_and_creates_nothing(run, tmp_path):
    rt = run(images={"cpu": "kaitian-test:does-not-exist"})
    with pytest.raises(ImageNotFoundError) as err:
        _start(rt, tmp_path, _two_groups(), "env")
    message = str(err.value)
    assert "\n" not in message and "kaitian-test:does-not-exist" in message
    assert "kaitian images build" in message
    assert kaitian_containers(run_id=rt.ctx.run_id) == []


def test_cuda_group_requests_exactly_its_gpu_from_the_engine(run, tmp_path):
    """A CUDA group gets its GPUs through an NVIDIA device request. On an engine
    without the NVIDIA toolkit (CI) that fails at start, cleanly, saying what to
    install; with it, the container carries exactly the selected GPU."""
    rt = run(images={"cuda": TEST_IMAGE})
    workers = {0: LocalWorker(0, WorkerDevice("cuda", 0, "cuda"))}
    if "nvidia" not in (engine().info().get("Runtimes") or {}):
        with pytest.raises(DockerRuntimeError) as err:
            _start(rt, tmp_path, workers, "env")
        message = str(err.value)
        assert "\n" not in message and "group 'cuda'" in message
        assert 'device driver "nvidia"' in message and "NVIDIA container toolkit" in message
        assert kaitian_containers(run_id=rt.ctx.run_id) == []
        return
    pc, _ = _start(rt, tmp_path, workers, "env")
    pc.close()
    (container,) = kaitian_containers(run_id=rt.ctx.run_id)
    (request,) = container.attrs["HostConfig"]["DeviceRequests"]
    assert request["Driver"] == "nvidia" and request["DeviceIDs"] == ["0"]  # no UUID known: by index


def test_unreachable_daemon_and_socket_permission_are_clear(tmp_path):
    import docker

    client = docker.DockerClient(base_url=f"unix://{tmp_path}/no-such-docker.sock", version="1.41")
    ctx = RunContext(run_id="x", run_dir=str(tmp_path), log_dir=None, cwd=str(tmp_path))
    with pytest.raises(DockerUnavailableError, match="cannot reach the Docker daemon") as err:
        _start(DockerRuntime(ctx, client=client), tmp_path, _two_groups(), "env")
    assert "\n" not in str(err.value)

    # A socket this user may not open (a non-root user outside the docker group).
    class _Refused:
        def ping(self):
            raise docker.errors.DockerException(
                "Error while fetching server API version: ('Connection aborted.', "
                "PermissionError(13, 'Permission denied'))")

    with pytest.raises(DockerUnavailableError, match="docker' group"):
        connect(_Refused())


def test_images_build_streams_progress_and_fails_clearly_without_a_registry(capsys, image):
    from kaitian.commands import images

    tag = "kaitian-test:cpu-host-progress"
    try:
        assert images.main(["cpu-host", "-t", tag]) == 0
        out = capsys.readouterr().out
        assert "Step 1/" in out and f"built {tag}" in out
        labels = engine().images.get(tag).labels
        assert "/usr:/usr:ro" in labels["org.kaitian.host-mounts"].split(",")
        assert os.path.isabs(labels["org.kaitian.python"])
    finally:
        engine().images.remove(tag, force=True)

    # The real CPU image needs its base image from a registry, which CI cannot reach.
    assert images.main(["cpu", "-t", "kaitian-test:cpu-from-registry"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "base image cannot be pulled" in err[0]
    assert images.main(["gpu"]) == 2
    assert "unknown image 'gpu'" in capsys.readouterr().err


def test_workers_are_the_agent_in_its_own_working_directory(run, tmp_path):
    """The drop-in promise: in a working directory the agent owns (root's, for a
    root agent), workers run as the agent and write their checkpoints there as
    local workers would - without gaining anything: no capability, no new
    privileges, a read-only root file system."""
    rt = run(hand_over=False)
    pc, out = _start(rt, tmp_path, {0: _two_groups()[0]}, "checkpoint")
    try:
        assert not pc.wait(120, period=0.1).is_failed(), open(pc.stderrs[0]).read()[-2000:]
    finally:
        pc.close()
    info = _read(out, "env", 0)
    assert (info["uid"], info["gid"]) == (os.getuid(), os.getgid()) and info["cwd"] == str(tmp_path)
    assert torch.load(tmp_path / "checkpoint.0.pt") == {"step": 1}
    (c,) = kaitian_containers(run_id=rt.ctx.run_id)
    host = inspect(c)["HostConfig"]
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert "no-new-privileges" in host["SecurityOpt"] and host["ReadonlyRootfs"] and not host["Privileged"]


def test_root_only_when_asked(run, tmp_path):
    """--container-user root: workers are root, with DAC_OVERRIDE as their only
    capability; everything else about the container stays hardened."""
    rt = run(user="0:0")
    pc, out = _start(rt, tmp_path, {0: _two_groups()[0]}, "env")
    try:
        assert not pc.wait(120, period=0.1).is_failed()
    finally:
        pc.close()
    assert _read(out, "env", 0)["uid"] == 0
    (c,) = kaitian_containers(run_id=rt.ctx.run_id)
    attrs = inspect(c)
    assert attrs["Config"]["User"] == "0:0"
    assert attrs["HostConfig"]["CapDrop"] == ["ALL"]
    assert [cap.replace("CAP_", "") for cap in attrs["HostConfig"]["CapAdd"]] == ["DAC_OVERRIDE"]
    assert "no-new-privileges" in attrs["HostConfig"]["SecurityOpt"] and attrs["HostConfig"]["ReadonlyRootfs"]
