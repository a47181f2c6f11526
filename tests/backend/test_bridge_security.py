"""Who may join a kaitian bridge, and the local security of the run directory (issue 9).

The real ranks are ``tests/workers/bridge_allreduce.py`` over ``KAITIAN_BRIDGE=tcp``
on this host; hostile peers are threads of the test process that connect to rank
0's bridge port (pinned with ``KAITIAN_BRIDGE_PORTS``) while rank 1 is held back.
Every test checks the exact outcome: the real ranks' values, how long set-up
took, what rank 0 logged, what the stranger saw.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pwd
import re
import secrets
import socket
import struct
import subprocess
import threading
import time

import pytest
import torch.distributed as dist

from kaitian.backend import factory
from kaitian.settings import Settings, SettingError
from support.ranks import Layout, cleanup, free_port, run_ranks, tail

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(TESTS, "workers", "bridge_allreduce.py")
SUPPORT = os.path.join(TESTS, "support")
TCP = (("KAITIAN_BRIDGE", "tcp"),)
MAGIC = b"KTBRIDGE"
CHALLENGE = struct.Struct("<8sIII32s")  # magic, version, world size, server rank, server nonce
HELLO = struct.Struct("<8sIIII32s32s")  # magic, version, world size, rank, channel, nonce, proof


def _records(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _event(run, rank, name):
    found = [r for r in _records(run.outs[rank]) if r["event"] == name]
    assert found, f"rank {rank} wrote no {name!r} record:\n{tail(run.logs[rank])}"
    return found[-1]


def _why(run, rank):
    """What a failed rank wrote: its records (an init error is one) and its log's tail."""
    return f"{_records(run.outs[rank])}\n{tail(run.logs[rank])}"


def _log(run, rank):
    with open(run.logs[rank], errors="replace") as f:
        return f.read()


def _run(spec, timeout_s=20, rank_env=None, delay=None, env=TCP, limit=90):
    extra = dict(env)
    extra.update({"KT_TIMEOUT": str(timeout_s), "KT_RANK_ENV": json.dumps(rank_env or {}),
                  "KT_BRIDGE_DELAY": json.dumps(delay or {})})
    return run_ranks(Layout(spec, env=tuple(extra.items())), [WORKER], timeout=limit)


# --- strangers ------------------------------------------------------------------------------


class Stranger(threading.Thread):
    """Connects to ``127.0.0.1:port`` the moment it listens, twice (a rank's two channels),
    and misbehaves one way on each connection; records what rank 0 did with it."""

    def __init__(self, port: int, behaviour: str, key: bytes = b"") -> None:
        super().__init__(daemon=True)
        self.port, self.behaviour, self.key = port, behaviour, key
        self.received = [b"", b""]  # per connection: every byte rank 0 sent
        self.closed = [False, False]  # rank 0 closed the connection (EOF or reset)
        self.connected = 0

    def _connect(self, deadline: float) -> socket.socket:
        while time.monotonic() < deadline:
            try:
                return socket.create_connection(("127.0.0.1", self.port), timeout=1)
            except OSError:
                time.sleep(0.002)
        raise TimeoutError(f"rank 0 never listened on {self.port}")

    def _misbehave(self, s: socket.socket, channel: int) -> None:
        if self.behaviour == "claims_rank1":  # the old 8-byte hello, then values of our choosing
            s.sendall(struct.pack("<ii", 1, channel) + struct.pack("<16f", *[1000.0] * 16))
        elif self.behaviour == "malformed":
            s.sendall(struct.pack("<ii", 99, 7))
        elif self.behaviour == "other_version":  # a kaitian of another bridge protocol
            s.sendall(HELLO.pack(MAGIC, 99, 2, 1, channel, bytes(32), bytes(32)))
        elif self.behaviour == "other_job":  # speaks the protocol, holds another job's key
            s.settimeout(10)
            head = b""
            while len(head) < CHALLENGE.size:
                chunk = s.recv(CHALLENGE.size - len(head))
                if not chunk:
                    return
                head += chunk
            self.received[channel] += head
            magic, version, size, server, nonce_s = CHALLENGE.unpack(head)
            nonce_c = secrets.token_bytes(32)
            body = struct.pack("<IIIII", version, size, server, 1, channel) + nonce_s + nonce_c
            proof = hmac.new(self.key, b"kaitian bridge client\0" + body, hashlib.sha256).digest()
            s.sendall(HELLO.pack(MAGIC, version, size, 1, channel, nonce_c, proof))
        # "silent": sends nothing at all

    def _watch(self, s: socket.socket, channel: int, deadline: float) -> None:
        s.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(4096)
            except socket.timeout:
                continue
            except OSError:  # reset
                self.closed[channel] = True
                return
            if not chunk:
                self.closed[channel] = True
                return
            self.received[channel] += chunk

    def run(self) -> None:
        deadline = time.monotonic() + 60
        socks = []
        try:
            for channel in (0, 1):
                socks.append(self._connect(deadline))
                self.connected += 1
                self._misbehave(socks[-1], channel)
            watchers = [threading.Thread(target=self._watch, args=(s, c, deadline), daemon=True)
                        for c, s in enumerate(socks)]
            for w in watchers:
                w.start()
            for w in watchers:
                w.join()
        finally:
            for s in socks:
                s.close()


