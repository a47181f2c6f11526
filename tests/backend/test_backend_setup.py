"""Backend kaitian set-up: layout derivation, the stale-segment collector, the meeting's
file, a rank killed while building the group, and plain ``torchrun`` (no KAITIAN_* at all)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from kaitian.backend import factory
from kaitian.backend import groups as L
from kaitian.devices.device import WorkerDevice
from kaitian.backend import shm_gc

from support import REPO, TESTS


def _info(rank, group, device="cpu", host="h"):
    return L.RankInfo(rank=rank, device=WorkerDevice(device, rank, group), host=host, pid=100 + rank, pid_ns=1)


def test_layout_orders_groups_by_first_rank():
    lay = L.build_layout([_info(0, "cuda", "cuda"), _info(1, "cpu1"), _info(2, "cuda", "cuda"),
                          _info(3, "cpu0")])
    assert lay.group_names == ["cuda", "cpu1", "cpu0"]
    assert lay.group_device == ["cuda", "cpu", "cpu"]
    assert lay.group_of == [0, 1, 0, 2]
    assert lay.members == [[0, 2], [1], [3]]
    assert lay.single_host


def test_layout_rejects_mixed_device_types_and_sees_hosts():
    with pytest.raises(L.LayoutError, match="mixes device types"):
        L.build_layout([_info(0, "g"), _info(1, "g", "cuda")])
    assert not L.build_layout([_info(0, "a", host="x"), _info(1, "b", host="y")]).single_host
    # Two agents on one host, each with its own run dir: two nodes (TCP bridge).
    two_agents = [L.RankInfo(0, WorkerDevice("cpu", 0, "a"), "h", 1, 1, run_dir="/r/agent1"),
                  L.RankInfo(1, WorkerDevice("cpu", 0, "b"), "h", 2, 1, run_dir="/r/agent2")]
    assert not L.build_layout(two_agents).single_host


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _touch(name: str, age: float = 0.0) -> str:
    path = os.path.join(shm_gc.SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_collector_removes_only_dead_creators_segments():
    ns = shm_gc.pid_namespace()
    dead = _touch(f"kaitian-{ns}-{_dead_pid()}-abc123-r0")
    alive = _touch(f"kaitian-{ns}-{os.getpid()}-abc123-r1")
    foreign_old = _touch(f"kaitian-{ns + 1}-{os.getpid()}-abc123-r2", age=3600)
    foreign_new = _touch(f"kaitian-{ns + 1}-{os.getpid()}-abc123-r3")
    other = _touch("kaitian-not-ours")
    try:
        removed = shm_gc.collect_stale_segments()
        assert os.path.basename(dead) in removed and not os.path.exists(dead)
        assert os.path.basename(foreign_old) in removed
        for kept in (alive, foreign_new, other):
            assert os.path.exists(kept), kept
    finally:
        for p in (dead, alive, foreign_old, foreign_new, other):
            if os.path.exists(p):
                os.unlink(p)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_during_setup(tmp_path, attempt: int):
    """Starts rank 0 of a 2-rank bridge whose rank 1 never comes, SIGKILLs it once its
    segment exists; returns the segment name (or None) and the rank's output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAITIAN_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS, env.get("PYTHONPATH", "")])
    code = textwrap.dedent(f"""
        from support.bridge_pair import shm_backend
        shm_backend(0, {str(tmp_path / f"meet{attempt}")!r}, "feedbeef", timeout_ms=60000)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    tag = f"-{proc.pid}-"
    deadline = time.monotonic() + 60
    found = []
    while time.monotonic() < deadline and not found and proc.poll() is None:
        found = [n for n in os.listdir("/dev/shm") if n.startswith("kaitian-") and tag in n]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0].decode(errors="replace")
    return (found[0] if found else None), out


def test_rank_killed_during_setup_leaves_segment_that_next_start_collects(tmp_path):
    # Another kaitian job starting on this machine at the same moment may collect
    # the segment first; then try again.
    for attempt in range(3):
        name, out = _kill_during_setup(tmp_path, attempt)
        assert name, f"rank 0 never created its segment:\n{out[-3000:]}"
        if os.path.exists(os.path.join("/dev/shm", name)):  # the crash left it behind
            break
    else:
        pytest.fail("the killed rank's segment vanished before the collector ran (3 tries)")
    assert name in shm_gc.collect_stale_segments()  # what the next start does first
    assert not os.path.exists(os.path.join("/dev/shm", name))


def test_the_meeting_file_goes_once_every_rank_is_out_of_the_meeting(tmp_path):
    # torch's FileStore can leave its file (two ranks letting go together), so rank 0 removes it.
    path = tmp_path / "bridge-token.store"
    path.write_bytes(b"")
    store = dist.HashStore()
    rank0 = threading.Thread(target=factory._remove_after_meeting,
                             args=(store, 0, 2, timedelta(seconds=60), str(path)))
    rank0.start()
    time.sleep(0.5)
    assert rank0.is_alive() and path.exists()  # rank 1 still meets through it
    factory._remove_after_meeting(store, 1, 2, timedelta(seconds=60), str(path))
    rank0.join(10)
    assert not rank0.is_alive() and not path.exists()


@pytest.mark.parametrize("wait_s", [0, 1])  # 0: rank 0 failed itself; 1: another rank never gets out
def test_the_meeting_dir_goes_at_once_or_after_the_timeout_when_a_rank_never_gets_out(tmp_path, wait_s):
    run_dir = tmp_path / "kaitian-run-x"
    run_dir.mkdir()
    (run_dir / "bridge-token.store").write_bytes(b"")
    started = time.monotonic()
    factory._remove_after_meeting(dist.HashStore(), 0, 3, timedelta(seconds=wait_s), str(run_dir))
    assert wait_s <= time.monotonic() - started < wait_s + 5 and not run_dir.exists()


def test_plain_torchrun_without_kaitian_variables(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist, kaitian
        dist.init_process_group("kaitian")
        b = dist.group.WORLD._get_backend(torch.device("cpu"))
        x = torch.full((1 << 20,), float(dist.get_rank() + 1))
        dist.all_reduce(x)
        assert bool(x.eq(3).all())
        line = f"RANK {dist.get_rank()} {b.group_names()} {b.bridge_kind()}\\n"
        os.write(1, line.encode())  # one write: the ranks share stdout
        dist.destroy_process_group()
    """))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAITIAN_")}
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_port()), str(script)],
        env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in (0, 1):
        assert f"RANK {rank} ['cpu'] shm" in proc.stdout, proc.stdout[-3000:]
    # The private run directory (made by rank 0 in TMPDIR) is gone again.
    leftovers = [p for p in os.listdir(tmp) if p.startswith("kaitian-run-")]
    assert leftovers == []


