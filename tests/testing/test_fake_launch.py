"""``KAITIAN_FAKE_ACCELERATOR=mlu:N`` on a CPU-only host: kaitianrun, discovery and
``import kaitian`` see N MLUs, end to end, as a user runs them."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from support import REPO, repo_env, worker


def _run(args, timeout=180, **env):
    """``python args...`` with this checkout's kaitian, a clean kaitian/torchrun environment plus ``env``."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("USE_", "KAITIAN_", "PET_", "TORCHELASTIC_")) and k != "MLU_VISIBLE_DEVICES"}
    return subprocess.run([sys.executable, *args], env=repo_env(clean, **env), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("env, flags, ranks", [
    # USE_CPU=0 is CPU slot 0 (a CPU worker), as for any vendor
    ({"KAITIAN_FAKE_ACCELERATOR": "mlu:2", "USE_MLU": "0,1", "USE_CPU": "0"}, [],
     [("mlu", "0"), ("mlu", "1"), ("cpu", "0")]),
    # a host MLU_VISIBLE_DEVICES limits and renumbers the MLUs, as torch_mlu's
    ({"KAITIAN_FAKE_ACCELERATOR": "mlu:3", "MLU_VISIBLE_DEVICES": "2,0"}, ["--devices", "mlu:0,cpu"],
     [("mlu", "0"), ("cpu", "0")]),
], ids=["use-mlu", "devices-flag"])
def test_kaitianrun_gives_each_worker_its_fake_mlu(tmp_path, env, flags, ranks):
    proc = _run(["-m", "kaitian.launcher.cli", "--nproc-auto", *flags, worker("fake_mlu_rank"), str(tmp_path)],
                **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "rank.*.json")))]
    world = len(ranks)
    assert [(r["KAITIAN_DEVICE_TYPE"], r["KAITIAN_DEVICE_INDEX"]) for r in recs] == ranks, recs
    host_visible = env.get("MLU_VISIBLE_DEVICES")
    for r in recs:
        assert r["values"] == [world * (world + 1) / 2], r  # every element: the sum of 1..world
        if r["KAITIAN_DEVICE_TYPE"] == "cpu":
            assert r["MLU_VISIBLE_DEVICES"] == "" and r["mlu_count"] == 0 and r["device"] == "cpu", r
            continue
        # the worker's ordinal is where its physical MLU sits in what it sees
        seen = host_visible.split(",") if host_visible else [str(i) for i in range(r["mlu_count"])]
        ordinal = seen.index(r["KAITIAN_DEVICE_INDEX"])
        assert r["MLU_VISIBLE_DEVICES"] == host_visible and r["mlu_count"] == len(seen), r
        assert r["device"] == f"mlu:{ordinal}" and r["current"] == ordinal, r


def test_kaitian_devices_lists_the_fake_mlus():
    proc = _run(["-m", "kaitian", "devices"], KAITIAN_FAKE_ACCELERATOR="mlu:2")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [r[:5] for r in rows if r[1] == "mlu"] == [["mlu:0", "mlu", "0", "fake", "MLU"],
                                                      ["mlu:1", "mlu", "1", "fake", "MLU"]], proc.stdout


def test_a_malformed_value_is_one_line_and_a_real_torch_mlu_wins(tmp_path):
    bad = _run(["-m", "kaitian.launcher.cli", "--nproc-auto", worker("fake_mlu_rank"), str(tmp_path)],
               KAITIAN_FAKE_ACCELERATOR="mlu:x")
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode != 0 and len(lines) == 1, bad.stderr
    assert lines[0] == "kaitian: KAITIAN_FAKE_ACCELERATOR='mlu:x': expected mlu:N with N from 1 to 64 (e.g. mlu:2)"
    assert not glob.glob(str(tmp_path / "rank.*"))
    # An importable torch_mlu is the real one: the variable is ignored, in one line.
    (tmp_path / "torch_mlu").mkdir()
    (tmp_path / "torch_mlu" / "__init__.py").write_text("")
    real = _run(["-c", "import torch, kaitian; from kaitian.devices.inventory import discover; "
                 "print(hasattr(torch, 'mlu'), [d.key for d in discover() if d.type == 'mlu'])"],
                KAITIAN_FAKE_ACCELERATOR="mlu:2", PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    assert real.returncode == 0, real.stderr
    assert real.stdout.split("\n")[0] == "False []"
    assert real.stderr.strip() == "kaitian: KAITIAN_FAKE_ACCELERATOR is ignored: a real torch_mlu is installed"


def test_plain_torchrun_ranks_on_two_of_four_mlus_use_torchs_ordinals():
    """Under plain torchrun nothing names a physical index: with MLU_VISIBLE_DEVICES=2,3
    local rank 1 computes on mlu:1 (physical MLU 3), and the backend's device for it
    (the layout's, NCCL's eager connect) is that ordinal, not physical MLU 1 (hidden)."""
    probe = ("import kaitian, torch\n"
             "from kaitian.backend import factory, groups\n"
             "from kaitian.settings import settings\n"
             "me = groups.local_rank_info(1, settings())\n"
             "print(kaitian.device(), factory._rank_torch_device(me))\n")
    proc = _run(["-c", probe], KAITIAN_FAKE_ACCELERATOR="mlu:4", MLU_VISIBLE_DEVICES="2,3", LOCAL_RANK="1",
                RANK="1", WORLD_SIZE="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["mlu:1", "mlu:1"], proc.stdout + proc.stderr[-2000:]


def test_numa_binding_pins_each_accelerator_worker_near_its_own_device(tmp_path):
    """torch binds local rank i to CUDA device i's NUMA node; kaitian binds each worker by its own device.
    Two fake MLUs (near the host's first NUMA node) under ``exclusive`` split that node's physical cores
    and keep torchrun's OMP_NUM_THREADS; the CPU slot keeps its cores and runs as many threads."""
    from kaitian.devices.vendors.cpu import numa_nodes

    nodes = numa_nodes()
    node = set(nodes[min(nodes)])
    assert len(node) >= 2, f"the premise: two cores on the first NUMA node, not {sorted(node)}"
    proc = _run(["-m", "kaitian.launcher.cli", "--nproc-auto", "--cpu-slots", "1", "--numa-binding", "exclusive",
                 worker("envdump"), str(tmp_path)], KAITIAN_FAKE_ACCELERATOR="mlu:2", USE_MLU="0,1", USE_CPU="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.load(open(tmp_path / f"env.{r}.json")) for r in range(3)]
    cores = [set(map(int, r["_AFFINITY"].split(","))) for r in recs]
    assert [r["KAITIAN_DEVICE_TYPE"] for r in recs] == ["mlu", "mlu", "cpu"]
    assert cores[0] and cores[1] and not cores[0] & cores[1] and cores[0] | cores[1] == node, cores
    slot = {c for cs in nodes.values() for c in cs}  # one slot: every core
    assert cores[2] == slot and recs[2]["OMP_NUM_THREADS"] == str(len(slot)), recs[2]
    assert recs[0]["OMP_NUM_THREADS"] == recs[1]["OMP_NUM_THREADS"] == "1"
