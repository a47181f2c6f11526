"""What the cluster tests share: the agents' environment and the checks on ``cluster_train`` results."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Dict

import pytest

from support import repo_env, worker

__all__ = ["agent_env", "finals", "assert_reference_weights"]


def agent_env(**extra: str) -> Dict[str, str]:
    """This process's environment without launcher settings, this checkout first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("USE_", "KAITIAN_", "PET_", "TORCHELASTIC_"))}
    env = repo_env(env, OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def finals(results: str) -> Dict[int, dict]:
    """Each rank's final record (the JSON lines ``cluster_train`` writes to ``KT_OUT``), by rank."""
    with open(results) as f:
        records = [json.loads(line) for line in f if line.strip()]
    by_rank = {int(r["RANK"]): r for r in records}
    assert len(by_rank) == len(records), "a rank finished twice"
    return by_rank


def _reference(steps: int):
    spec = importlib.util.spec_from_file_location("cluster_train", worker("cluster_train"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference(steps)


def assert_reference_weights(by_rank: Dict[int, dict], steps: int) -> None:
    """Every rank ends with the weights of one process trained on the whole global batch."""
    want = _reference(steps)
    for rank, info in by_rank.items():
        for got, ref in zip(info["params"], want):
            assert got == pytest.approx(ref, rel=1e-9, abs=1e-12), f"rank {rank} trained to other weights"
