"""`kaitianrun --runtime docker` end to end, as a user runs it, on a real engine:
parity with the local runtime, restarts, Ctrl-C, and a missing image."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from support import REPO, repo_env, worker
from support.conda_env import conda_activation, conda_style_env
from support.docker import WORKER_UID, engine, inspect, kaitian_containers, own, run_agent, test_image
from support.kept_logs import RUN_BASE, assert_logs_kept_after_failure, remove_new_kept_logs, run_dirs

SCRIPT = worker("docker_train")


def _kaitianrun():
    # This interpreter's kaitianrun (a venv's, say), never another one on PATH.
    return [sys.executable, "-m", "kaitian.launcher.cli"]


@pytest.fixture(scope="module")
def image():
    return test_image()


@pytest.fixture(autouse=True)
def _workers_own_the_working_directory(tmp_path):
    own(str(tmp_path))
    before = set(os.listdir(RUN_BASE)) if os.path.isdir(RUN_BASE) else set()
    yield
    remove_new_kept_logs(before)  # failing runs keep their logs; not the tests'


def _env(out, mode, **extra):
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")])),
        "DOCKER_E2E_OUT": str(out),
        "DOCKER_E2E_MODE": mode,
        "OMP_NUM_THREADS": "1",
    })
    env.update(extra)
    return env


def _args(runtime, image, *flags):
    args = ["--standalone", "--nproc-per-node", "2", "--cpu-groups", "2", "--monitor-interval", "0.2",
            "--runtime", runtime]
    if runtime == "docker":
        args += ["--image", f"cpu={image}"]
    return args + list(flags) + [SCRIPT]


def _records(out, name):
    found = {}
    for path in glob.glob(os.path.join(out, f"{name}.*.json")):
        _, rank, attempt, _ = os.path.basename(path).split(".")
        with open(path) as f:
            found[(int(rank), int(attempt))] = json.load(f)
    return found


def _wait_records(out, name, count, proc, timeout=120):
    deadline = time.time() + timeout
    while len(_records(out, name)) < count:
        if proc.poll() is not None:
            pytest.fail(f"kaitianrun exited ({proc.returncode}) before its workers started:\n"
                        f"{proc.stderr.read() if proc.stderr else ''}")
        if time.time() > deadline:
            pytest.fail(f"workers did not start within {timeout}s")
        time.sleep(0.1)
    return _records(out, name)


def _no_workers_left():
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return SCRIPT not in ps


def test_training_in_two_containers_matches_local_runtime(tmp_path, image):
    """Two simulated vendor groups, each in its own container, bridged through
    shared memory by the kaitian backend, train to the same parameters as the
    same job under the local runtime."""
    params = {}
    where = {}
    for runtime in ("local", "docker"):
        out = tmp_path / runtime
        own(str(out))
        proc = run_agent(
            _kaitianrun() + _args(runtime, image), env=_env(out, "train", DOCKER_E2E_BACKEND=os.environ.get("DOCKER_E2E_BACKEND", "kaitian")),
            cwd=str(tmp_path), timeout=240,
        )
        assert proc.returncode == 0, f"{runtime}: {proc.stderr[-3000:]}"
        params[runtime] = torch.load(out / "params.pt")
        where[runtime] = _records(out, "where")
    for name, value in params["local"].items():
        assert torch.equal(value, params["docker"][name]), name
    assert all(not r["container"] for r in where["local"].values())
    containers = {r["group"]: r["container"] for r in where["docker"].values()}
    assert sorted(containers) == ["cpu0", "cpu1"]
    assert all(containers.values()) and len(set(containers.values())) == 2
    if os.environ.get("DOCKER_E2E_BACKEND", "kaitian") == "kaitian":
        # the groups met through shared memory across the containers, not TCP
        setups = _records(tmp_path / "docker", "setup")
        assert len(setups) == 2
        for rank_attempt, setup in setups.items():
            assert any("bridge shm" in line for line in setup["lines"]), (rank_attempt, setup)
    assert kaitian_containers(agent_pid=proc.pid) == []  # (the docker run's; other tests' may be running)


def test_cpu_host_image_from_a_conda_env_trains_in_that_env(tmp_path):
    """kaitian installed in a conda env (its own interpreter, libpython beside it,
    no venv): the cpu-host image built from that env mounts it, and both groups'
    containers train with the env's interpreter and packages, activated as
    conda left it, to the parameters the local runtime reaches."""
    prefix = str(tmp_path / "envs" / "kt")
    python = conda_style_env(prefix)
    env = conda_activation(prefix, _env(tmp_path, "train", DOCKER_E2E_BACKEND="kaitian"))
    tag = "kaitian-test:cpu-host-conda"
    built = subprocess.run([python, "-m", "kaitian", "images", "build", "cpu-host", "-t", tag],
                           env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    try:
        params = {}
        for runtime in ("local", "docker"):
            out = own(str(tmp_path / runtime))
            proc = run_agent([python, "-m", "kaitian.launcher.cli", *_args(runtime, tag)],
                        env={**env, "DOCKER_E2E_OUT": out}, cwd=str(tmp_path), timeout=240)
            assert proc.returncode == 0, f"{runtime}: {proc.stderr[-3000:]}"
            params[runtime] = torch.load(os.path.join(out, "params.pt"))
        where = _records(tmp_path / "docker", "where")
        assert len(where) == 2
        for record in where.values():
            assert record["container"]
            assert record["prefix"] == prefix and record["executable"] == python
            assert record["conda_prefix"] == prefix
        for name, value in params["local"].items():
            assert torch.equal(value, params["docker"][name]), name
    finally:
        engine().images.remove(tag, force=True)
    assert kaitian_containers(agent_pid=proc.pid) == []  # (the docker run's; other tests' may be running)


def test_worker_killed_inside_its_container_is_restarted(tmp_path, image):
    out = tmp_path / "out"
    own(str(out))
    proc = subprocess.Popen(
        _kaitianrun() + _args("docker", image, "--max-restarts", "1"), env=_env(out, "restart"),
        cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        first = _wait_records(out, "where", 2, proc)
        victim = next(r for (rank, _), r in first.items() if rank == 1)
        (container,) = [c for c in kaitian_containers(agent_pid=proc.pid, group=victim["group"])]
        # Kill the worker from inside its container, as an OOM kill or a crash would.
        result = container.exec_run(["kill", "-9", str(victim["pid"])])
        assert result.exit_code == 0, result.output
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    attempts = _records(out, "where")
    assert {(0, 1), (1, 1)} <= set(attempts), sorted(attempts)  # both ranks ran again
    # the restarted group ran in the same containers
    assert attempts[(1, 1)]["container"] == victim["container"]
    assert kaitian_containers(agent_pid=proc.pid) == []
    assert _no_workers_left()


def test_failed_job_removes_its_containers_and_keeps_its_logs(tmp_path, image):
    """-r 3, no --log-dir: the workers' output (written from their containers)
    survives the failed run at the printed path; the containers do not."""
    out = tmp_path / "out"
    own(str(out))
    proc = subprocess.Popen(
        _kaitianrun() + _args("docker", image, "-r", "3"), env=_env(out, "crash"), cwd=str(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr[-2000:]
    assert "exitcode  : 3" in stderr  # torchrun's root-cause summary
    assert len(_records(out, "where")) == 2  # both ran, in containers
    assert kaitian_containers(agent_pid=proc.pid) == []
    assert_logs_kept_after_failure(proc, stderr)


def _ctrl_c(tmp_path, argv, env, ready):
    """Starts the agent ``argv``, sends its process group SIGINT (a terminal's Ctrl-C) once
    ``ready(agent)``, and checks that it stops within 90 s and leaves no container and no worker."""
    proc = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        ready(proc)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"kaitianrun did not stop within 90 s of Ctrl-C:\n{proc.communicate()[1][-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert kaitian_containers(agent_pid=proc.pid) == []
    assert _no_workers_left()


def test_ctrl_c_leaves_no_container_and_no_process(tmp_path, image):
    out = tmp_path / "out"
    own(str(out))

    def workers_run(proc):
        _wait_records(out, "where", 2, proc)
        assert len(kaitian_containers(agent_pid=proc.pid)) == 2

    _ctrl_c(tmp_path, _kaitianrun() + _args("docker", image), _env(out, "wait"), workers_run)


@pytest.mark.parametrize("call", ["create_container", "exec_inspect"])
def test_ctrl_c_while_the_agent_waits_for_a_slow_engine_still_stops_the_job(tmp_path, image, call):
    """The engine answers ``call`` 3 s late. create_container: a container exists whose id the
    agent never got. exec_inspect (its monitoring, once the workers run): the agent tolerates an
    engine error there, and torch's handler raises the signal as an ``Exception``."""
    out, answered = tmp_path / "out", tmp_path / "answered"
    own(str(out))
    env = repo_env(_env(out, "wait"), SLOW_ENGINE_CALL=call, SLOW_ENGINE_MARKER=str(answered), SLOW_ENGINE_S="3")

    def waits_for_the_answer(proc):
        deadline = time.time() + 60
        while not answered.exists():
            assert proc.poll() is None and time.time() < deadline, f"the agent never called {call}"
            time.sleep(0.05)
        time.sleep(0.5)  # well inside the wait

    _ctrl_c(tmp_path, [sys.executable, "-m", "support.slow_engine"] + _args("docker", image), env,
            waits_for_the_answer)


def test_keep_containers_are_reused_by_the_next_run(tmp_path, image):
    used = []
    pids = []
    try:
        for attempt in range(2):
            out = tmp_path / f"run{attempt}"
            own(str(out))
            proc = run_agent(
                _kaitianrun() + _args("docker", image, "--keep-containers"), env=_env(out, "crash"),
                cwd=str(tmp_path), timeout=120,
            )
            pids.append(str(proc.pid))
            assert proc.returncode == 1, proc.stderr[-2000:]  # rank 1 exits 3; the containers stay
            used.append({r["group"]: r["container"] for r in _records(out, "where").values()})
        # (other tests may keep containers meanwhile: only this test's agents' count)
        kept = {c.id: c for c in kaitian_containers(keep=1) if c.labels.get("org.kaitian.agent-pid") in pids}
        assert len(kept) == 2 and all(c.status == "running" for c in kept.values())
        assert used[0] == used[1] and set(used[0].values()) == set(kept)
    finally:
        for c in kaitian_containers(keep=1):
            if c.labels.get("org.kaitian.agent-pid") in pids:
                c.remove(force=True)


def test_missing_image_fails_with_one_line(tmp_path, image):
    proc = run_agent(
        _kaitianrun() + ["--standalone", "--nproc-per-node", "2", "--cpu-groups", "2", "--runtime", "docker",
                         "--image", "cpu=kaitian-test:no-such-image", SCRIPT],
        env=_env(tmp_path, "train"), cwd=str(tmp_path), timeout=120,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "kaitian-test:no-such-image" in line]
    assert len(errors) == 1 and "not found" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not kaitian_containers(agent_pid=proc.pid)  # (other tests' containers may come and go meanwhile)
    assert _records(tmp_path, "where") == {}


def test_unreachable_daemon_fails_with_one_line(tmp_path):
    sock = tmp_path / "no-docker.sock"
    proc = subprocess.run(
        _kaitianrun() + ["--standalone", "--nproc-per-node", "2", "--cpu-groups", "2", "--runtime", "docker", SCRIPT],
        env=_env(tmp_path, "train", DOCKER_HOST=f"unix://{sock}"), cwd=str(tmp_path),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "Docker daemon" in line]
    assert len(errors) == 1 and f"unix://{sock}" in errors[0] and "start it" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert _records(tmp_path, "where") == {}


def test_sigkill_of_kaitianrun_leaves_no_container_and_no_worker(tmp_path, image):
    """The agent killed with SIGKILL (no handler runs): its containers hold its
    stdin attach, so they and their workers are gone within seconds, and the
    next start has nothing to collect."""
    from kaitian.launcher.runtimes.docker.runtime import DockerRuntime

    out = tmp_path / "out"
    own(str(out))
    proc = subprocess.Popen(
        _kaitianrun() + _args("docker", image), env=_env(out, "wait"), cwd=str(tmp_path),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_records(out, "where", 2, proc)
        containers = kaitian_containers(agent_pid=proc.pid)
        assert len(containers) == 2
        for c in containers:  # workers are not root, containers are hardened
            attrs = inspect(c)
            assert attrs["Config"]["User"] == f"{WORKER_UID}:{WORKER_UID}" and attrs["HostConfig"]["CapDrop"] == ["ALL"]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while (kaitian_containers(agent_pid=proc.pid) or not _no_workers_left()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kaitian_containers(agent_pid=proc.pid) == []
        assert _no_workers_left()
        assert DockerRuntime.collect_stale() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in kaitian_containers(agent_pid=proc.pid):
            c.remove(force=True)


def test_dry_run_prints_the_docker_start_and_starts_nothing(tmp_path, image):
    """--dry-run: each group's container (its settings and digest) and each worker's exec,
    printed; no container, no worker, no run directory left."""
    proc = run_agent([*_kaitianrun(), *_args("docker", image, "--dry-run", "--cpu-quota", "0.5,1")],
                     env=_env(tmp_path / "out", "ok"), timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert text.count("\n- name: kaitian-") == 2 and text.count("\n- local_rank: ") == 2
    assert '  cpu_quota: 0.5' in text and '  cpu_quota: 1.0' in text and '    KAITIAN_GROUP: "cpu1"' in text
    assert kaitian_containers(agent_pid=proc.pid) == []
    assert not os.path.exists(tmp_path / "out")
    assert run_dirs(proc.pid) == []