DROPPED = {
    "claims_rank1": r"dropped a connection from 127\.0\.0\.1:\d+: not a kaitian bridge hello",
    "malformed": r"dropped a connection from 127\.0\.0\.1:\d+: not a kaitian bridge hello",
    "silent": r"dropped a connection from 127\.0\.0\.1:\d+: no hello before the group was complete",
    "other_version": r"dropped a connection from 127\.0\.0\.1:\d+: it speaks bridge protocol 99, this "
                     r"rank speaks \d+ \(another kaitian version\?\)",
    "other_job": r"dropped a connection from 127\.0\.0\.1:\d+ \(claims rank 1, channel [01]\): "
                 r"its proof does not match this job's key",
}


@pytest.mark.parametrize("behaviour", sorted(DROPPED))
def test_stranger_on_rank0_port_is_dropped_and_the_job_trains(behaviour):
    """A stranger reaches rank 0's bridge port before the real rank 1 does: it is dropped
    (and logged), never accepted, never fatal; the real ranks build the group well within
    its timeout and all-reduce the right values."""
    port = free_port()
    key = secrets.token_hex(16) if behaviour == "other_job" else None
    rank_env = {"0": {"KAITIAN_BRIDGE_PORTS": f"{port}-{port}"}}
    if key:  # the scheduler gave the job a key; the stranger holds another job's
        rank_env = {"0": {**rank_env["0"], "KAITIAN_JOB_KEY": key}, "1": {"KAITIAN_JOB_KEY": key}}
    stranger = Stranger(port, behaviour, key=secrets.token_hex(16).encode())
    stranger.start()
    # The timeout leaves a CPU-starved run (CI's background lane) time to start its ranks.
    run = _run("1+1", timeout_s=60, rank_env=rank_env, delay={"1": 3})
    try:
        stranger.join(timeout=10)
        assert stranger.connected == 2, "the stranger never reached rank 0's port"
        for rank in (0, 1):
            assert run.returncodes[rank] == 0, _why(run, rank)
            assert _event(run, rank, "init")["seconds"] < 45  # not the timeout: rank 1 is 3 s late
            assert _event(run, rank, "allreduce")["value"] == [3.0] * 4  # 1 + 2, not the stranger's
        assert stranger.closed == [True, True], "rank 0 kept the stranger's connections open"
        for got in stranger.received:  # rank 0 sent a challenge at most, never a welcome
            assert got == b"" or (got[:8] == MAGIC and len(got) == CHALLENGE.size), got
        assert len(re.findall(DROPPED[behaviour], _log(run, 0))) == 2, _log(run, 0)
    finally:
        cleanup(run)


def test_flood_of_silent_connections_does_not_lock_the_real_rank_out():
    """Silent connections reach rank 0 before rank 1, more than it keeps waiting (16 + 2 per
    rank): the oldest unproven ones make room, and rank 1 gets in."""
    port = free_port()
    socks = []

    def flood():
        deadline = time.monotonic() + 30
        while len(socks) < 40 and time.monotonic() < deadline:
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
            except OSError:
                time.sleep(0.002)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    run = _run("1+1", rank_env={"0": {"KAITIAN_BRIDGE_PORTS": f"{port}-{port}"}}, delay={"1": 3})
    try:
        flooder.join(timeout=5)
        assert len(socks) >= 30, len(socks)  # well over the 20 rank 0 keeps waiting
        for rank in (0, 1):
            assert run.returncodes[rank] == 0, _why(run, rank)
            assert _event(run, rank, "allreduce")["value"] == [3.0] * 4
        assert "too many connections were waiting for their handshake; dropped the oldest" in _log(run, 0)
    finally:
        for s in socks:
            s.close()
        cleanup(run)


