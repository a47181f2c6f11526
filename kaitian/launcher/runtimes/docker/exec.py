"""Workers as ``docker exec`` processes: started, streamed, watched and stopped.

A ``PContext`` (torch's interface for a set of worker processes) whose workers
run inside containers, so the elastic agent treats them like local processes.
Each worker is one ``docker exec`` of its spec's wrapper, which records the
worker's in-container pid (its process group). The Engine API cannot kill an
exec, and killing the exec's client would leave the worker running, so a
worker is stopped by signalling its process group from inside its container:
the agent's signal first, SIGKILL after the shutdown timeout.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Tuple

from kaitian._torch import PContext, ProcessFailure, RunProcsResult, call_supported
from kaitian.launcher.runtimes.docker.start import ExecSpec

if TYPE_CHECKING:
    from kaitian.launcher.runtimes.base import WorkerStart

__all__ = ["DockerExecContext", "exit_code_from_docker", "stop_command"]

logger = logging.getLogger(__name__)

# How long a worker may take to write its pid after its exec started.
_PID_WAIT_S = 5.0
# After KILL, how long to wait for the exec to report its exit before giving up.
_KILL_WAIT_S = 10.0
# How far an ended worker's output may lag the Engine's report of its exit (a CPU-starved agent).
_DRAIN_S = 5.0


def exit_code_from_docker(code: Optional[int]) -> int:
    """torchrun's exit code (``-N`` for a signal) from the Engine's (``128 + N``).

    The Engine reports a worker killed by signal N as ``128 + N``, which is also
    what a shell reports, so the mapping is the one users expect from torchrun.
    """
    if code is None:
        return -9
    if 128 < code < 128 + 65:
        return -(code - 128)
    return code


def stop_command(pgids: Iterable[int], sig_name: str) -> Tuple[str, ...]:
    """Signals whole worker process groups inside a container; one already gone does not stop the others."""
    sig = sig_name[3:] if sig_name.startswith("SIG") else sig_name
    parts = [f"kill -s {shlex.quote(sig)} -- -{int(p)} 2>/dev/null || true" for p in pgids]
    return ("sh", "-c", "; ".join(parts) or "true")


class _Exec:
    """One worker's ``docker exec``: started, streamed, and its exit recorded."""

    def __init__(
        self,
        client: object,
        container_id: str,
        spec: ExecSpec,
        stdout: str,
        stderr: str,
        prefix: str,
    ) -> None:
        self.client = client
        self.container_id = container_id
        self.spec = spec
        self.exec_id: Optional[str] = None
        self.host_pid: Optional[int] = None
        self.exit_code: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.started = threading.Event()
        self.done = threading.Event()
        self._stdout_path = stdout
        self._stderr_path = stderr
        self._prefix = prefix.encode()
        self._thread = threading.Thread(
            target=self._run, name=f"kaitian-docker-exec-{spec.local_rank}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _sink(self, path: str, console: IO[bytes]) -> Tuple[Callable[[bytes], None], Callable[[], None]]:
        """A writer for one stream: the rank's log file, or the console with a prefix.

        Output arrives in arbitrary chunks; only whole lines are written, so the
        tee (which tails the file line by line) never splits a line. The file is
        opened at the first line only: a worker that writes its log itself
        creates it as its own user, and its stream brings at most the wrapper's
        complaints.
        """
        if path:
            files: List[IO[bytes]] = []

            def emit(lines: List[bytes]) -> None:
                if not files:
                    files.append(open(path, "ab", buffering=0))  # noqa: SIM115 (closed by finish)
                files[0].write(b"".join(line + b"\n" for line in lines))

            def finish() -> None:
                for f in files:
                    f.close()
        else:
            prefix = self._prefix

            def emit(lines: List[bytes]) -> None:
                console.write(b"".join(prefix + line + b"\n" for line in lines))
                console.flush()

            def finish() -> None:
                pass

        pending = bytearray()

        def write(data: bytes) -> None:
            pending.extend(data)
            cut = pending.rfind(b"\n")
            if cut >= 0:
                emit(bytes(pending[:cut]).split(b"\n"))
                del pending[: cut + 1]

        def close() -> None:
            if pending:
                emit([bytes(pending)])
                pending.clear()
            finish()

        return write, close

    def _run(self) -> None:
        api = self.client.api
        out_write, out_close = self._sink(self._stdout_path, sys.stdout.buffer)
        err_write, err_close = self._sink(self._stderr_path, sys.stderr.buffer)
        try:
            created = api.exec_create(
                self.container_id,
                list(self.spec.cmd),
                environment=self.spec.env_list(),
                workdir=self.spec.workdir,
                user=self.spec.user,
            )
            self.exec_id = created["Id"]
            stream = api.exec_start(self.exec_id, stream=True, demux=True)
            # The wrapper writes the pid before anything else, so this is quick;
            # pids are known once start() returns, as for local processes.
            self.container_pid()
            self.host_pid = self._inspect_pid()
            self.started.set()
            for out, err in stream:
                if out:
                    out_write(out)
                if err:
                    err_write(err)
            self.exit_code = self._wait_exit()
        except BaseException as exc:  # noqa: BLE001 (reported as the worker's failure)
            self.error = exc
            self.exit_code = self.exit_code if self.exit_code is not None else 1
            logger.error("docker exec of local rank %s failed: %s", self.spec.local_rank, exc)
        finally:
            out_close()
            err_close()
            self.started.set()
            self.done.set()

    def _inspect_pid(self) -> Optional[int]:
        """The worker's host pid; the Engine may report it a moment after the start."""
        for _ in range(50):
            pid = self.client.api.exec_inspect(self.exec_id).get("Pid")
            if pid:
                return int(pid)
            if self.done.is_set():
                break
            time.sleep(0.01)
        return None

    def _wait_exit(self) -> int:
        """The exec's exit code once the Engine reports it (streams end slightly earlier)."""
        deadline = time.monotonic() + 10.0
        while True:
            info = self.client.api.exec_inspect(self.exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                return exit_code_from_docker(info["ExitCode"])
            if time.monotonic() > deadline:
                return exit_code_from_docker(None)
            time.sleep(0.02)

    def poll_engine(self) -> None:
        """Asks the Engine whether the worker ended while its output stream stays
        open (a child it left behind still holds the pipe)."""
        if self.done.is_set() or not self.exec_id:
            return
        try:
            info = self.client.api.exec_inspect(self.exec_id)
        except Exception:  # noqa: BLE001 (the stream thread reports real failures)
            return
        if not info.get("Running") and info.get("ExitCode") is not None:
            self._thread.join(_DRAIN_S)  # its last output first: the stream may lag the exit
            if not self.done.is_set():  # still open: held by a child the worker left behind
                self.exit_code = exit_code_from_docker(info["ExitCode"])
                self.done.set()

    def container_pid(self, wait: float = _PID_WAIT_S) -> Optional[int]:
        """The worker's pid (= its process group) inside the container."""
        deadline = time.monotonic() + wait
        while True:
            try:
                with open(self.spec.pid_file) as f:
                    return int(f.read().strip())
            except (OSError, ValueError):
                pass
            if self.done.is_set() or time.monotonic() > deadline:
                return None
            time.sleep(0.005)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class DockerExecContext(PContext):
    """A ``PContext`` whose workers are ``docker exec`` processes in containers.

    The agent drives it exactly like local subprocesses: ``start``, ``wait`` /
    ``_poll``, ``pids``, ``close``. Containers are prepared (created or reused)
    by the runtime through ``prepare`` when the context starts, after torch has
    decided the log and error-file paths that must be visible inside.

    Args:
        job: what to run (its entrypoint a binary: the host's python, usually).
        prepare: called once at start with this context; returns each local
            rank's exec spec and container id.
        client: the docker SDK client.
        duplicate_stdout_filters: torchrun's ``--duplicate-stdout-filters``.
        duplicate_stderr_filters: torchrun's ``--duplicate-stderr-filters``.
    """

    def __init__(
        self,
        job: "WorkerStart",
        prepare: Callable[["DockerExecContext"], Dict[int, Tuple[ExecSpec, str]]],
        client: object,
        duplicate_stdout_filters: Optional[List[str]] = None,
        duplicate_stderr_filters: Optional[List[str]] = None,
    ) -> None:
        call_supported(
            super().__init__, job.name, job.entrypoint, job.args, job.envs, job.logs_specs,
            job.log_line_prefixes, duplicate_stdout_filters=duplicate_stdout_filters,
            duplicate_stderr_filters=duplicate_stderr_filters,
        )
        self._prepare = prepare
        self._client = client
        self._prefixes = job.log_line_prefixes or {}
        self._execs: Dict[int, _Exec] = {}
        self._failures: Dict[int, ProcessFailure] = {}
        self._running: set = set(range(self.nprocs))
        self._last_engine_poll = 0.0

    def _start(self) -> None:
        if self._execs:
            raise ValueError("docker exec context started twice")
        specs = self._prepare(self)
        for rank in range(self.nprocs):
            spec, container_id = specs[rank]
            try:
                os.unlink(spec.pid_file)
            except FileNotFoundError:
                pass
            self._execs[rank] = _Exec(
                self._client,
                container_id,
                spec,
                self.stdouts[rank],
                self.stderrs[rank],
                self._prefixes.get(rank, ""),
            )
        for ex in self._execs.values():
            ex.start()
        for ex in self._execs.values():
            ex.started.wait(60)

    def _capture(self, done: set) -> None:
        now = time.monotonic()
        if now - self._last_engine_poll > 2.0:
            self._last_engine_poll = now
            for rank in self._running:
                self._execs[rank].poll_engine()
        for rank in self._running:
            ex = self._execs[rank]
            if not ex.done.is_set():
                continue
            done.add(rank)
            code = ex.exit_code if ex.exit_code is not None else 1
            if code != 0 and rank not in self._failures:
                self._failures[rank] = ProcessFailure(
                    local_rank=rank,
                    pid=ex.host_pid or -1,
                    exitcode=code,
                    error_file=self.error_files.get(rank, ""),
                )

    def _poll(self) -> Optional[RunProcsResult]:
        done: set = set()
        self._capture(done)
        self._running.difference_update(done)
        if self._running and not self._failures:
            return None
        self.close()
        self._capture(done)
        self._running.difference_update(done)
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

    def exit_codes(self) -> Dict[int, Optional[int]]:
        """Each worker's exit code (``None`` while it runs), stopping nobody (``--on-failure continue``)."""
        now = time.monotonic()
        if now - self._last_engine_poll > 2.0:
            self._last_engine_poll = now
            for ex in self._execs.values():
                ex.poll_engine()
        return {rank: (ex.exit_code if ex.exit_code is not None else 1) if ex.done.is_set() else None
                for rank, ex in self._execs.items()}

    def kill(self, rank: int) -> None:
        """SIGKILLs one worker's process group inside its container."""
        self._signal([self._execs[rank]], signal.SIGKILL)

    def pids(self) -> Dict[int, int]:
        """Host pids of the workers (``exec_inspect``); -1 until the Engine reports one
        (a pid inside a container names another process on the host)."""
        return {rank: ex.host_pid or -1 for rank, ex in self._execs.items()}

    def _signal(self, execs: Iterable[_Exec], sig: signal.Signals) -> None:
        """Signals the workers' process groups from inside their containers.

        As the workers' own user: containers keep no capability to signal
        another user's processes.
        """
        by_container: Dict[Tuple[str, str], List[int]] = {}
        for ex in execs:
            pgid = ex.container_pid()
            if pgid is None:
                continue
            by_container.setdefault((ex.container_id, ex.spec.user), []).append(pgid)
        for (container_id, user), pgids in by_container.items():
            try:
                api = self._client.api
                exec_id = api.exec_create(container_id, list(stop_command(pgids, sig.name)), user=user)["Id"]
                api.exec_start(exec_id)
            except Exception as exc:  # noqa: BLE001 (container already gone: workers are too)
                logger.warning("could not signal workers in container %s: %s", container_id[:12], exc)

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        live = [ex for ex in self._execs.values() if not ex.done.is_set()]
        if not live:
            self._cleanup()
            return
        for ex in live:
            logger.warning(
                "Sending worker %s (local rank %s, in container) closing signal %s",
                ex.host_pid, ex.spec.local_rank, death_sig.name,
            )
        self._signal(live, death_sig)
        end = time.monotonic() + timeout
        for ex in live:
            ex.done.wait(max(0.0, end - time.monotonic()))
        still = [ex for ex in live if not ex.done.is_set()]
        if still:
            logger.warning(
                "Unable to stop %d worker(s) via %s, killing them with SIGKILL", len(still), death_sig.name
            )
            self._signal(still, signal.SIGKILL)
            end = time.monotonic() + _KILL_WAIT_S
            for ex in still:
                ex.done.wait(max(0.0, end - time.monotonic()))
        self._cleanup()

    def _cleanup(self) -> None:
        for ex in self._execs.values():
            ex.join(1.0)
            try:
                os.unlink(ex.spec.pid_file)
            except FileNotFoundError:
                pass
