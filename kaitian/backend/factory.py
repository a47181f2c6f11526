"""Builds one ``kaitian`` process group instance (the creator torch calls).

Steps, identical on every rank: exchange rank records through the store, derive
the layout, build each vendor group's own backend on its own ``PrefixStore``,
pick the bridge (shared memory on one host, TCP otherwise or when forced), meet
the peers, and hand everything to the C++ ``KaitianBackend``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import secrets
import shutil
import socket
import tempfile
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from kaitian import _torch as _te
from kaitian.backend import groups as _layout
from kaitian.backend import shm_gc
from kaitian.settings import Settings, settings
from kaitian.devices.vendors import VENDORS, intra_gaps
from kaitian.errors import BackendSetupError, VersionMismatchError
from kaitian.version import versions

__all__ = ["create_kaitian_backend", "BackendSetupError", "vendor_timeout"]

logger = logging.getLogger(__name__)


def _group_intra_backend(device: str) -> str:
    vendor = VENDORS.get(device)
    return vendor.intra_backend if vendor is not None else "gloo"


def _timeout_of(opts) -> timedelta:
    t = opts.timeout
    return t if isinstance(t, timedelta) else timedelta(seconds=float(t))


def _shared_random(store, rank: int, key: str, nbytes: int, timeout: timedelta) -> str:
    """Random hex that rank 0 makes and every rank of the group reads from its store."""
    if rank == 0:
        store.set(key, secrets.token_hex(nbytes))
    store.wait([key], timeout)
    return store.get(key).decode()


_KEY_GIVEN = "given"  # what rank 0 publishes instead of a key when KAITIAN_JOB_KEY is set


def _bridge_key(store, rank: int, s: Settings, timeout: timedelta) -> bytes:
    """The secret TCP bridge peers prove they hold.

    ``KAITIAN_JOB_KEY`` (from the user, the scheduler or kaitianrun) is never
    written anywhere; rank 0 only says that it has one, so a rank without it
    fails with a clear line. Without it (plain torchrun) rank 0 makes a key per
    group and shares it through the group's store: then whoever can read that
    store can join.
    """
    key = "kaitian/bridge_key"
    if rank == 0:
        store.set(key, _KEY_GIVEN if s.job_key else secrets.token_hex(32))
    store.wait([key], timeout)
    shared = store.get(key).decode()
    if (shared == _KEY_GIVEN) != bool(s.job_key):
        has, lacks = ("rank 0", "this rank") if shared == _KEY_GIVEN else ("this rank", "rank 0")
        raise BackendSetupError(
            f"KAITIAN_JOB_KEY is set on {has} but not on {lacks}; "
            "set the same KAITIAN_JOB_KEY on every rank, or on none"
        )
    return (s.job_key or shared).encode()


def _check_private_dir(path: str) -> None:
    """Refuses a run dir someone else could plant a forged file store in."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise BackendSetupError(
            f"KAITIAN_RUN_DIR={path} belongs to uid {st.st_uid}, not to this process "
            f"(uid {os.geteuid()}); point KAITIAN_RUN_DIR at a directory of your own"
        )
    if st.st_mode & 0o022:
        raise BackendSetupError(
            f"KAITIAN_RUN_DIR={path} is writable by other users (mode {st.st_mode & 0o777:04o}); "
            "chmod 700 it or point KAITIAN_RUN_DIR at a private directory"
        )


