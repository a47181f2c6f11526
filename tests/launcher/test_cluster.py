"""kaitianrun across hosts, on a multi-host network built on this machine (``support.netns``).

Every "host" is a network namespace with its own address and host name; one
kaitianrun agent runs per host (c10d rendezvous on one of them), the backend
bridges hosts over TCP and ranks of one host meet through shared memory.
Hosts really die: every process of the namespace is SIGKILLed at once.

The worker (``workers/cluster_train.py``) trains with backend kaitian and
``kaitian.DistributedDataParallel`` on one fixed global batch per step,
checkpointing after each step, so whatever worlds the job goes through, its
final weights must equal a single process trained on the whole batch.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import pytest

from support import worker
from support.cluster_results import agent_env as _env, assert_reference_weights, finals
from support.entry_point import entry_point_site
from support.netns import available, bed
from support.vendor_tools import stand_in_tools

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason=f"{available()} (CI runs these as root)"
)

STEPS = 24
RDZV_PORT = 29400  # ports inside the bed's own namespaces: nothing else listens there
FIXED_STORE_PORT = 29555
FAST_RDZV = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


def _agent(host, run_id, out, *flags, rdzv_host="h0", steps=STEPS, sleep=0.0, extra=(), env=None):
    argv = [sys.executable, "-m", "kaitian.launcher.cli", "--rdzv-backend", "kaitian",
            "--rdzv-endpoint", f"{rdzv_host}:{RDZV_PORT}", "--rdzv-id", run_id, "--rdzv-conf", FAST_RDZV,
            "--nproc-auto", *flags, worker("cluster_train"), "--steps", str(steps),
            "--step-sleep", str(sleep), *extra]
    env = dict(env or _env(), KT_OUT=str(out / "results.jsonl"))
    return host.popen(argv, env=env)


def _mix(slots, groups):
    return ["--cpu-slots", str(slots), "--cpu-groups", str(groups)]


def _finish(net, procs, timeout=240):
    """Waits for every agent; returns their outputs (fails with them on a non-zero exit)."""
    outs = net.finish(procs, timeout)
    codes = [p.returncode for p in procs]
    assert all(c == 0 for c in codes), f"agent exits {codes}:\n" + "\n-----\n".join(o[-6000:] for o in outs)
    return outs


def _finals(out):
    return finals(str(out / "results.jsonl"))


def _progress(out):
    try:
        lines = open(out / "progress").read().split("\n")
    except FileNotFoundError:
        return []
    return [line.split() for line in lines if line.count(" ") == 3]


def _wait_progress(out, procs, pred, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(pred(int(step), int(world)) for step, world, _, _ in _progress(out)):
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"an agent exited early ({p.returncode}):\n{p.stdout.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no progress as expected; progress: {_progress(out)[-5:]}")


def _assert_weights(by_rank):
    assert_reference_weights(by_rank, STEPS)


@pytest.mark.parametrize(
    "mixes",
    [[(2, 2), (1, 1)], [(1, 1), (2, 2), (1, 1)]],
    ids=["2-hosts", "3-hosts"],
)
def test_hosts_train_to_the_weights_of_one_process(tmp_path, mixes):
    """2 and 3 hosts with different CPU-group mixes form one vendor-grouped world and train exactly.

    The TCP bridge is held to a small fixed port range, as on a firewalled cluster.
    """
    env = _env(KAITIAN_BRIDGE_PORTS="29600-29603")
    with bed(len(mixes)) as net:
        procs = [_agent(h, "same", tmp_path, "--nnodes", str(len(mixes)), *_mix(*m), env=env)
                 for h, m in zip(net.hosts, mixes)]
        _finish(net, procs)
    finals = _finals(tmp_path)
    world = sum(slots for slots, _ in mixes)
    assert sorted(finals) == list(range(world))
    assert {f["host"] for f in finals.values()} == {f"h{i}" for i in range(len(mixes))}
    groups = [finals[r]["KAITIAN_GROUP"] for r in range(world)]
    assert groups == sorted(groups), groups  # ranks grouped by vendor group across hosts
    assert len({finals[r]["GROUP_RANK"] for r in range(world) if groups[r] == "cpu0"}) > 1  # cpu0 spans hosts
    assert {f["MASTER_ADDR"] for f in finals.values()} == {"h0"}
    _assert_weights(finals)


def test_host_joins_running_job(tmp_path):
    """--nnodes 2:3: a third host joining re-forms the world (no restart counted) and training continues."""
    with bed(3) as net:
        h0, h1, h2 = net.hosts
        common = ("--nnodes", "2:3", *_mix(1, 1))
        hold = ("--hold", "3:4")  # the 2-host world trains 4 steps, then waits for the third host
        first = [_agent(h, "join", tmp_path, *common, extra=hold) for h in (h0, h1)]
        _wait_progress(tmp_path, first, lambda step, world: world == 2 and step >= 4)
        late = _agent(h2, "join", tmp_path, *common, extra=hold)
        _finish(net, [*first, late])
    finals = _finals(tmp_path)
    assert sorted(finals) == [0, 1, 2]
    for info in finals.values():
        assert info["world"] == 3 and info["GROUP_WORLD_SIZE"] == "3"
        assert info["TORCHELASTIC_RESTART_COUNT"] == "0"  # a membership change is not a restart
        assert info["start_step"] == 4  # resumed from the 2-host world's checkpoint
    _assert_weights(finals)


def test_lost_host_that_held_the_worker_store(tmp_path):
    """The host serving the workers' store (node 0) dies: survivors re-form on a new store and finish.

    The rendezvous runs on h2 (which survives); h0 is node 0 and serves the
    workers' store on the fixed --master-port. After h0 dies, h1 is node 0:
    every worker must get h1's address with the same fixed port (torch's cache
    on the survivors still names h0).
    """
    with bed(3) as net:
        h0, h1, h2 = net.hosts
        common = ("--nnodes", "2:3", "--max-restarts", "2", "--master-port", str(FIXED_STORE_PORT), *_mix(1, 1))
        procs = [_agent(h, "leave", tmp_path, *common, rdzv_host="h2", sleep=0.3) for h in net.hosts]
        _wait_progress(tmp_path, procs, lambda step, world: world == 3 and step >= 3)
        h0.kill()
        _finish(net, procs[1:])
    finals = _finals(tmp_path)
    assert sorted(finals) == [0, 1]
    assert {f["host"] for f in finals.values()} == {"h1", "h2"}
    for info in finals.values():
        assert info["world"] == 2 and info["start_step"] >= 3
        assert (info["MASTER_ADDR"], info["MASTER_PORT"]) == ("h1", str(FIXED_STORE_PORT))
    stores = {store for _, _, _, store in _progress(tmp_path)}
    assert stores == {f"h0:{FIXED_STORE_PORT}", f"h1:{FIXED_STORE_PORT}"}, stores
    _assert_weights(finals)


def test_max_restarts_across_hosts(tmp_path):
    """A worker failing on one host restarts the workers of every host; training resumes and finishes.

    The workers' store is on a fixed --master-port: node 0 serves the
    restarted workers a fresh store on that same port.
    """
    with bed(2) as net:
        procs = [_agent(h, "restart", tmp_path, "--nnodes", "2", "--max-restarts", "1",
                        "--master-port", str(FIXED_STORE_PORT), *_mix(1, 1), extra=("--crash", "1:3"))
                 for h in net.hosts]
        outs = _finish(net, procs)
    assert {store for _, _, _, store in _progress(tmp_path)} == {f"h0:{FIXED_STORE_PORT}"}  # both attempts
    assert "planned crash at step 3" in outs[1]
    finals = _finals(tmp_path)
    assert sorted(finals) == [0, 1]
    for info in finals.values():
        assert info["start_step"] == 3  # both hosts' new workers resumed from the checkpoint
    # As torchrun: the first agent to see a failure (its own worker's, or its worker's on the
    # dead peer) spends a restart and opens a new round; the other may join that round as a
    # membership change before it sees its own worker's end (no restart spent): a race.
    counts = sorted(info["TORCHELASTIC_RESTART_COUNT"] for info in finals.values())
    assert counts in (["0", "1"], ["1", "1"]), finals
    _assert_weights(finals)


def test_version_mismatch_is_one_line_before_any_worker_starts(tmp_path):
    """One host with another kaitian version: every agent stops with one line; no worker ever starts."""
    fake = tmp_path / "fake-version"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text("import kaitian.version\nkaitian.version.__version__ = '0.0.0+other'\n")
    out = tmp_path / "out"
    out.mkdir()
    with bed(2) as net:
        h0, h1 = net.hosts
        env1 = _env()
        env1["PYTHONPATH"] = os.pathsep.join([str(fake), env1["PYTHONPATH"]])
        procs = [_agent(h0, "versions", out, "--nnodes", "2", *_mix(1, 1)),
                 _agent(h1, "versions", out, "--nnodes", "2", *_mix(1, 1), env=env1)]
        outs = [p.communicate(timeout=180)[0] for p in procs]
    import kaitian

    for proc, text in zip(procs, outs):
        assert proc.returncode == 2, text[-3000:]
        errors = [line for line in text.splitlines() if line.startswith("kaitianrun: error:")]
        assert len(errors) == 1 and "Traceback" not in text, text[-3000:]
        assert f"node 0 (h0) has kaitian {kaitian.__version__}" in errors[0]
        assert "node 1 (h1) has kaitian 0.0.0+other" in errors[0]
    assert not glob.glob(str(out / "started.*")), "a worker started"


def test_plain_torchrun_orders_hosts_by_vendor(tmp_path):
    """torchrun --rdzv-backend kaitian on two hosts: the GPU host's workers get the first ranks.

    h0 (CPU only) sorts first in torch's rendezvous; h1 has two GPUs (found
    through a stand-in nvidia-smi, its workers only record their environment),
    so the kaitian rendezvous makes h1 node 0.
    """
    site = entry_point_site(tmp_path)
    stand_in_tools(tmp_path / "gpu-bin", "cuda", 2)
    with bed(2) as net:
        procs = []
        for h in net.hosts:
            out = tmp_path / h.name
            out.mkdir()
            env = _env(TMPDIR=str(out))  # where torchrun leaves its torchelastic_* log directory
            env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
            if h.name == "h1":
                env["PATH"] = os.pathsep.join([str(tmp_path / "gpu-bin"), env["PATH"]])
            procs.append(h.popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                  "--nproc-per-node", "2", "--rdzv-backend", "kaitian", "--rdzv-endpoint",
                                  f"h0:{RDZV_PORT}", "--rdzv-id", "plain", "--rdzv-conf", FAST_RDZV,
                                  worker("envdump"), str(out)], env=env))
        _finish(net, procs)
    ranks = {h: sorted(int(json.load(open(p))["RANK"]) for p in glob.glob(str(tmp_path / h / "env.*.json")))
             for h in ("h0", "h1")}
    assert ranks == {"h1": [0, 1], "h0": [2, 3]}


def test_an_agent_that_outlives_the_wait_is_ended_with_its_host(tmp_path):
    """An agent still running at the deadline fails the test, it does not hang it:
    its workers hold its output pipe, so the whole host is killed, not the agent alone."""
    with bed(1) as net:
        (h0,) = net.hosts
        proc = h0.popen(["sh", "-c", "echo started; sleep 300 & sleep 300"], env=_env())
        start = time.monotonic()
        (out,) = net.finish([proc], timeout=2)
    assert time.monotonic() - start < 30
    assert proc.returncode == -9
    assert out.startswith("started\n") and "killed with everything on h0" in out, out
