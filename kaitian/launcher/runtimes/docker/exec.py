"""Workers as ``docker exec`` processes: a torch ``PContext``, so the agent drives them as local ones.

The Engine API cannot kill an exec, and killing the exec's client would leave the worker running: a
worker is stopped by signalling its process group (its pid, which the wrapper records) from inside
its container, the agent's signal first, SIGKILL after the shutdown timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import IO, Callable, Dict, Iterable, List, Optional, Tuple

from kaitian._torch import PContext, ProcessFailure, RunProcsResult, call_supported
from kaitian.launcher.runtimes.base import WorkerStart
from kaitian.launcher.runtimes.docker.start import ExecSpec
from kaitian.launcher.runtimes.options import RuntimeOptions

__all__ = ["DockerExecContext", "exit_code_from_docker", "stop_command"]

logger = logging.getLogger(__name__)

_PID_WAIT_S = 5.0  # for a worker's pid file after its exec started
_KILL_WAIT_S = 10.0  # for the Engine to report a SIGKILLed exec's exit
_DRAIN_S = 5.0  # how far an ended worker's output may lag the Engine's report (a CPU-starved agent)
_ENGINE_POLL_S = 2.0


def exit_code_from_docker(code: Optional[int]) -> int:
    """torchrun's ``-N`` for signal N from the Engine's ``128 + N``."""
    if code is None:
        return -9
    return -(code - 128) if 128 < code < 128 + 65 else code


def stop_command(pgids: Iterable[int], sig: signal.Signals) -> Tuple[str, ...]:
    """Signals worker process groups inside a container; one already gone does not stop the others."""
    return ("sh", "-c", "; ".join(f"kill -s {sig.name[3:]} -- -{int(p)} 2>/dev/null || true" for p in pgids) or "true")


def _wait_for(read: Callable[[], Optional[int]], seconds: float, step: float,
              done: Optional[threading.Event] = None) -> Optional[int]:
    deadline = time.monotonic() + seconds
    while (value := read()) is None and time.monotonic() < deadline and not (done and done.is_set()):
        time.sleep(step)
    return value


class _Lines:
    """An exec's output stream in whole lines (torch tails log files by line) to the rank's log file, opened
    at its first line (a worker writing its own log creates it as its user), or to the console."""

    def __init__(self, path: str, console: IO[bytes], prefix: bytes) -> None:
        self.path, self.console, self.prefix = path, console, prefix
        self.file: Optional[IO[bytes]] = None
        self.pending = b""

    def write(self, data: bytes) -> None:
        data = self.pending + data
        cut = data.rfind(b"\n") + 1
        text, self.pending = data[:cut], data[cut:]
        if not text:
            return
        if self.path:
            if self.file is None:
                self.file = open(self.path, "ab", buffering=0)  # noqa: SIM115 (closed by close)
            self.file.write(text)
        else:
            self.console.write(b"".join(self.prefix + line + b"\n" for line in text[:-1].split(b"\n")))
            self.console.flush()

    def close(self) -> None:
        if self.pending:
            self.write(b"\n")
        if self.file is not None:
            self.file.close()


class _Exec:
    """One worker's ``docker exec``: started, streamed and its exit recorded on its own thread."""

    def __init__(self, client: object, container_id: str, spec: ExecSpec, stdout: str, stderr: str,
                 prefix: str) -> None:
        self.client, self.container_id, self.spec = client, container_id, spec
        self.exec_id: Optional[str] = None
        self.host_pid: Optional[int] = None
        self.exit_code: Optional[int] = None
        self.started = threading.Event()
        self.done = threading.Event()
        self._out = _Lines(stdout, sys.stdout.buffer, prefix.encode())
        self._err = _Lines(stderr, sys.stderr.buffer, prefix.encode())
        self.thread = threading.Thread(target=self._run, name=f"kaitian-docker-exec-{spec.local_rank}", daemon=True)

    @property
    def code(self) -> Optional[int]:
        return (1 if self.exit_code is None else self.exit_code) if self.done.is_set() else None

    def _run(self) -> None:
        api = self.client.api
        try:
            self.exec_id = api.exec_create(self.container_id, list(self.spec.cmd), environment=dict(self.spec.env),
                                           workdir=self.spec.workdir, user=self.spec.user)["Id"]
            stream = api.exec_start(self.exec_id, stream=True, demux=True)
            # The wrapper writes its pid first: pids are known once start() returns, as for local processes.
            self.container_pid()
            # the Engine may report the host pid a moment after the start
            self.host_pid = _wait_for(lambda: api.exec_inspect(self.exec_id).get("Pid") or None, 0.5, 0.01, self.done)
            self.started.set()
            for out, err in stream:
                if out:
                    self._out.write(out)
                if err:
                    self._err.write(err)
            # the streams end slightly before the Engine reports the exit
            self.exit_code = exit_code_from_docker(_wait_for(self._ended, 10.0, 0.02))
        except BaseException as exc:  # noqa: BLE001 (reported as the worker's failure: exit code 1)
            logger.error("docker exec of local rank %s failed: %s", self.spec.local_rank, exc)
        finally:
            self._out.close()
            self._err.close()
            self.started.set()
            self.done.set()

    def _ended(self) -> Optional[int]:
        info = self.client.api.exec_inspect(self.exec_id)
        return None if info.get("Running") else info.get("ExitCode")

    def poll_engine(self) -> None:
        """Ends a worker the Engine reports ended while a child it left behind holds its stream open."""
        if self.done.is_set() or not self.exec_id:
            return
        try:
            code = self._ended()
        except Exception:  # noqa: BLE001 (the stream thread reports real failures)
            return
        if code is not None:
            self.thread.join(_DRAIN_S)  # its last output first: the stream may lag the exit
            if not self.done.is_set():
                self.exit_code = exit_code_from_docker(code)
                self.done.set()

    def container_pid(self) -> Optional[int]:
        def read() -> Optional[int]:
            try:
                with open(self.spec.pid_file) as f:
                    return int(f.read().strip())
            except (OSError, ValueError):
                return None

        return _wait_for(read, _PID_WAIT_S, 0.005, self.done)