def _owner_only_file(path: str) -> None:
    """Creates ``path`` mode 0600 unless it exists (c10d's FileStore would make it 0644)."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))


def _run_dir(store, rank: int, s: Settings, timeout: timedelta) -> tuple:
    """The directory where peers meet; (path, whether we made it privately)."""
    if s.run_dir:
        os.makedirs(s.run_dir, mode=0o700, exist_ok=True)
        _check_private_dir(s.run_dir)
        return s.run_dir, False
    if rank == 0:
        path = tempfile.mkdtemp(prefix="kaitian-run-")  # owner-only (0700)
        store.set("kaitian/run_dir", path)
    store.wait(["kaitian/run_dir"], timeout)
    return store.get("kaitian/run_dir").decode(), True


def _local_address(s: Settings) -> str:
    """An IPv4 address of this host that the other ranks can connect to."""
    if s.bridge_addr:
        return s.bridge_addr
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                probe.connect((master, int(os.environ.get("MASTER_PORT", "29500") or 29500)))
                return probe.getsockname()[0]
            finally:
                probe.close()
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def vendor_timeout(timeout: timedelta) -> timedelta:
    """A vendor's own watchdog (NCCL's) fires only after kaitian's fail-stop had
    time to tell every peer what failed."""
    return timeout + max(timedelta(seconds=10), timeout / 4)


def _vendor_backend(name: str, store, group_rank: int, group_size: int, timeout: timedelta,
                    members=(), group_name: str = ""):
    """The vendor's own backend for one group, built through torch's classes/registry."""
    if name == "gloo":
        return dist.ProcessGroupGloo(store, group_rank, group_size, timeout)
    # NCCL's class, or torch_mlu's CNCL class (it puts it into torch.distributed)
    vendor_class = getattr(dist, {"nccl": "ProcessGroupNCCL", "cncl": "ProcessGroupCNCL"}.get(name, ""), None)
    if vendor_class is not None:
        options = _te.vendor_options(vendor_class.Options(), vendor_timeout(timeout), members, group_name)
        pg = vendor_class(store, group_rank, group_size, options)
        if name == "nccl":
            from kaitian.devices.rank import device

            _te.nccl_connect_now(pg, device())
        return pg
    plugin = _te.backend_plugins().get(name.upper())
    if plugin is None:
        raise BackendSetupError(
            f"intra-group backend {name!r} is not registered with torch.distributed; "
            "install/import the vendor's torch plug-in (e.g. torch_mlu)"
        )
    if plugin.extended_api:
        return plugin.creator_fn(_te.backend_options(store, group_rank, group_size, timeout), None)
    return plugin.creator_fn(store, group_rank, group_size, timeout)


def _rank_torch_device(me: _layout.RankInfo) -> Optional[torch.device]:
    """This rank's accelerator as torch names it (a barrier orders it); ``None`` on a CPU rank."""
    from kaitian.devices.rank import device

    return None if me.device.type == "cpu" else device()


def _check_agent_version(s: Settings) -> None:
    """A worker must run the kaitian its agent runs (a container image may carry another)."""
    mine = versions()
    if s.agent_version and s.agent_version != mine:
        raise VersionMismatchError(
            f"this worker runs kaitian/bridge protocol {mine} but kaitianrun runs {s.agent_version}; "
            "install the agent's kaitian in the worker's environment (its container image)"
        )


