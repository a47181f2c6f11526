"""A multi-host network on one machine: one network namespace per "host", joined by a switch.

Each host gets its own network namespace (its own loopback, interface and
address in a private range that exists only inside these namespaces), and
every command run on it its own host name (a UTS namespace) and an
``/etc/hosts`` naming every host of the bed (bind-mounted in a private mount
namespace), so ``socket.getfqdn()`` and rendezvous endpoints resolve as
on a real cluster. The hosts' interfaces are veth pairs whose other ends sit
on a bridge inside a separate "switch" namespace: nothing is added to the
machine's own network namespace.

Commands enter the namespace with ``nsenter --net`` rather than ``ip netns
exec``, which would remount ``/sys`` and hide the cgroup mounts (slurmd needs
them). Everything is removed on exit (processes in the namespaces killed,
namespaces deleted, the hosts file removed), even when the test fails; a bed
left by a killed test run is collected by the next one.

Needs root and iproute2 (``ip netns``, veth, bridge) and util-linux
(``unshare``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

__all__ = ["Host", "Bed", "bed", "available", "collect_stale"]

_PREFIX = "ktbed"


def available() -> Optional[str]:
    """``None`` when a bed can be built here, else why not."""
    if os.geteuid() != 0:
        return "the multi-host bed needs root (network namespaces)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"the multi-host bed needs {tool!r} (apt-get install iproute2 util-linux)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _namespaces() -> List[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """SIGKILLs every process in ``ns`` (a host that dies: its agent and its workers)."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _remove(ns: str) -> None:
    _kill_namespace(ns)
    _ip("netns", "delete", ns, check=False)


def collect_stale() -> List[str]:
    """Removes beds whose creating process is gone (names carry its pid)."""
    def dead(name: str) -> bool:
        parts = name.split("-")
        return len(parts) >= 3 and parts[0] == _PREFIX and parts[1].isdigit() and not os.path.exists(
            f"/proc/{parts[1]}")

    removed = []
    for ns in filter(dead, _namespaces()):
        _remove(ns)
        removed.append(ns)
    tmp = tempfile.gettempdir()
    for name in filter(dead, os.listdir(tmp)):
        if name.endswith(".hosts"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(tmp, name))
            removed.append(name)
    return removed


@dataclass
class Host:
    """One simulated host.

    Attributes:
        name: its host name (resolves to ``addr`` on every host of the bed).
        ns: its network namespace.
        addr: its IPv4 address.
    """

    name: str
    ns: str
    addr: str
    hosts_file: str = ""
    procs: List[subprocess.Popen] = field(default_factory=list, repr=False)

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run on this host: in its namespace, under its host name."""
        return ["nsenter", f"--net=/run/netns/{self.ns}", "unshare", "--uts", "--mount", "sh", "-c",
                'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"',
                self.name, self.hosts_file, *argv]

    def popen(self, argv: Sequence[str], env: Dict[str, str], **kwargs) -> subprocess.Popen:
        """Starts ``argv`` on this host in its own session (output to a pipe unless told)."""
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.STDOUT)
        proc = subprocess.Popen(self.command(argv), env=env, text=True, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 60,
            **kwargs) -> subprocess.CompletedProcess:
        """Runs ``argv`` on this host to completion."""
        return subprocess.run(self.command(argv), env=env, capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    def kill(self) -> None:
        """The host dies: every process on it is SIGKILLed at once."""
        _kill_namespace(self.ns)


@dataclass
class Bed:
    """The hosts of one bed (by default ``hosts[i].name == f"h{i}"``)."""

    hosts: List[Host]
    switch: str

    def finish(self, procs: Sequence[subprocess.Popen], timeout: float) -> List[str]:
        """Each process's output once all have exited (``timeout`` seconds for all).

        One still running then is killed with everything on its host: its workers
        hold its output pipe too, so killing it alone would leave the read hanging.
        """
        deadline = time.monotonic() + timeout
        outs = []
        for proc in procs:
            try:
                out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:
                host = next(h for h in self.hosts if proc in h.procs)
                host.kill()
                try:
                    out = proc.communicate(timeout=30)[0]
                except subprocess.TimeoutExpired as e:  # something off the host holds the pipe
                    proc.kill()
                    out = (e.output or b"").decode(errors="replace")
                out += f"\n[still running after {timeout:.0f} s: killed with everything on {host.name}]"
            outs.append(out)
        return outs


@contextlib.contextmanager
def bed(count: int, subnet: Optional[int] = None, names: Sequence[str] = (),
        aliases: Optional[Dict[str, Sequence[str]]] = None) -> Iterator[Bed]:
    """Builds ``count`` hosts ``h0``…, removes them (and all their processes) afterwards.

    Args:
        count: number of hosts.
        names: host names instead of ``h0``, ``h1``, … (e.g. Kubernetes pod names).
        aliases: more names per host name, resolving to its address (service DNS names).
        subnet: third octet of the bed's ``10.213.X.0/24`` (default: from the pid,
            so concurrent test runs use different ranges).
    """
    why = available()
    if why:
        raise RuntimeError(why)
    collect_stale()
    tag = f"{_PREFIX}-{os.getpid()}-{time.monotonic_ns() % 100000}"
    x = subnet if subnet is not None else os.getpid() % 250 + 1
    switch = f"{tag}-sw"
    names = list(names) or [f"h{i}" for i in range(count)]
    fd, hosts_file = tempfile.mkstemp(prefix=f"{tag}-", suffix=".hosts")
    hosts = [Host(names[i], f"{tag}-h{i}", f"10.213.{x}.{i + 1}", hosts_file) for i in range(count)]
    with os.fdopen(fd, "w") as f:
        f.write("127.0.0.1 localhost\n")
        for h in hosts:
            f.write(" ".join([h.addr, h.name, *(aliases or {}).get(h.name, ())]) + "\n")
    os.chmod(hosts_file, 0o644)
    made: List[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        the_bed = Bed(hosts, switch)
        for i, h in enumerate(hosts):
            _ip("netns", "add", h.ns)
            made.append(h.ns)
            _ip("link", "add", "eth0", "netns", h.ns, "type", "veth", "peer", "name", f"p{i}", "netns", switch)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
        yield the_bed
    finally:
        for h in hosts:
            for proc in h.procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
        for ns in reversed(made):
            _remove(ns)
        os.unlink(hosts_file)
