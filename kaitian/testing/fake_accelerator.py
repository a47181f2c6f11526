"""A fake accelerator: a torch PrivateUse1 device shaped like torch_mlu, on host memory.

``install(name="mlu", count=2)`` renames PrivateUse1 to ``name`` and registers
``torch.<name>``. Device memory is host memory from a caching allocator that
reuses a freed block at once on its stream (honouring ``record_stream``); each
stream is a FIFO run by its own worker thread; ops run the CPU kernel on host
aliases, queued on the current stream; ``non_blocking`` copies are queued too.
So host code that reads device memory without the right wait sees stale data,
as on a real device, only more reliably. ``sleep(seconds)`` queues a delay on
the current stream (like ``torch.cuda._sleep``).

``MLU_VISIBLE_DEVICES`` (``<NAME>_VISIBLE_DEVICES``) selects and renumbers
devices as ``CUDA_VISIBLE_DEVICES`` does. Random ops draw from torch's CPU
generator: ``manual_seed``/``manual_seed_all`` seed it.

``install`` also registers the c10d backend ``cncl`` for the device, as
torch_mlu does: NCCL's stream rules (each op on the group's communication
stream after the caller's current stream; ``Work.wait()`` and the work's future
order the caller's stream, not the host) and CNCL's limits (no float64, int16
or bitwise ops: they raise), with gloo over host aliases carrying the bytes.
``KAITIAN_FAKE_ACCELERATOR=mlu:N`` makes ``import kaitian`` install it.
"""

from __future__ import annotations

import atexit
import os
import sys
import types
from typing import Optional

import torch

__all__ = ["install", "installed", "sleep", "hold", "host_alias"]

_state: dict = {}


def _ext():
    try:
        from kaitian.testing import _fake_accelerator
    except ImportError as exc:
        raise ImportError(
            f"kaitian's fake accelerator is not built for torch {torch.__version__} (it needs torch 2.13 "
            f"or newer; rebuild kaitian with `make setup` against such a torch): {exc}"
        ) from exc
    return _fake_accelerator


def sleep(seconds: float) -> None:
    """Queue a delay of ``seconds`` on the current stream of the current device."""
    _ext().sleep(float(seconds))


def hold():
    """Queue a gate on the current stream of the current device: what is queued
    behind it waits until ``release()`` (or the end of a ``with`` block), however
    long the host takes meanwhile. Where :func:`sleep` makes a missing wait
    likely to show, a gate makes it certain::

        with fake_accelerator.hold():
            x.fill_(1.0)      # queued behind the gate
            ...               # whatever reads x now, without a wait, sees the old x
    """
    return _ext().hold()