class DockerExecContext(PContext):
    """``prepare`` (the runtime's) is called at the start, once torch has decided the log and error files
    the containers must show, and returns each process's exec and container id."""

    def __init__(self, job: WorkerStart, prepare: Callable[["DockerExecContext"], Dict[int, Tuple[ExecSpec, str]]],
                 client: object, options: RuntimeOptions) -> None:
        call_supported(
            super().__init__, job.name, job.entrypoint, job.args, job.envs, job.logs_specs,
            job.log_line_prefixes, duplicate_stdout_filters=options.duplicate_stdout_filters,
            duplicate_stderr_filters=options.duplicate_stderr_filters,
        )
        self._prepare, self._client = prepare, client
        self._prefixes = job.log_line_prefixes or {}
        self._execs: Dict[int, _Exec] = {}
        self._failures: Dict[int, ProcessFailure] = {}  # in the order seen: the first is the root cause
        self._last_engine_poll = 0.0

    def _start(self) -> None:
        for rank, (spec, container_id) in sorted(self._prepare(self).items()):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec.pid_file)
            self._execs[rank] = _Exec(self._client, container_id, spec, self.stdouts[rank], self.stderrs[rank],
                                      self._prefixes.get(rank, ""))
        for ex in self._execs.values():
            ex.thread.start()
        for ex in self._execs.values():
            ex.started.wait(60)

    def exit_codes(self) -> Dict[int, Optional[int]]:
        """Each worker's exit code (``None`` while it runs), stopping nobody (``--on-failure continue``)."""
        if time.monotonic() - self._last_engine_poll > _ENGINE_POLL_S:
            self._last_engine_poll = time.monotonic()
            for ex in self._execs.values():
                ex.poll_engine()
        return {rank: ex.code for rank, ex in self._execs.items()}

    def _capture(self) -> bool:
        """Whether a worker still runs; records new failures."""
        codes = self.exit_codes()
        for rank, code in sorted(codes.items()):
            if code and rank not in self._failures:
                self._failures[rank] = ProcessFailure(local_rank=rank, pid=self._execs[rank].host_pid or -1,
                                                      exitcode=code, error_file=self.error_files.get(rank, ""))
        return None in codes.values()

    def _poll(self) -> Optional[RunProcsResult]:
        if self._capture() and not self._failures:
            return None
        self.close()
        self._capture()
        result = RunProcsResult(failures=self._failures, stdouts=self.stdouts, stderrs=self.stderrs)
        if result.is_failed():
            first = min(result.failures.values(), key=lambda f: f.timestamp)
            logger.error(
                "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s (in docker)",
                first.exitcode, first.local_rank, first.pid, self.entrypoint,
            )
        else:
            result.return_values = dict.fromkeys(range(self.nprocs))
        return result

    def kill(self, rank: int) -> None:
        self._signal([self._execs[rank]], signal.SIGKILL)

    def pids(self) -> Dict[int, int]:
        """Host pids (-1 until the Engine reports one: a pid inside a container names another process here)."""
        return {rank: ex.host_pid or -1 for rank, ex in self._execs.items()}

    def _signal(self, execs: Iterable[_Exec], sig: signal.Signals) -> None:
        """As the workers' own user: containers keep no capability to signal another user's processes."""
        by_container: Dict[Tuple[str, str], List[int]] = {}
        for ex in execs:
            pgid = ex.container_pid()
            if pgid is not None:
                by_container.setdefault((ex.container_id, ex.spec.user), []).append(pgid)
        for (container_id, user), pgids in by_container.items():
            try:
                api = self._client.api
                api.exec_start(api.exec_create(container_id, list(stop_command(pgids, sig)), user=user)["Id"])
            except Exception as exc:  # noqa: BLE001 (container already gone: workers are too)
                logger.warning("could not signal workers in container %s: %s", container_id[:12], exc)

    def _stop(self, execs: List[_Exec], sig: signal.Signals, timeout: float) -> List[_Exec]:
        """Those of ``execs`` still running ``timeout`` after the signal."""
        self._signal(execs, sig)
        end = time.monotonic() + timeout
        for ex in execs:
            ex.done.wait(max(0.0, end - time.monotonic()))
        return [ex for ex in execs if not ex.done.is_set()]

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        live = [ex for ex in self._execs.values() if not ex.done.is_set()]
        for ex in live:
            logger.warning(
                "Sending worker %s (local rank %s, in container) closing signal %s",
                ex.host_pid, ex.spec.local_rank, death_sig.name,
            )
        still = self._stop(live, death_sig, timeout)
        if still:
            logger.warning(
                "Unable to stop %d worker(s) via %s, killing them with SIGKILL", len(still), death_sig.name
            )
            self._stop(still, signal.SIGKILL, _KILL_WAIT_S)
        for ex in self._execs.values():
            ex.thread.join(1.0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ex.spec.pid_file)
