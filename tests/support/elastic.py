"""Reading what ``workers/elastic_train.py`` left, and the one-process replay it must match.

The worker trains the examples' fp64 MLP on their dataset (480 samples, or ``--samples``)
with SGD + momentum; kaitian's sampler cuts epoch ``e`` from the permutation
of ``seed + e`` into global batches of ``B``, whatever the split, so the
sequence of global batches a run must have trained is known in advance.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from support import repo_env, worker
from support.replay import examples_common, max_difference, train_on_steps

__all__ = ["Run", "run_elastic", "expected_batches", "check_exact", "assert_one_process_weights"]

DATASET = 480


@dataclass
class Run:
    """One ``kaitianrun --on-failure continue`` job of the elastic worker."""

    returncode: int
    output: str
    out: str

    def steps(self) -> Dict[int, List[dict]]:
        """Applied step -> what each member that applied it logged."""
        by_step: Dict[int, List[dict]] = {}
        for path in glob.glob(os.path.join(self.out, "steps-*.jsonl")):
            member = os.path.basename(path)[len("steps-"):-len(".jsonl")]
            for line in open(path):
                rec = dict(json.loads(line), member=member)
                by_step.setdefault(rec["applied"], []).append(rec)
        return by_step

    def events(self) -> List[dict]:
        out = []
        for path in glob.glob(os.path.join(self.out, "events-*.jsonl")):
            member = os.path.basename(path)[len("events-"):-len(".jsonl")]
            out += [dict(json.loads(line), member=member) for line in open(path)]
        return sorted(out, key=lambda e: e["time"])

    def members(self) -> List[str]:
        """Every member's name as in the log files (``<host>_<agent pid>_<local rank>_<incarnation>``)."""
        return sorted(os.path.basename(p)[len("steps-"):-len(".jsonl")]
                      for p in glob.glob(os.path.join(self.out, "steps-*.jsonl")))

    def member(self, launch_rank: int, incarnation: int) -> str:
        """The member name of a launch rank's incarnation (one host)."""
        found = [n for n in self.members() if n.endswith(f"_{launch_rank}_{incarnation}")]
        assert len(found) == 1, (launch_rank, incarnation, self.members())
        return found[0]

    def result(self) -> dict:
        with open(os.path.join(self.out, "result.json")) as f:
            return json.load(f)


def run_elastic(tmp_path, launcher_flags: List[str], worker_flags: List[str], timeout: float = 240,
                **env: str) -> Run:
    """Runs ``kaitianrun --standalone --on-failure continue FLAGS elastic_train.py --out DIR WORKER_FLAGS``
    (``env``: more environment variables)."""
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--standalone", "--on-failure", "continue",
           *launcher_flags, worker("elastic_train"), "--out", str(out), *worker_flags]
    proc = subprocess.Popen(cmd, env=repo_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Ctrl-C's way first (kaitianrun stops its workers), so that the failure shows where the job was
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
    run = Run(proc.returncode, stdout + stderr, str(out))
    if timed_out:
        events = [f"{e['member']} {e['kind']}: {e['detail']}" for e in run.events()[-12:]]
        pytest.fail(f"the job ran past {timeout} s (last applied step {max(run.steps(), default=0)}); its last "
                    "events:\n" + "\n".join(events) + "\nits output's end:\n" + run.output[-8000:], pytrace=False)
    return run


def expected_batches(epochs: int, global_batch: int, seed: int = 0, samples: int = DATASET) -> List[List[int]]:
    """The global batch of every step, in order (what one process must train on)."""
    out = []
    for epoch in range(epochs):
        perm = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        out += [perm[i:i + global_batch] for i in range(0, samples, global_batch)]
    return out


def check_exact(run: Run, epochs: int, global_batch: int, lr: float = 0.1, momentum: float = 0.9,
                samples: int = DATASET, step_lr: Optional[Tuple[int, float]] = None) -> List[List[dict]]:
    """Asserts the run trained each global batch once, in order, to one process's weights (fp64, 1e-9).

    Every step was applied by one generation, the last that applied it (the
    same world and split in every member's log; an earlier one's records
    count as undone when every rank that had applied it was lost and benched
    ranks went on from their copy of the epoch's end), and its members' samples are that step's global
    batch: all of it when every member logged the step, never a sample of
    another step (a member killed right after the commit cannot log the step
    it helped apply).

    Returns:
        Per applied step, the records of the members that logged it.
    """
    batches = expected_batches(epochs, global_batch, samples=samples)
    steps = run.steps()
    assert sorted(steps) == list(range(1, len(batches) + 1)), sorted(steps)
    records = []
    for applied, batch in enumerate(batches, start=1):
        # A step redone by a later generation from an older state (every rank that had applied it
        # was lost: the benched ranks go on from their copy of the epoch's end) counts as redone.
        last = max(r["generation"] for r in steps[applied])
        recs = [r for r in steps[applied] if r["generation"] == last]
        assert len({(r["generation"], r["world"], tuple(r["split"])) for r in recs}) == 1, recs
        world, split = recs[0]["world"], recs[0]["split"]
        assert sum(split) == global_batch and len(split) == world
        assert sorted(r["rank"] for r in recs) == sorted(set(r["rank"] for r in recs))
        for r in recs:  # a short last step of an epoch is cut in proportion to the split
            assert len(r["indices"]) == split[r["rank"]] or len(batch) < global_batch, r
        union = sorted(i for r in recs for i in r["indices"])
        if len(recs) == sum(1 for n in split if n > 0):  # every rank that trained it (not the benched)
            assert union == sorted(batch), (applied, union, sorted(batch))
        else:
            assert set(union) <= set(batch) and len(union) == len(set(union)), applied
        records.append(recs)
    assert_one_process_weights(os.path.join(run.out, "weights.json"), batches, lr, momentum, samples, step_lr)
    return records


def assert_one_process_weights(path: str, batches: List[List[int]], lr: float = 0.1, momentum: float = 0.9,
                               samples: int = DATASET, step_lr: Optional[Tuple[int, float]] = None) -> None:
    """The weights saved at ``path`` are one process's after SGD on ``batches`` (fp64, 1e-9; ``step_lr``: a
    per-step ``StepLR``'s ``(step_size, gamma)``)."""
    common = examples_common()
    x, y, _ = common.make_dataset(samples).tensors
    reference = train_on_steps([batches], x, y, common.make_model(), lr, momentum, step_lr=step_lr)
    with open(path) as f:
        trained = json.load(f)
    assert max_difference(trained, reference) < 1e-9