def test_worker_with_another_kaitian_than_its_agent_refuses_to_start():
    """A worker whose kaitian (its container image's) differs from kaitianrun's fails at
    init_process_group with one line that says so, on every rank."""
    from support import worker
    from support.ranks import Layout, cleanup, run_ranks, tail

    run = run_ranks(Layout("1+1", env=(("KAITIAN_AGENT_VERSION", "0.0.0/1"),)),
                    [worker("failure"), "--scenario", "none"], timeout=60)
    try:
        assert not run.timed_out
        for rank, log in enumerate(run.logs):
            text = tail(log, 30)
            assert run.returncodes[rank] != 0, text
            assert "but kaitianrun runs 0.0.0/1" in text and "install the agent's kaitian" in text, text
    finally:
        cleanup(run)


@pytest.mark.parametrize("plugin_first", [False, True], ids=["plugin-after-kaitian", "plugin-first"])
def test_a_vendor_plug_in_device_reaches_kaitian_whatever_the_import_order(plugin_first):
    # torch_mlu renames torch's PrivateUse1 slot to "mlu" when imported, often
    # after `import kaitian` (issue 16): its tensors must still find the backend
    rename = 'torch.utils.rename_privateuse1_backend("mlu")'
    code = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        {rename if plugin_first else ""}
        import kaitian
        {"" if plugin_first else rename}
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{_port()}")
        dist.init_process_group("kaitian", rank=0, world_size=1)
        print(type(dist.group.WORLD._get_backend(torch.device("mlu"))).__name__)
        dist.destroy_process_group()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KAITIAN_")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=REPO)
    assert run.returncode == 0 and run.stdout.split()[-1:] == ["KaitianBackend"], run.stderr[-2000:]


def test_a_cncl_group_gets_its_timeout_ranks_and_name(monkeypatch):
    # As the NCCL group (issue 16, defect 7): torch_mlu's ProcessGroupCNCL gets
    # Options with kaitian's vendor timeout and, as its options allow, the
    # group's world ranks and name. No MLU here: a stand-in class records them.
    import torch.distributed as dist
    from datetime import timedelta

    from kaitian.backend import factory

    made = {}

    class ProcessGroupCNCL:
        class Options:
            def __init__(self):
                self._timeout, self.global_ranks_in_group, self.group_name = None, [], ""

        def __init__(self, store, rank, size, options):
            made.update(rank=rank, size=size, options=options)

    monkeypatch.setattr(dist, "ProcessGroupCNCL", ProcessGroupCNCL, raising=False)
    factory._vendor_backend("cncl", dist.HashStore(), 1, 2, timedelta(seconds=30), members=[2, 5],
                            group_name="kaitian/intra/mlu/mlu")
    options = made["options"]
    assert (made["rank"], made["size"]) == (1, 2)
    assert options._timeout == factory.vendor_timeout(timedelta(seconds=30))
    assert options.global_ranks_in_group == [2, 5] and options.group_name == "kaitian/intra/mlu/mlu"
