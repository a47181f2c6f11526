"""``--on-failure continue`` under the docker runtime: a worker killed inside its container;
the other worker of that container and the other container go on, and its agent starts
it again alone (``docker exec`` in the same container) as a joiner."""

import sys

from support import repo_env, worker
from support.docker import kaitian_containers, own, run_agent, test_image
from support.elastic import Run, check_exact

EPOCHS = 8  # steps enough for the restart (docker exec) on a loaded machine: 1 s each until it is back


def test_worker_lost_in_a_container_the_others_go_on_and_it_rejoins(tmp_path):
    image = test_image()
    own(str(tmp_path))
    out = own(str(tmp_path / "out"))
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--standalone", "--on-failure", "continue",
           "--runtime", "docker", "--image", f"cpu={image}", "--nproc-per-node", "3", "--cpu-groups", "2",
           "--max-restarts", "1", worker("elastic_train"), "--out", out, "--epochs", str(EPOCHS),
           "--fail", "forward@3:1", "--fail", "full@4:0", "--degraded-sleep", "1"]
    proc = run_agent(cmd, env=repo_env(OMP_NUM_THREADS="1"), timeout=300, cwd=str(tmp_path))
    run = Run(proc.returncode, proc.stdout + proc.stderr, out)
    assert run.returncode == 0, run.output[-6000:]
    steps = check_exact(run, epochs=EPOCHS, global_batch=48)
    first, again = run.member(1, 0), run.member(1, 1)
    killed_at = max(i for i, recs in enumerate(steps, start=1) if any(r["member"] == first for r in recs))
    assert steps[killed_at][0]["world"] == 2  # the step in flight, redone by the two others
    assert any(e["kind"] == "joined" and e["member"] == again for e in run.events())
    assert kaitian_containers(agent_pid=proc.pid) == []  # (its own: other tests' may be running)
