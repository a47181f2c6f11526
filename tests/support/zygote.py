"""Rank processes forked from one interpreter that has already imported torch.

A fresh ``python worker.py`` spends about 1.2 s of CPU here importing torch,
and the backend tests start several hundred ranks a run. As PyTorch's own
multi-process tests fork their ranks, ours are forks of a *zygote*: one process
per test session that imports torch (and nothing of kaitian: the rank imports
kaitian itself, under its own environment). A forked rank costs about 30 ms.

Apart from the interpreter it starts from, a rank is what ``python SCRIPT ARGS``
would be: its own session, environment, working directory, ``sys.argv`` and
``sys.path``, a fresh ``__main__``, stdin from /dev/null, stdout and stderr to
its log (unbuffered under ``PYTHONUNBUFFERED``), and a normal interpreter exit
(atexit handlers, finalisation, the exit status of an uncaught exception or
``SystemExit``); tests/unit/test_zygote.py compares the two.
``KT_FRESH_RANKS=1`` starts every rank as a fresh interpreter instead.

Protocol (JSON lines over a socket pair): the test sends a rank's
``{"argv", "env", "cwd", "log"}``; the zygote answers ``{"pid"}`` (or
``{"error"}``), and ``{"end": pid, "returncode": rc}`` once that rank is reaped.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Optional, Sequence

__all__ = ["start_rank"]


def start_rank(argv: Sequence[str], env: Dict[str, str], cwd: str, log: str):
    """Starts ``python argv...`` as a rank in its own session, output to ``log``.

    Returns:
        A handle with ``pid``, ``returncode``, ``poll()`` and ``wait(timeout)``
        (raising ``subprocess.TimeoutExpired``), as ``subprocess.Popen`` has.
    """
    if os.environ.get("KT_FRESH_RANKS") == "1":
        with open(log, "w") as fh:
            return subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
    zygote = _zygote()
    return _ForkedRank(zygote, zygote.start(list(argv), env, cwd, log))


# --- the test's side -------------------------------------------------------------------

class _Zygote:
    """The test process's link to its zygote (started on first use)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KAITIAN_") and k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"  # else numpy's OpenBLAS starts a thread, and the zygote must fork alone
        self.owner = os.getpid()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._buf = b""
        self._ended: Dict[int, int] = {}
        self._lock = threading.Lock()

    def start(self, argv, env, cwd, log) -> int:
        with self._lock:
            self._sock.sendall(json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log}).encode() + b"\n")
            while True:
                msg = self._next(None)
                if "pid" in msg:
                    return msg["pid"]
                if "error" in msg:
                    raise OSError(f"the rank zygote could not start {argv[0]}: {msg['error']}")

    def wait(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """The rank's exit status, waiting up to ``timeout`` seconds (None: for ever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._ended:
                if self._next(deadline) is None:
                    return None
            return self._ended.pop(pid)

    def _next(self, deadline: Optional[float]) -> Optional[dict]:
        """The next message (an end is recorded as well); None once ``deadline`` passed."""
        while b"\n" not in self._buf:
            self._sock.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                data = self._sock.recv(1 << 16)  # (past the deadline: what has already come)
            except (socket.timeout, BlockingIOError):
                return None
            if not data:
                raise RuntimeError(f"the rank zygote (pid {self.proc.pid}) ended, exit {self.proc.wait()}")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if "end" in msg:
            self._ended[msg["end"]] = msg["returncode"]
        return msg


_ZYGOTE: Optional[_Zygote] = None


def _zygote() -> _Zygote:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.owner != os.getpid() or _ZYGOTE.proc.poll() is not None:
        _ZYGOTE = _Zygote()
    return _ZYGOTE


class _ForkedRank:
    """A rank forked by the zygote, with the part of ``subprocess.Popen`` the tests use."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
        return self.returncode


# --- the zygote's side -----------------------------------------------------------------

def _serve(fd: int) -> Optional[dict]:
    """Forks a rank per request and reports each one's end; returns a request only in a fork."""
    import torch  # noqa: F401  what every rank would spend its first second on

    sock = socket.socket(fileno=fd)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    ranks: Dict[int, int] = {}  # pidfd -> pid
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.fileobj is not sock:  # a rank ended
                pid = ranks.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                sock.sendall(json.dumps({"end": pid, "returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                continue
            data = sock.recv(1 << 20)
            if not data:  # the test session is gone
                return None
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as e:
                    sock.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
                    continue
                if pid == 0:
                    sel.close()
                    sock.close()
                    for pidfd in ranks:
                        os.close(pidfd)
                    return request
                pidfd = os.pidfd_open(pid)
                ranks[pidfd] = pid
                sel.register(pidfd, selectors.EVENT_READ)
                sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _become_rank(request: dict, base_path: list) -> dict:
    """Turns this fork into ``python argv...``; returns the fresh ``__main__``'s namespace."""
    import importlib.machinery
    import io
    import types

    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def output(fd: int, **kw) -> io.TextIOWrapper:  # as the interpreter makes sys.stdout and sys.stderr
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), write_through=unbuffered, **kw)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = output(1)
    sys.stderr = sys.__stderr__ = output(2, errors="backslashreplace", line_buffering=True)
    script = request["argv"][0]
    with open("/proc/self/comm", "w") as fh:  # ps and top name the rank by its script, not the zygote
        fh.write(os.path.basename(script)[:15])
    sys.argv = list(request["argv"])
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *pythonpath, *base_path]
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    main = types.ModuleType("__main__")
    main.__file__ = script
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", script)
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    return main.__dict__


if __name__ == "__main__":
    _BASE_PATH = sys.path[1:]  # the interpreter's own path, less this file's directory
    _REQUEST = _serve(int(sys.argv[1]))
    if _REQUEST is not None:
        _NAMESPACE = _become_rank(_REQUEST, _BASE_PATH)
        with open(_REQUEST["argv"][0], "rb") as _fh:
            _CODE = compile(_fh.read(), _REQUEST["argv"][0], "exec")
        exec(_CODE, _NAMESPACE)  # as `python script`: an exception or SystemExit ends the interpreter
