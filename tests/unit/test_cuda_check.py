"""``scripts/cuda_check.py``'s gloo PowerSGD reference in a process that sees a GPU.

torch's PowerSGD hook synchronizes CUDA for the bucket's device whenever CUDA is
available, a CPU bucket's too: on the first GPU run the reference over gloo
raised on the CUDA rank alone. Here CUDA is made to look available (on a CPU
build ``torch.cuda.synchronize`` then raises for any device, as it does for a
CPU device on a GPU machine): the reference trains under the check's guard.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from support import REPO, repo_env


def _cuda_check():
    spec = importlib.util.spec_from_file_location("cuda_check", os.path.join(REPO, "scripts", "cuda_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_powersgd(check) -> None:
    model = DistributedDataParallel(check._model())
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                        random_seed=0)
    model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    check._train(model, check._batches(1, 4), 0, torch.nn.functional.cross_entropy, "cpu")


def powersgd_where_cuda_is_available(store: str) -> None:
    """The test's body, in a process of its own. DDP with a comm hook keeps its gloo group, and the
    group's threads, alive after the group is destroyed; the hook's callbacks run on those threads and
    collect garbage there. In CI a test worker aborted in the next test, while a thread with no Python
    frame was collecting garbage (one of those, it seems): no test worker keeps such a group now."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    check = _cuda_check()
    torch.cuda.is_available = lambda: True
    if not torch.cuda.device_count():  # a CPU build: the hook's sync raises, as for a CPU device on a GPU host
        with pytest.raises(Exception):
            _train_powersgd(check)
    with check.cpu_buckets_beside_cuda():
        _train_powersgd(check)
    assert torch.cuda.synchronize.__module__ == "torch.cuda", "the guard left its patch behind"
    print("trained under the guard", flush=True)
    # Those threads may still drop a finished Work while the interpreter finalizes, which aborts
    # it ("terminate called without an active exception", pytorch/pytorch#190489; torch 2.4 in
    # CI): the process ends here, its checks done.
    os._exit(0)


def test_powersgd_reference_on_cpu_buckets_where_cuda_is_available(tmp_path) -> None:
    env = repo_env()
    env["PYTHONPATH"] += os.pathsep + os.path.dirname(__file__)  # this module
    run = subprocess.run([sys.executable, "-c", "import sys, test_cuda_check as t; "
                          "t.powersgd_where_cuda_is_available(sys.argv[1])", str(tmp_path / "store")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "trained under the guard" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


class _Writes:
    def __init__(self):
        self.calls = []

    def write(self, text):
        self.calls.append(text)

    def flush(self):
        pass


def test_a_ranks_line_is_one_write(monkeypatch):
    """The ranks share one unbuffered stdout, where print() writes a line's text and its
    newline apart: CI saw rank 2's 'harness stopped' land inside rank 0's PASS line."""
    check = _cuda_check()
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    check._say("PASS  harness: collectives on every group after them")
    assert out.calls == ["PASS  harness: collectives on every group after them\n"]