def create_kaitian_backend(dist_opts, backend_options=None):
    """Creator registered with ``Backend.register_backend(..., extended_api=True)``.

    Args:
        dist_opts: torch's ``_DistributedBackendOptions`` (store, group_rank,
            group_size, timeout, group_id).
        backend_options: unused (kaitian takes its options from ``KAITIAN_*``).

    Returns:
        The C++ ``KaitianBackend``.

    Raises:
        BackendSetupError: the configuration cannot work (the message says why).
    """
    from kaitian import _C

    _shut_down_at_exit(_C)
    store = dist_opts.store
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    timeout = _timeout_of(dist_opts)
    s = settings()
    _check_agent_version(s)
    shm_gc.collect_stale_segments(min_age_s=timeout.total_seconds())

    me = _layout.local_rank_info(rank, s)
    infos = _layout.exchange_infos(store, rank, size, me, timeout)
    lay = _layout.build_layout(infos)
    lead = infos[0]  # settings that must agree across ranks come from rank 0

    bridge = "tcp" if lead.bridge == "tcp" or not lay.single_host else "shm"
    if lead.bridge == "shm" and not lay.single_host:
        raise BackendSetupError(
            "KAITIAN_BRIDGE=shm but the ranks run on several hosts; use auto or tcp"
        )
    flat_intra = lead.intra != "gloo" and lay.single_host

    # Each vendor group's own backend, on its own store prefix.
    g = lay.group_of[rank]
    members = lay.members[g]
    group_rank, group_size = members.index(rank), len(members)
    device = lay.group_device[g]
    intra_device = intra_cpu = None
    if group_size > 1:
        name = lay.group_names[g]
        if device != "cpu":
            vendor = VENDORS.get(device)
            if vendor is None:
                raise BackendSetupError(f"device type {device!r} is not in kaitian's vendor table")
            vendor.import_module()
            intra_device = _vendor_backend(
                vendor.intra_backend,
                dist.PrefixStore(f"kaitian/intra/{name}/{device}/", store),
                group_rank, group_size, timeout, members, f"kaitian/intra/{name}/{device}",
            )
        if device != "cpu" or not flat_intra:
            intra_cpu = _vendor_backend(
                "gloo", dist.PrefixStore(f"kaitian/intra/{name}/cpu/", store),
                group_rank, group_size, timeout,
            )

    token = _shared_random(store, rank, "kaitian/token", 6, timeout)
    file_store = None
    run_dir, private = None, False
    if bridge == "shm":
        run_dir, private = _run_dir(store, rank, s, timeout)
        store_path = os.path.join(run_dir, f"bridge-{token}.store")
        _owner_only_file(store_path)
        file_store = dist.FileStore(store_path, size)
        file_store.set_timeout(timeout)
    pids = [
        i.pid if (i.host == me.host and i.pid_ns == me.pid_ns) else -1 for i in infos
    ]
    bridge_options = backend = None
    try:
        layout = _C.Layout(
            group_of=lay.group_of, group_names=lay.group_names, group_device=lay.group_device,
            flat_intra=flat_intra,
            # Reductions go segment by segment (device copies overlap the bridge).
            segment_bytes=16 * int(lead.chunk_bytes),
            vendor_gaps=[sorted(intra_gaps(d, _group_intra_backend(d))) for d in lay.group_device],
            device=_rank_torch_device(me),
        )
        if bridge == "tcp":
            bridge_options = _C.TcpBridgeOptions(
                host=_local_address(s), key=_bridge_key(store, rank, s, timeout), session=token,
                ports=s.bridge_ports or (0, 0),
            )
        else:
            bridge_options = _C.ShmBridgeOptions(
                store=file_store, name=shm_gc.segment_name(token, rank), chunk_bytes=int(lead.chunk_bytes),
                pids=pids, spin_us=int(s.spin_us),
            )
        backend = _C.create_backend(
            store=store, rank=rank, size=size, timeout_ms=int(timeout.total_seconds() * 1000),
            layout=layout, bridge=bridge_options, intra_device=intra_device, intra_cpu=intra_cpu,
        )
    finally:
        # The file store was only the meeting point. torch's FileStore removes its
        # file when the last rank lets go of it, but counts those ranks and the
        # references in two steps, so ranks that let go together can all leave it
        # (1 in 300 for 8 processes here): rank 0 removes it, or the private run dir,
        # at once if it failed itself (the group is broken: nobody needs the file).
        file_store = bridge_options = None
        if bridge == "shm":
            wait = timeout if backend is not None else timedelta(0)
            _remove_after_meeting(store, rank, size, wait, run_dir if private else store_path)
    logger.debug(
        "kaitian: rank %d/%d group %s (%d/%d), bridge %s, intra %s",
        rank, size, lay.group_names[g], group_rank, group_size, bridge,
        "shm" if flat_intra and device == "cpu" else "vendor",
    )
    return backend


@functools.lru_cache(maxsize=None)
def _shut_down_at_exit(c_module) -> None:
    """Once per process: shut every live backend down before the interpreter
    finalizes, so that a script may end without ``destroy_process_group()``
    (an atexit handler runs while Python still serves the op threads)."""
    atexit.register(c_module.shutdown_live_backends)


def _remove_after_meeting(store, rank: int, size: int, timeout: timedelta, path: str) -> None:
    """Marks this rank out of the meeting; rank 0 removes ``path`` (a file or a directory)
    once every rank is out, or after ``timeout``."""
    store.set(f"kaitian/met/{rank}", b"1")
    if rank != 0:
        return
    try:
        if timeout > timedelta(0):
            store.wait([f"kaitian/met/{r}" for r in range(size)], timeout)
    except RuntimeError:  # (torch's store errors) a rank never got out: its own error says why
        pass
    finally:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
