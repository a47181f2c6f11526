"""``--on-failure continue`` across hosts (the multi-host bed, ``support.netns``): nodes join and are lost.

One agent per host, one worker each (the TCP bridge between hosts). A host
that dies has every process of its namespace SIGKILLed at once, so no agent
marks its worker gone and the survivors agree after the quorum deadline.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import pytest

from support import worker
from support.cluster_results import agent_env
from support.elastic import Run, check_exact
from support.netns import available, bed

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason=f"{available()} (CI runs these as root)")

RDZV = "join_timeout=60,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def _agents(hosts, out, nnodes, *worker_flags):
    argv = [sys.executable, "-m", "kaitian.launcher.cli", "--rdzv-backend", "kaitian", "--rdzv-endpoint",
            "h0:29400", "--rdzv-id", "elastic", "--rdzv-conf", RDZV, "--nnodes", nnodes, "--max-restarts", "0",
            "--on-failure", "continue", "--nproc-auto", "--cpu-slots", "1", "--cpu-groups", "1",
            worker("elastic_train"), "--out", str(out), "--quorum-timeout", "3", "--step-sleep", "0.3",
            *worker_flags]
    return [h.popen(argv, env=agent_env()) for h in hosts]


def _wait(pred, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"an agent exited early ({p.returncode}):\n{p.stdout.read()[-4000:]}")
        time.sleep(0.2)
    pytest.fail("timed out waiting for the job")


def _applied(out) -> int:
    done = 0
    for path in glob.glob(os.path.join(out, "steps-*.jsonl")):
        with open(path) as f:
            done = max([done] + [json.loads(line)["applied"] for line in f if line.strip()])
    return done


def _doomed(net, out, procs):
    """Once training runs: the host to kill (not the rendezvous endpoint h0, not the workers' store)."""
    _wait(lambda: _applied(out) >= 4, procs)
    stores = {json.load(open(p))["store"] for p in glob.glob(os.path.join(out, "start-*.json"))}
    assert len(stores) == 1
    return next(h for h in reversed(net.hosts) if h.name not in ("h0", *stores))


def _benched(out) -> bool:
    """Whether a step was trained with a rank benched (a zero in its split)."""
    for path in glob.glob(os.path.join(out, "steps-*.jsonl")):
        with open(path) as f:
            if any(0 in json.loads(line)["split"] for line in f if line.strip()):
                return True
    return False


def test_new_node_joins_the_running_job_wakes_a_spare_then_is_lost_and_the_others_go_on(tmp_path):
    """Two hosts; launch rank 1's steps cost 0.4 s more, so the re-balancer benches it (a hot
    spare, in no step's collective, waiting for the epoch's end). A third host joins (--nnodes
    2:3): nobody is restarted, its worker joins at a step boundary with the live state, and the
    spare learns of the new generation while it waits and takes part in it. Then the new host
    dies: nobody marks its worker gone, the others agree after the quorum deadline, redo the
    step in flight and finish: every step once, one process's weights."""
    out = tmp_path / "out"
    out.mkdir()
    flags = ("--epochs", "6", "--rebalance", "--slow", "1:0.4")
    with bed(3) as net:
        h0, h1, h2 = net.hosts
        procs = _agents([h0, h1], out, "2:3", *flags)
        _wait(lambda: _benched(out), procs)
        procs += _agents([h2], out, "2:3", *flags)
        joiner = lambda: [m for m in Run(0, "", str(out)).members() if m.startswith("h2_")]  # noqa: E731
        _wait(lambda: joiner() and os.path.getsize(out / f"steps-{joiner()[0]}.jsonl") > 0, procs)
        h2.kill()
        alive = procs[:2]
        outputs = net.finish(alive, 180)
    assert [p.returncode for p in alive] == [0, 0], "\n-----\n".join(o[-4000:] for o in outputs)
    run = Run(0, "".join(outputs), str(out))
    steps = check_exact(run, epochs=6, global_batch=32)  # two launch workers x 16
    assert all(m.endswith("_0") for m in run.members())  # the same incarnations throughout: no restart
    (gone,) = joiner()
    events = run.events()
    (joined,) = [e for e in events if e["kind"] == "joined"]
    assert joined["member"] == gone
    woken = [e for e in events if e["kind"] == "lost" and "a benched rank learns it while it waits" in e["detail"]]
    assert woken and "the members agree on generation" in woken[0]["detail"], [e["detail"] for e in events]
    spare = woken[0]["member"]
    assert any(e["kind"] == "reformed" and e["member"] == spare and e["generation"] == joined["generation"]
               for e in events), events
    last = max(i for i, recs in enumerate(steps, start=1) if any(r["member"] == gone for r in recs))
    assert steps[last - 1][0]["world"] == 3 and steps[last][0]["world"] == 2
    # the joiner's loss, as a member that was not waiting on the bench saw it
    events = [e for e in events if e["member"] != gone and e["time"] > joined["time"]]
    lost = next(e for e in events if e["kind"] == "lost" and "a benched rank learns" not in e["detail"])
    agreed = next(e for e in events if e["kind"] == "agreed" and e["time"] > lost["time"])
    assert agreed["time"] - lost["time"] >= 3.0  # nobody said it was gone: the quorum deadline decided


def test_below_nnodes_min_the_job_cannot_go_on_and_says_why(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with bed(2) as net:
        procs = _agents(net.hosts, out, "2", "--epochs", "20")
        doomed = _doomed(net, out, procs)
        doomed.kill()
        alive = [p for h, p in zip(net.hosts, procs) if h is not doomed]
        outputs = net.finish(alive, 180)
    assert [p.returncode for p in alive] == [1], outputs[0][-4000:]
    assert "the job cannot go on: only 1 node(s) left, below --nnodes MIN=2" in outputs[0]


def test_the_workers_store_host_lost_the_job_cannot_go_on_and_says_why(tmp_path):
    """The host serving the workers' store dies. At the first start that store is the
    rendezvous store too (torch's agent store), so whichever notices first says why: the
    survivor's worker (it cannot agree with anyone) or its agent (its rendezvous poll
    fails, as under restart mode and torchrun). Either way the job fails (no restart left)."""
    out = tmp_path / "out"
    out.mkdir()
    with bed(2) as net:
        procs = _agents(net.hosts, out, "1:2", "--epochs", "20")
        _wait(lambda: _applied(out) >= 4, procs)
        (store,) = {json.load(open(p))["store"] for p in glob.glob(os.path.join(out, "start-*.json"))}
        doomed = next(h for h in net.hosts if h.name == store)
        doomed.kill()
        alive = [p for h, p in zip(net.hosts, procs) if h is not doomed]
        outputs = net.finish(alive, 180)
    assert [p.returncode for p in alive] == [1], outputs[0][-4000:]
    worker_says = "kaitian elastic: the workers' store at " in outputs[0] and "is unreachable" in outputs[0]
    agent_says = "RendezvousConnectionError: The connection to the C10d store has failed" in outputs[0]
    assert worker_says or agent_says, outputs[0][-4000:]