def test_rank_with_another_jobs_key_is_refused():
    """Rank 1 holds a different KAITIAN_JOB_KEY: it never joins; both ranks fail set-up
    within the group timeout with errors that say why."""
    run = _run("1+1", timeout_s=6, limit=60,
               rank_env={"0": {"KAITIAN_JOB_KEY": "a" * 32}, "1": {"KAITIAN_JOB_KEY": "b" * 32}})
    try:
        assert run.returncodes == [3, 3], [tail(p) for p in run.logs]
        for rank in (0, 1):
            assert _event(run, rank, "error")["seconds"] < 15
        assert re.fullmatch(
            r"kaitian TCP bridge setup: timed out after 6 s; waiting for rank 1 to connect \(dropped "
            r"\d+ connections, last: its proof does not match this job's key \(another job, or a "
            r"different KAITIAN_JOB_KEY\)\)", _event(run, 0, "error")["message"])
        assert re.fullmatch(
            r"kaitian TCP bridge setup: timed out after 6 s; connecting to rank 0 at 127\.0\.0\.1:\d+: "
            r"it closed the connection after this rank's proof \(does it hold another key\? "
            r"KAITIAN_JOB_KEY must be the same on every rank\)", _event(run, 1, "error")["message"])
        assert "its proof does not match this job's key" in _log(run, 0)
    finally:
        cleanup(run)


# --- KAITIAN_BRIDGE_PORTS -------------------------------------------------------------------


def _free_range(n: int):
    """``n`` consecutive free ports; the first is kept listening (occupied) by the caller."""
    for _ in range(50):
        lo = free_port()
        if lo + n > 65535:
            continue
        socks = []
        try:
            for p in range(lo, lo + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
        except OSError:
            for s in socks:
                s.close()
            continue
        socks[0].listen()
        for s in socks[1:]:
            s.close()
        return lo, socks[0]
    pytest.fail("no range of free ports")


def test_bridge_ports_range_is_honoured():
    """KAITIAN_BRIDGE_PORTS=LO-HI with LO taken: every rank listens on a free port of the range."""
    lo, taken = _free_range(4)
    hi = lo + 3
    with taken:
        run = _run("1+1+1", env=TCP + (("KAITIAN_BRIDGE_PORTS", f"{lo}-{hi}"),))
    try:
        for rank in range(3):
            assert run.returncodes[rank] == 0, _why(run, rank)
            assert _event(run, rank, "allreduce")["value"] == [6.0] * 4
        rec = _event(run, 2, "allreduce")
        # rank 2 connected to the listening ports of ranks 0 and 1 (two channels each)
        listen = sorted({rp for lp, rp in rec["conns"] if rec["master_port"] not in (lp, rp)})
        assert len(listen) == 2 and all(lo < p <= hi for p in listen), (lo, hi, rec["conns"])
    finally:
        cleanup(run)


def test_bridge_ports_lost_between_bind_and_listen_go_on_to_the_next(tmp_path, monkeypatch):
    """Ranks of one host may bind the same free port of the range (SO_REUSEADDR allows it while
    nobody listens); the one whose listen then fails must take the next port, not fail the job.

    ``tests/support/listen_race.c`` makes every rank lose its first port that way; the ranks start
    fresh (not forked from the test's zygote) for LD_PRELOAD to take."""
    monkeypatch.setenv("KT_FRESH_RANKS", "1")
    shim = tmp_path / "listen_race.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), os.path.join(SUPPORT, "listen_race.c"), "-ldl"],
                   check=True)
    lo, held = _free_range(6)
    held.close()
    ports = f"{lo}-{lo + 5}"
    run = _run("1+1+1", timeout_s=60, limit=150, env=TCP + (("KAITIAN_BRIDGE_PORTS", ports),
                                                            ("KT_RACE_PORTS", ports), ("LD_PRELOAD", str(shim))))
    try:
        for rank in range(3):
            assert run.returncodes[rank] == 0, _why(run, rank)
            assert "listen_race: port" in _log(run, rank)
            assert _event(run, rank, "allreduce")["value"] == [6.0] * 4
    finally:
        cleanup(run)


@pytest.mark.parametrize("value", ["5-3", "29600", "0-10", "100-70000", "a-b"])
def test_bridge_ports_bad_range_is_a_one_line_error(value):
    with pytest.raises(SettingError) as err:
        Settings.from_env({"KAITIAN_BRIDGE_PORTS": value})
    assert str(err.value) == (f"KAITIAN_BRIDGE_PORTS={value!r}: expected LO-HI, two port numbers "
                              "with 1 <= LO <= HI <= 65535 (e.g. 29600-29699)")
    assert Settings.from_env({"KAITIAN_BRIDGE_PORTS": "29600-29699"}).bridge_ports == (29600, 29699)
    assert Settings.from_env({"KAITIAN_BRIDGE_PORTS": "7-7"}).bridge_ports == (7, 7)
    assert Settings.from_env({}).bridge_ports is None


