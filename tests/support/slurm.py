"""A real SLURM cluster on the multi-host bed: munged, slurmctld on the first host, slurmd on each.

Everything is private to the test: its own munge key and socket, its own
``slurm.conf`` (clients find it through ``SLURM_CONF``), state and spool
directories under the test's temp dir, daemons started as root in the bed's
namespaces (so they die with the bed). Needs Debian's ``slurm-wlm`` and
``munge`` (``apt-get install slurm-wlm munge``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from typing import Dict, Iterator, List, Optional

from support.netns import Bed

__all__ = ["missing", "slurm_cluster"]

_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def missing() -> Optional[str]:
    """``None`` when SLURM can be brought up here, else why not."""
    if os.geteuid() != 0:
        return "starting SLURM's daemons needs root"
    absent = [t for t in _TOOLS if shutil.which(t) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge)"
    return None


def _conf(root: str, net: Bed, cpus: int) -> str:
    names = ",".join(h.name for h in net.hosts)
    return f"""\
ClusterName=ktbed
SlurmctldHost={net.hosts[0].name}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName={names} CPUs={cpus} State=UNKNOWN
PartitionName=bed Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _logs(root: str) -> str:
    text = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".log"):
            with open(os.path.join(root, name), errors="replace") as f:
                text.append(f"== {name}\n{f.read()[-2000:]}")
    return "\n".join(text)


@contextlib.contextmanager
def slurm_cluster(net: Bed, root: str, timeout: float = 60) -> Iterator[Dict[str, str]]:
    """Brings up SLURM on ``net``'s hosts; yields the client environment (``SLURM_CONF``).

    Raises:
        RuntimeError: a daemon did not come up (its logs in the message).
    """
    why = missing()
    if why:
        raise RuntimeError(f"cannot bring SLURM up: {why}")
    os.makedirs(os.path.join(root, "state"), mode=0o700, exist_ok=True)
    for h in net.hosts:
        os.makedirs(os.path.join(root, f"spool-{h.name}"), mode=0o700, exist_ok=True)
    key = os.path.join(root, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    conf = os.path.join(root, "slurm.conf")
    with open(conf, "w") as f:
        f.write(_conf(root, net, os.cpu_count() or 1))
    env = dict(os.environ, SLURM_CONF=conf)
    head = net.hosts[0]
    daemons: List[subprocess.Popen] = []
    try:
        daemons.append(head.popen(
            ["munged", "--foreground", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
             f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed"],
            env=env, stdout=subprocess.DEVNULL))
        _wait(lambda: os.path.exists(f"{root}/munge.socket"), timeout, "munged", root)
        daemons.append(head.popen(["slurmctld", "-D", "-i", "-f", conf], env=env, stdout=subprocess.DEVNULL))
        for h in net.hosts:
            daemons.append(h.popen(["slurmd", "-D", "-N", h.name, "-f", conf], env=env, stdout=subprocess.DEVNULL))

        def idle() -> bool:
            out = head.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, timeout=10).stdout.split()
            return len(out) == 2 * len(net.hosts) and all(s == "idle" for s in out[1::2])

        _wait(idle, timeout, "slurmd on every host (sinfo: idle)", root)
        yield env
    finally:
        for d in reversed(daemons):
            if d.poll() is None:
                d.terminate()
        for d in daemons:
            try:
                d.wait(10)
            except subprocess.TimeoutExpired:
                d.kill()


def _wait(ready, timeout: float, what: str, root: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"SLURM did not come up: no {what} after {timeout:.0f} s\n{_logs(root)}")
