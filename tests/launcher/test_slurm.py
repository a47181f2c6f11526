"""examples/slurm/kaitian.sbatch under a real SLURM (slurmctld + one slurmd per bed host).

The cluster is Debian's slurm-wlm with munge, started by the test as root on
the multi-host bed (``support.slurm``). When it cannot be brought up, the test
fails and says why; it is skipped only when asked (``KT_SKIP_SLURM=1``, e.g.
a developer without root), and then still says why.
"""

from __future__ import annotations

import glob
import os
import re
import sys

import pytest

from support import REPO, worker
from support.cluster_results import agent_env, assert_reference_weights, finals
from support.netns import available, bed
from support.slurm import missing, slurm_cluster

SCRIPT = os.path.join(REPO, "examples", "slurm", "kaitian.sbatch")
STEPS = 4


def test_sbatch_runs_one_agent_per_node(tmp_path):
    """sbatch --nodes=2: srun starts one kaitianrun per node; the job trains across both nodes."""
    why = available() or missing()
    if why and os.environ.get("KT_SKIP_SLURM") == "1":
        pytest.skip(f"KT_SKIP_SLURM=1 and SLURM cannot be brought up here: {why}")
    if why:
        pytest.fail(f"SLURM cannot be brought up here: {why} (KT_SKIP_SLURM=1 skips this test)")
    results = tmp_path / "results.jsonl"
    with bed(2) as net:
        with slurm_cluster(net, str(tmp_path / "slurm")) as slurm_env:
            env = agent_env(
                **slurm_env,
                KT_OUT=str(results),
                KAITIANRUN=f"{sys.executable} -m kaitian.launcher.cli",
                PET_CPU_SLOTS="1",  # kaitian flags as PET_* variables, exported by sbatch
                PET_CPU_GROUPS="1",
            )
            job = net.hosts[0].run(
                ["sbatch", "--wait", "--nodes=2", f"--chdir={tmp_path}", f"--output={tmp_path}/job-%j.out",
                 SCRIPT, worker("cluster_train"), "--steps", str(STEPS)],
                env=env, timeout=300,
            )
    log = "".join(open(p).read() for p in glob.glob(str(tmp_path / "job-*.out")))
    assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{log[-4000:]}"
    job_id = re.search(r"Submitted batch job (\d+)", job.stdout).group(1)
    by_rank = finals(str(results))
    assert sorted(by_rank) == [0, 1]
    assert {r["host"] for r in by_rank.values()} == {"h0", "h1"}  # one agent on each node
    assert {r["TORCHELASTIC_RUN_ID"] for r in by_rank.values()} == {job_id}  # --rdzv-id $SLURM_JOB_ID
    assert {r["MASTER_PORT"] for r in by_rank.values()} == {"29500"}  # the script's fixed store port
    assert_reference_weights(by_rank, STEPS)