def test_bridge_ports_bad_range_fails_every_rank():
    run = _run("1+1", env=TCP + (("KAITIAN_BRIDGE_PORTS", "5-3"),), limit=60)
    try:
        for rank in (0, 1):
            err = _event(run, rank, "error")
            assert err["message"] == ("KAITIAN_BRIDGE_PORTS='5-3': expected LO-HI, two port numbers "
                                      "with 1 <= LO <= HI <= 65535 (e.g. 29600-29699)")
            assert err["seconds"] < 10
    finally:
        cleanup(run)


def test_bridge_ports_all_taken_is_a_one_line_error():
    lo, taken = _free_range(1)
    with taken:
        run = _run("1+1", env=TCP + (("KAITIAN_BRIDGE_PORTS", f"{lo}-{lo}"),), limit=60)
    try:
        for rank in (0, 1):
            err = _event(run, rank, "error")
            assert err["message"] == (f"kaitian: no free port in KAITIAN_BRIDGE_PORTS={lo}-{lo} on "
                                      "127.0.0.1 (all 1 in use); widen the range")
            assert err["seconds"] < 10
    finally:
        cleanup(run)


# --- the job key ------------------------------------------------------------------------------


def test_hmac_sha256_matches_python():
    from kaitian import _C

    for key_len in (0, 1, 32, 64, 65, 200):
        for msg_len in (0, 1, 55, 56, 63, 64, 65, 119, 120, 1000):
            key, msg = secrets.token_bytes(key_len), secrets.token_bytes(msg_len)
            assert _C._hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()


def test_job_key_is_never_written_to_the_store():
    five = factory.timedelta(seconds=5)
    given, unset = Settings.from_env({"KAITIAN_JOB_KEY": "k" * 32}), Settings.from_env({})
    store = dist.HashStore()
    assert factory._bridge_key(store, 0, given, five) == b"k" * 32
    assert factory._bridge_key(store, 1, given, five) == b"k" * 32
    assert store.num_keys() == 1 and store.get("kaitian/bridge_key") == b"given"  # only that it is set
    with pytest.raises(factory.BackendSetupError) as err:
        factory._bridge_key(store, 1, unset, five)
    assert str(err.value) == ("KAITIAN_JOB_KEY is set on rank 0 but not on this rank; set the same "
                              "KAITIAN_JOB_KEY on every rank, or on none")
    # No key anywhere (plain torchrun): rank 0 makes one per group, shared through its store.
    store = dist.HashStore()
    key = factory._bridge_key(store, 0, unset, five)
    assert re.fullmatch(rb"[0-9a-f]{64}", key) and factory._bridge_key(store, 1, unset, five) == key
    with pytest.raises(factory.BackendSetupError, match="set on this rank but not on rank 0"):
        factory._bridge_key(store, 1, given, five)


def test_short_job_key_is_a_one_line_error():
    with pytest.raises(SettingError) as err:
        Settings.from_env({"KAITIAN_JOB_KEY": "secret"})
    assert str(err.value) == ("KAITIAN_JOB_KEY is too short (6 characters); use at least 16 random "
                              "characters, e.g. python -c 'import secrets; print(secrets.token_hex(32))'")


# --- the run directory ---------------------------------------------------------------------


def _run_dir_case(tmp_path, how):
    path = tmp_path / "run"
    path.mkdir()
    if how == "mode 0777":
        os.chmod(path, 0o777)
        return str(path), (f"KAITIAN_RUN_DIR={path} is writable by other users (mode 0777); "
                           "chmod 700 it or point KAITIAN_RUN_DIR at a private directory")
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    return str(path), (f"KAITIAN_RUN_DIR={path} belongs to uid {nobody.pw_uid}, not to this "
                       f"process (uid {os.geteuid()}); point KAITIAN_RUN_DIR at a directory of your own")


@pytest.mark.parametrize("how", ["mode 0777", "owned by nobody"])
def test_unsafe_run_dir_is_refused(tmp_path, how):
    """A run dir others can write (or that another user owns) could be seeded with a
    forged file store: every rank refuses it at once with one line, leaving nothing."""
    path, message = _run_dir_case(tmp_path, how)
    run = _run("1+1", env=(("KAITIAN_RUN_DIR", path),), limit=60)
    try:
        for rank in (0, 1):
            err = _event(run, rank, "error")
            assert err["message"] == message and err["type"] == "BackendSetupError"
            assert err["seconds"] < 10
        assert os.listdir(path) == []  # refused before any store file or segment exists
    finally:
        cleanup(run)


def test_store_file_is_created_owner_only(tmp_path):
    old = os.umask(0)
    try:
        path = str(tmp_path / "bridge.store")
        factory._owner_only_file(path)
        factory._owner_only_file(path)  # every rank calls it; the second finds it
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o600