def host_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same bytes as a fake-device tensor (it does not keep them alive)."""
    return _ext().host_alias(tensor)


def installed() -> Optional[str]:
    """The device name if :func:`install` ran in this process, else None."""
    return _state.get("name")


def _visible(name: str, count: int) -> int:
    var = f"{name.upper()}_VISIBLE_DEVICES"
    raw = os.environ.get(var)
    if raw is None:
        return count
    picked = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) >= count or int(part) in picked:
            break  # as CUDA: the list ends at the first invalid entry
        picked.append(int(part))
    return len(picked)


def _device_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(f"torch.{name}", f"kaitian's fake accelerator as torch.{name}")

    def _dev(device=None) -> torch.device:
        if device is None:
            return torch.device(name, current_device())
        if isinstance(device, int):
            return torch.device(name, device)
        d = torch.device(device)
        return d if d.index is not None else torch.device(name, current_device())

    def is_available() -> bool:
        return device_count() > 0

    def device_count() -> int:
        return _state["count"]

    def current_device() -> int:
        return torch.accelerator.current_device_index()

    def set_device(device) -> None:
        torch.accelerator.set_device_index(_dev(device).index)

    class Stream(torch.Stream):
        def __new__(cls, device=None, priority=0, **kwargs):
            if kwargs:
                return super().__new__(cls, **kwargs)
            return super().__new__(cls, device=_dev(device), priority=priority)

    def Event(enable_timing=False, blocking=False, interprocess=False, device=None) -> torch.Event:
        # a plain torch.Event: its methods accept no subclass as the other event
        return torch.Event(device=_dev(device), enable_timing=enable_timing)

    def _wrap(s: torch.Stream) -> Stream:
        return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)

    def current_stream(device=None) -> Stream:
        return _wrap(torch.accelerator.current_stream(_dev(device)))

    def default_stream(device=None) -> Stream:
        s = current_stream(device)
        return Stream(stream_id=0, device_index=s.device_index, device_type=s.device_type)

    def set_stream(s: torch.Stream) -> None:
        torch.accelerator.set_stream(s)

    class _StreamContext:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            if self.s is None:
                return None
            self.prev_dev = current_device()
            self.prev = torch.accelerator.current_stream(torch.device(name, self.s.device_index))
            torch.accelerator.set_stream(self.s)
            return self.s

        def __exit__(self, *exc):
            if self.s is not None:
                torch.accelerator.set_stream(self.prev)
                set_device(self.prev_dev)

    def stream(s) -> _StreamContext:
        return _StreamContext(s)

    class device:
        """``with torch.mlu.device(i):`` device ``i`` is current inside (``torch.load``'s
        ``map_location`` uses it, as ``torch.cuda.device``)."""

        def __init__(self, device):
            self.index = -1 if device is None or device == -1 else _dev(device).index

        def __enter__(self):
            self.prev = current_device()
            if self.index >= 0:
                set_device(self.index)

        def __exit__(self, *exc):
            set_device(self.prev)

    def synchronize(device=None) -> None:
        torch.accelerator.synchronize(_dev(device))

    def manual_seed(seed: int) -> None:
        # the device draws from the CPU generator; torch.manual_seed would call back here
        torch.default_generator.manual_seed(seed)

    def get_amp_supported_dtype():
        return [torch.float16, torch.bfloat16]

    for f in (is_available, device_count, current_device, set_device, current_stream, default_stream,
              set_stream, stream, synchronize, manual_seed, get_amp_supported_dtype):
        setattr(mod, f.__name__, f)
    mod.Stream, mod.Event, mod.StreamContext, mod.device = Stream, Event, _StreamContext, device
    mod.manual_seed_all = manual_seed
    mod.is_initialized = lambda: True
    mod._is_in_bad_fork = lambda: False
    mod.is_bf16_supported = lambda *a, **k: True
    mod.sleep = sleep
    mod.__file__ = __file__
    return mod


def _register_cncl(name: str) -> None:
    """Backend ``cncl`` for the device, registered as torch_mlu registers its own
    (and ``torch.distributed.ProcessGroupCNCL``, with its ``Options``)."""
    import torch.distributed as dist

    if dist.is_available() and not hasattr(dist.Backend, "CNCL"):
        pg_class = _ext().ProcessGroupCNCL
        dist.Backend.register_backend("cncl", lambda store, rank, size, timeout: pg_class(store, rank, size, timeout),
                                      devices=[name])
        dist.ProcessGroupCNCL = pg_class


def install(name: str = "mlu", count: int = 2) -> types.ModuleType:
    """Install the fake device as ``torch.<name>`` with ``count`` devices (before visibility); idempotent."""
    if _state:
        if (_state["name"], _state["physical"]) != (name, count):
            raise RuntimeError(
                f"fake accelerator: already installed as {_state['name']}:{_state['physical']}, "
                f"cannot install {name}:{count} in the same process"
            )
        return getattr(torch, name)
    current = torch._C._get_privateuse1_backend_name()
    if current != "privateuseone" and current != name:
        raise RuntimeError(f"fake accelerator: PrivateUse1 is already named {current!r}; cannot name it {name!r}")
    visible = _visible(name, count)
    _ext().init(visible)
    if current != name:
        torch.utils.rename_privateuse1_backend(name)
    _state.update(name=name, physical=count, count=visible)
    mod = _device_module(name)
    torch._register_device_module(name, mod)
    sys.modules[f"torch.{name}"] = mod
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    _register_cncl(name)
    # A worker asking a finalizing interpreter for the GIL ends the process (cpp/fake/runtime.cpp, "Exit").
    atexit.register(_ext().python_exits)
    return mod
