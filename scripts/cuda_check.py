#!/usr/bin/env python3
"""Checks backend kaitian's device path: accelerator ranks + CPU ranks in one job.

Starts ``--device-ranks`` ranks on the device (default one: ``cuda``, one
GPU each, or ``mlu``: kaitian's fake MLU through ``KAITIAN_FAKE_ACCELERATOR``,
its fake ``cncl`` inside the group when there are several) and
``--cpu-ranks`` CPU ranks (one group) on this host, as ``kaitianrun`` would
(``KAITIAN_DEVICE_TYPE``/``_INDEX``/``_GROUP``; other ranks' GPUs hidden).
Every rank then runs these phases; rank 0 prints one ``PASS``/``FAIL`` line
per check (a failing rank prints why) and the driver a summary naming the
failed ones. A check that fails or hangs on one rank costs itself alone: each
runs under a deadline (``--check-timeout``) and the ranks agree on its outcome
through the driver's TCPStore, not through a group (see :class:`Rank`):

harness    (not run by default) the harness's own test: checks that fail or
           hang on one rank, a phase stopped on one rank; the checks after
           them pass

ops        all_reduce (SUM, AVG, MAX; float32, bfloat16, float16, int64),
           broadcast from every rank, all_gather, reduce_scatter, against a
           reference from every rank's known inputs; producers on side streams,
           async waits, non-contiguous / channels_last tensors and Parameters,
           reduce, all_reduce_coalesced, bitwise ops and bool/int16 (routed
           around NCCL)
sizes      multi-segment reductions (past the 16 MiB segment, ``--big-mib``
           float32, bfloat16), broadcast and reduce_scatter of the same sizes
streams    async ops from several streams, each input produced behind a queued
           device delay (``torch.cuda._sleep``), waited in reverse order
memory     a tensor freed (its memory reused) while an op on it is in flight;
           barrier() orders the device; a second device in the process (when
           the rank sees two); only the rank's stripe is staged back
training   kaitian DDP (unequal batches), torch DDP (gradient_as_bucket_view on
           and off) + kaitian.scale_loss, FSDP2 fully_shard + scale_loss: fp64,
           against one process; fp16_compress_hook, PowerSGD: against gloo
clock      the backward hook and the step clock never wait for the device; a
           slower peer shows as communication; the Rebalancer's device times
bandwidth  all_reduce / broadcast bus bandwidth (``--sizes``) next to gloo on
           host copies (what a job without kaitian does)
failstop   a late rank, a mismatched call (named on every rank; in a vendor
           group of several device ranks over the TCP bridge, the vendor
           step's timeout), a device queue stuck past the timeout, a dead
           peer: every rank raises within the timeout

then, outside the job, ``kaitianrun --nproc-auto`` (GPUs found through NVML
on a GPU machine; two fake MLUs in one cncl group with ``--device mlu``; CPU
groups otherwise) runs a small collective.

Usage (from the repository root, after ``make setup`` or
``pip install --no-build-isolation -e .``; builds nothing)::

    python scripts/cuda_check.py                  # 1 CUDA rank + 2 CPU ranks (about 90 s on one H200)
    python scripts/cuda_check.py --device mlu     # the same on the fake MLU (no GPU needed)
    python scripts/cuda_check.py --device mlu --device-ranks 2 --cpu-ranks 0   # the vendor's path alone
    python scripts/cuda_check.py --device-ranks 0 --sizes ""   # CPU only: the script's own logic

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import zlib
from datetime import timedelta

__all__ = ["main"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run from a checkout as well as from an installed kaitian

# phase -> watchdog seconds (a phase that outlives it dumps its stacks and ends the rank)
PHASES = {"harness": 60, "ops": 120, "sizes": 120, "streams": 60, "memory": 60, "training": 180, "clock": 90,
          "bandwidth": 180, "failstop": 90}  # failstop last: it breaks groups and ends a rank
FAIL_TIMEOUT = 3.0  # the failstop phase's group timeout, seconds
CHECK_GRACE_S = 5.0  # past a check's deadline, how long the ranks wait for a late outcome


def _say(text: str) -> None:
    """A line on the ranks' shared stdout in one write: they run unbuffered, where print()
    writes the text and its newline apart and another rank's line can land between them
    (a write of up to 4 KiB to a pipe is never split)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def _input(dtype, n: int, rank: int, salt: str):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{salt}/{rank}".encode()))
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


# ------------------------------------------------------------------ the device under test


class Device:
    """What the checks need of the rank's device: a GPU, the fake MLU, or the CPU (dry run)."""

    def __init__(self, kind: str) -> None:
        import torch

        self.kind = kind
        self.torch = torch.device(kind, 0) if kind != "cpu" else torch.device("cpu")
        self.module = getattr(torch, kind) if kind != "cpu" else None
        self._cycles_per_s = 0.0

    @property
    def accelerated(self) -> bool:
        return self.module is not None

    def sleep(self, seconds: float) -> None:
        """Queues a delay on the current stream: what the caller queues next runs late."""
        if self.kind == "mlu":
            from kaitian.testing import fake_accelerator

            fake_accelerator.sleep(seconds)
        elif self.kind == "cuda":
            import torch

            if not self._cycles_per_s:  # torch.cuda._sleep counts clock cycles: calibrate once
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(50_000_000)
                end.record()
                end.synchronize()
                self._cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1000.0)
            torch.cuda._sleep(int(seconds * self._cycles_per_s))

    def stream(self):
        """A context with a new stream current (nothing on the CPU)."""
        return self.module.stream(self.module.Stream()) if self.module else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.module:
            self.module.synchronize()

    def peek(self, t):
        """What ``t``'s memory holds now, without waiting for the stream that writes it."""
        with self.stream():
            return t.to("cpu", copy=True)  # a blocking copy waits for its own (new) stream only


# ------------------------------------------------------------------ one rank


class Rank:
    """One rank's job: its device, its groups, and checks whose outcome every rank
    agrees on through the driver's store, a side channel no broken group can block.

    A check runs in a thread of its own under a deadline (``--check-timeout``).
    Each rank posts its outcome on the store; a rank whose check failed posts at
    once and the others give up on theirs (they may be waiting in a collective
    for it); a rank that has not posted by the deadline is hung, one that exited
    (the driver marks it) is gone. The first rank to decide writes the verdict
    (``compare_set``) and every rank, a late one too, takes it. After a failed
    check every rank re-creates its groups (destroying the old ones aborts a
    call a thread still waits in), so a check that fails or hangs on one rank
    costs that check alone.
    """

    def __init__(self, args: argparse.Namespace, device: Device, store) -> None:
        self.args, self.device, self.store = args, device, store
        self.rank, self.world = args.rank, args.world_size
        self.generation = 0  # of the groups: each has its own prefix on the store
        self.broken = False  # a check failed: new groups before the next one
        self.phase_name = ""
        self.index = 0  # the check's number within its phase: its keys on the store
        self.failures = 0
        self.watchdog_s = 0.0  # of code between checks, per phase
        self._connect()

    def _connect(self) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=self.args.check_timeout)  # a call a peer never joins fails within a check
        dist.init_process_group("kaitian", store=dist.PrefixStore(f"groups/{self.generation}/", self.store),
                                rank=self.rank, world_size=self.world, timeout=timeout)
        self.gloo = dist.new_group(backend="gloo", timeout=timeout)

    def reconnect(self) -> None:
        """New groups after a failed check: the old ones may be broken or out of step."""
        import torch.distributed as dist

        if self.broken:
            dist.destroy_process_group()
            self.generation += 1
            self._connect()
            self.broken = False

    def _key(self, what) -> str:
        return f"checks/{self.phase_name}/{self.index}/{what}"

    def report(self, name: str, ok: bool, detail: str = "", ranks=None) -> None:
        """Posts this rank's outcome of check ``name`` and takes the ranks' verdict
        (rank 0 prints it). ``ranks``: the ranks that report it (default: all)."""
        self._decide(name, bool(ok), detail, ranks, time.monotonic() + self.args.check_timeout)

    def check(self, name: str, deadline: float = 0.0):
        """Runs the decorated function at once as check ``name``, in a thread of its
        own under ``deadline`` seconds (default ``--check-timeout``); an exception
        fails it. The function returns ``ok`` or ``(ok, detail)``."""
        def run(fn):
            self.reconnect()
            seconds = deadline or self.args.check_timeout
            end = time.monotonic() + seconds
            self._decide(name, *self._run(fn, end, seconds), None, end)
            return fn
        return run

    def _run(self, fn, end: float, seconds: float) -> tuple:
        """``fn``'s (ok, detail); a failure once a peer failed this check, or at ``end``."""
        result, done = [], threading.Event()

        def body():
            try:
                out = fn()
                result.append(out if isinstance(out, tuple) else (out, ""))
            except BaseException as e:  # the failure is the report
                result.append((False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))
            finally:
                done.set()

        threading.Thread(target=body, name=f"check {self.phase_name}/{self.index}", daemon=True).start()
        while not done.wait(0.05):
            if self.store.check([self._key("failed")]):
                return False, "gave up: a peer failed this check"
            if time.monotonic() > end:
                faulthandler.dump_traceback(all_threads=True)  # where it hangs
                return False, f"hung: not done within {seconds:.0f} s"
        ok, detail = result[0]
        return bool(ok), detail

    def _decide(self, name: str, ok: bool, detail: str, ranks, end: float) -> None:
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        if not ok:
            _say(f"      rank {self.rank}: {self.phase_name}: {name}: {detail}"[:3000])
            if not detail.startswith("gave up"):
                self.store.set(self._key("failed"), str(self.rank))  # the peers stop waiting for this rank
        self.store.set(self._key(self.rank), json.dumps({"ok": ok, "detail": detail[:500]}))
        keys = {q: self._key(q) for q in ranks}
        end += CHECK_GRACE_S  # a hung rank posts at its own deadline
        pause = 0.001
        while time.monotonic() < end and not all(self.store.check([keys[q]]) or self._absent(q) for q in ranks):
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        causes = []
        for q, key in keys.items():
            if not self.store.check([key]):
                causes.append(f"rank {q}: {'exited or stopped the phase' if self._absent(q) else 'no outcome'}")
                continue
            out = json.loads(self.store.get(key))
            if not out["ok"] and not out["detail"].startswith("gave up"):
                causes.append(f"rank {q}: {out['detail'].splitlines()[0] if out['detail'] else 'wrong'}")
        mine = json.dumps({"phase": self.phase_name, "name": name, "ok": not causes and ok, "causes": causes})
        verdict = json.loads(self.store.compare_set(self._key("verdict"), "", mine))
        self.index += 1
        faulthandler.dump_traceback_later(self.watchdog_s, exit=True)  # rearmed: it watches code between checks
        if not verdict["ok"]:
            self.failures += 1
            self.broken = True
        if self.rank == 0:
            _say(f"{'PASS' if verdict['ok'] else 'FAIL'}  {self.phase_name}: {name}"
                 + (f"  ({'; '.join(verdict['causes'])})"[:600] if verdict["causes"] else ""))

    def _absent(self, q: int) -> bool:
        """Whether rank ``q`` will post nothing more in this phase (it exited or stopped the phase)."""
        return self.store.check([f"exited/{q}"]) or self.store.check([f"stopped/{self.phase_name}/{q}"])

    @contextlib.contextmanager
    def phase(self, name: str):
        """Phase ``name``: starts when every rank is there (new groups if one needs
        them); an exception outside its checks stops it on this rank alone."""
        self.phase_name, self.index = name, 0
        self.store.set(f"start/{name}/{self.rank}", "1" if self.broken else "0")
        keys = [f"start/{name}/{q}" for q in range(self.world)]
        end = time.monotonic() + PHASES[name]
        while time.monotonic() < end and not all(self.store.check([k]) or self._absent(q) for q, k in enumerate(keys)):
            time.sleep(0.01)
        self.broken = any(self.store.check([k]) and self.store.get(k) == b"1" for k in keys)
        self.reconnect()
        if self.rank == 0:
            _say(f"== {name}")
        self.watchdog_s = max(PHASES[name], self.args.check_timeout + 2 * CHECK_GRACE_S)
        faulthandler.dump_traceback_later(self.watchdog_s, exit=True)  # the watchdog of code outside checks
        try:
            yield
        except Exception as e:  # the peers' next checks count this rank out
            detail = f"{type(e).__name__}: {e}"
            _say(f"      rank {self.rank}: {name} stopped: {detail}\n{traceback.format_exc(limit=6)}"[:3000])
            self.store.set(f"stopped/{name}/{self.rank}", detail[:500])
            self.failures += 1
            self.broken = True
        finally:
            faulthandler.cancel_dump_traceback_later()

    def matches(self, got, exp, dtype=None) -> tuple:
        """Whether ``got`` (on this rank's device) holds ``exp``; exact for integers."""
        import torch

        dtype = dtype or got.dtype
        if got.device.type != self.device.torch.type:
            return False, f"result on {got.device}, expected {self.device.torch}"
        got = got.detach().cpu()
        if dtype in (torch.float16, torch.bfloat16):
            ok = torch.allclose(got.double(), exp.double(), rtol=2e-2, atol=0.1 * self.world)
        elif dtype.is_floating_point:
            ok = torch.allclose(got.double(), exp.double(), rtol=1e-5, atol=1e-4)
        else:
            ok = torch.equal(got, exp.to(got.dtype))
        diff = float((got.double() - exp.double()).abs().max()) if got.numel() else 0.0
        return bool(ok), f"max diff {diff}"


HARNESS_HANG_S = 4.0  # the harness's hanging check's deadline


def phase_harness(r: Rank) -> None:
    """The checks' own test (run first, when asked for): a check that fails on rank
    0 alone while the others wait for it in a gloo collective (torch's PowerSGD
    hook did that on the first GPU run), one that fails there while they wait in a
    kaitian collective, one that hangs on the last rank alone, and this phase
    stopping outside a check on the last rank: each of these fails by itself,
    and collectives on new groups pass after them (so do the phases after this one)."""
    import torch
    import torch.distributed as dist

    dev, rank, last = r.device.torch, r.rank, r.world - 1
    want = r.world * (r.world + 1) // 2

    def fail_on_rank_0_else(call):
        if rank == 0:
            raise ValueError("this check fails on rank 0 alone")
        call()
        return True

    r.check("fails on rank 0 alone, the others wait for it in gloo")(
        lambda: fail_on_rank_0_else(lambda: dist.all_reduce(torch.ones(4), group=r.gloo)))
    # (host tensors: a vendor's step queued on a device stream, as the fake CNCL's, is
    # not aborted with its group; NCCL's is, by ncclCommAbort)
    r.check("fails on rank 0 alone, the others wait for it in kaitian")(
        lambda: fail_on_rank_0_else(lambda: dist.all_reduce(torch.ones(4))))

    @r.check("hangs on the last rank alone", deadline=HARNESS_HANG_S)
    def _():
        if rank == last:
            time.sleep(3600)  # abandoned: the thread sleeps on until the rank exits
        return True

    @r.check("collectives on every group after them")
    def _():
        t, g = torch.full((4,), float(rank + 1), device=dev), torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        dist.all_reduce(g, group=r.gloo)
        return bool((t.cpu() == want).all() and (g == want).all()), f"kaitian {t.tolist()}, gloo {g.tolist()}"

    if rank == last:
        raise RuntimeError("the harness phase stops outside a check on the last rank")

    @r.check("the other ranks go on after the last one stopped this phase")
    def _():
        return True


def phase_ops(r: Rank) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    dev, world, rank = r.device.torch, r.world, r.rank
    n = 100_003
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        inputs = [_input(dtype, n, q, f"ar{dtype}") for q in range(world)]
        stack = torch.stack([x.double() for x in inputs])
        for op in ("SUM", "AVG", "MAX"):
            if op == "AVG" and not dtype.is_floating_point:
                continue
            exp = {"SUM": stack.sum(0), "AVG": stack.mean(0), "MAX": stack.max(0).values}[op]

            @r.check(f"all_reduce {op} {dtype}")
            def _():
                t = inputs[rank].to(dev, copy=True)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                return r.matches(t, exp.to(dtype) if op == "MAX" else exp, dtype)

        for src in range(world):
            @r.check(f"broadcast {dtype} from rank {src}")
            def _():
                t = inputs[rank].to(dev, copy=True)
                dist.broadcast(t, src)
                return r.matches(t, inputs[src], dtype)

        @r.check(f"all_gather {dtype}")
        def _():
            out = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(out, inputs[rank].to(dev, copy=True))
            return all(r.matches(o, inputs[q], dtype)[0] for q, o in enumerate(out))

        @r.check(f"all_gather_into_tensor {dtype}")
        def _():
            flat = torch.empty(n * world, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(flat, inputs[rank].to(dev, copy=True))
            return r.matches(flat, torch.cat(inputs), dtype)

        if dtype != torch.int64:
            @r.check(f"reduce_scatter_tensor SUM {dtype}")
            def _():
                full = [_input(dtype, 64 * world, q, f"rs{dtype}") for q in range(world)]
                exp = torch.stack([x.double() for x in full]).sum(0)[rank * 64:(rank + 1) * 64]
                out = torch.empty(64, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, full[rank].to(dev, copy=True))
                return r.matches(out, exp, dtype)

    ranks_sum = world * (world + 1) // 2
    m = 1 << 20
    for name, call, want in (("all_reduce", lambda t: dist.all_reduce(t), ranks_sum),
                             ("broadcast", lambda t: dist.broadcast(t, world - 1), world)):
        @r.check(f"{name} right after an unsynchronised producer on a side stream")
        def _():
            with r.device.stream():
                r.device.sleep(0.05)
                t = torch.full((m,), float(rank + 1), device=dev)
                call(t)
                return bool((t == want).all())

    @r.check("reduce_scatter_tensor 6 MiB/rank read right after wait()")
    def _():
        k = (6 << 20) // 4
        base = (torch.arange(world * k, device=dev) % 1000).float()
        out = torch.empty(k, device=dev)
        r.device.sleep(0.05)
        dist.reduce_scatter_tensor(out, base + rank, async_op=True).wait()
        return bool(torch.equal(out, world * base[rank * k:(rank + 1) * k] + (ranks_sum - world)))

    @r.check("async all_reduce read from get_future().wait()")
    def _():
        t = torch.full((m,), float(rank + 1), device=dev)
        return bool((dist.all_reduce(t, async_op=True).get_future().wait()[0] == ranks_sum).all())

    def shaped(kind: str, q: int, salt: int):
        g = torch.Generator().manual_seed(97 * salt + q)
        if kind == "channels_last":
            return torch.randint(-50, 50, (2, 3, 4, 5), generator=g).float().to(memory_format=torch.channels_last)
        if kind == "noncontig":
            return torch.randint(-50, 50, (6, 8), generator=g).float().t()
        return torch.randint(-50, 50, (7, 5), generator=g).float()

    for salt, kind in enumerate(("contiguous", "noncontig", "channels_last")):
        inputs = [shaped(kind, q, salt) for q in range(world)]
        total = sum(x.contiguous() for x in inputs)
        for param in (False, True):
            for async_op in (False, True):
                what = f"{kind} {'Parameter' if param else 'tensor'}{' (async)' if async_op else ''}"

                @r.check(f"all_reduce {what}")
                def _():
                    x = inputs[rank].to(dev, copy=True)
                    x = nn.Parameter(x) if param else x
                    strides = x.stride()
                    w = dist.all_reduce(x, async_op=async_op)
                    if async_op:
                        w.wait()
                    ok = x.stride() == strides and r.matches(x, total, torch.float32)[0]
                    return ok and (not param or (x.is_leaf and x.requires_grad))

                @r.check(f"broadcast {what}")
                def _():
                    x = inputs[rank].to(dev, copy=True)
                    x = nn.Parameter(x) if param else x
                    w = dist.broadcast(x, 0, async_op=async_op)
                    if async_op:
                        w.wait()
                    return r.matches(x, inputs[0], torch.float32)

    @r.check("reduce of a non-contiguous tensor (the root gets the sum, the others keep theirs)")
    def _():
        t = shaped("noncontig", rank, 7).to(dev, copy=True)
        dist.reduce(t, dst=0)
        exp = sum(shaped("noncontig", q, 7) for q in range(world)) if rank == 0 else shaped("noncontig", rank, 7)
        return r.matches(t, exp, torch.float32)

    @r.check("all_reduce_coalesced (one non-contiguous)")
    def _():
        ts = [torch.full((1000,), float(rank + 1), device=dev), torch.full((3, 7), float(2 * rank), device=dev).t()]
        dist.all_reduce_coalesced(ts)
        return bool((ts[0] == ranks_sum).all()) and bool((ts[1] == 2 * (ranks_sum - world)).all())

    # What NCCL cannot reduce goes through the bridge: bitwise ops, bool, int16.
    bitwise = {"BAND": lambda a, b: a & b, "BOR": lambda a, b: a | b, "BXOR": lambda a, b: a ^ b}
    for dtype in (torch.int32, torch.int64, torch.uint8):
        inputs = [_input(dtype, 10_001, q, f"bit{dtype}") for q in range(world)]
        for op, fn in bitwise.items():
            @r.check(f"all_reduce {op} {dtype}")
            def _():
                t = inputs[rank].to(dev, copy=True)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                return r.matches(t, functools.reduce(fn, inputs), dtype)
    for dtype, ops in ((torch.int16, ("SUM", "MIN", "MAX")), (torch.bool, ("MIN", "MAX"))):
        if dtype == torch.bool:
            inputs = [_input(torch.int64, 10_001, q, "bool") > 0 for q in range(world)]
        else:
            inputs = [(_input(dtype, 10_001, q, "i16") // 8).to(dtype) for q in range(world)]
        stack = torch.stack([x.long() for x in inputs])
        for op in ops:
            @r.check(f"all_reduce {op} {dtype}")
            def _():
                exp = {"SUM": stack.sum(0), "MIN": stack.min(0).values, "MAX": stack.max(0).values}[op]
                t = inputs[rank].to(dev, copy=True)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                return r.matches(t, exp, dtype)

        @r.check(f"broadcast and all_gather {dtype}")
        def _():
            t = inputs[rank].to(dev, copy=True)
            dist.broadcast(t, world - 1)
            outs = [torch.empty_like(inputs[0], device=dev) for _ in range(world)]
            dist.all_gather(outs, inputs[rank].to(dev))
            return r.matches(t, inputs[world - 1], dtype)[0] and all(
                r.matches(o, inputs[q], dtype)[0] for q, o in enumerate(outs))


def phase_sizes(r: Rank) -> None:
    """Reductions of several 16 MiB segments; small integers, so every sum is exact."""
    import torch
    import torch.distributed as dist

    dev, world, rank = r.device.torch, r.world, r.rank
    for dtype, mib in ((torch.float32, 17), (torch.float32, r.args.big_mib), (torch.bfloat16, r.args.big_mib // 2)):
        n = (mib << 20) // torch.tensor([], dtype=dtype).element_size()
        pattern = torch.arange(n, dtype=torch.int64) % 7

        @r.check(f"all_reduce SUM {mib} MiB {dtype}")
        def _():
            t = (pattern * (rank + 1)).to(dtype).to(dev)
            dist.all_reduce(t)
            return r.matches(t, pattern * (world * (world + 1) // 2), dtype)

        @r.check(f"broadcast {mib} MiB {dtype} from a CPU rank")
        def _():
            t = (pattern * (rank + 1)).to(dtype).to(dev)
            dist.broadcast(t, world - 1)
            return r.matches(t, pattern * world, dtype)

        @r.check(f"reduce_scatter_tensor {mib} MiB {dtype}")
        def _():
            k = n // world
            t = (pattern[:k * world] * (rank + 1)).to(dtype).to(dev)
            out = torch.empty(k, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, t)
            return r.matches(out, pattern[rank * k:(rank + 1) * k] * (world * (world + 1) // 2), dtype)


def phase_streams(r: Rank) -> None:
    """Async ops from several streams, each input produced behind a queued delay, waited newest first."""
    import torch
    import torch.distributed as dist

    dev, world, rank = r.device.torch, r.world, r.rank
    n = 3001
    calls = {  # name -> (call, input size, output size or None: in place)
        "all_reduce": (lambda t, out, **kw: dist.all_reduce(t, **kw), n, None),
        "broadcast": (lambda t, out, **kw: dist.broadcast(t, 1, **kw), n, None),
        "all_gather_into_tensor": (lambda t, out, **kw: dist.all_gather_into_tensor(out, t, **kw), n, n * world),
        "reduce_scatter_tensor": (lambda t, out, **kw: dist.reduce_scatter_tensor(out, t, **kw), n * world, n),
    }
    works, results, refs = [], [], []
    for i, (name, (call, size_in, size_out)) in enumerate(calls.items()):
        host = _input(torch.float32, size_in, rank, f"streams{i}").round()
        ref_in, ref_out = host.clone(), torch.zeros(size_out or 1)
        call(ref_in, ref_out, group=r.gloo)
        refs.append(ref_in if size_out is None else ref_out)
        with r.device.stream():
            src = host.to(dev)
            t = torch.zeros_like(src)
            out = torch.zeros(size_out or 1, device=dev)
            r.device.sleep(0.1 * (len(calls) - i))
            t.add_(src)  # the input, ready only after the delay
            works.append(call(t, out, async_op=True))
        results.append(t if size_out is None else out)
    for w in reversed(works):
        w.wait()
    for name, got, want in zip(calls, results, refs):  # read on the caller's stream
        r.report(f"{name} from its own stream, waited in reverse order", *r.matches(got, want))


def phase_memory(r: Rank) -> None:
    import torch
    import torch.distributed as dist

    dev, world, rank = r.device.torch, r.world, r.rank
    n = 3001

    for name in ("all_reduce", "broadcast"):
        @r.check(f"{name}: a tensor freed while the op is in flight keeps its memory")
        def _():
            def op(t, **kw):
                return dist.all_reduce(t, **kw) if name == "all_reduce" else dist.broadcast(t, 0, **kw)

            host = _input(torch.float32, n, rank, "reuse").round()
            ref = host.clone()
            op(ref, group=r.gloo)
            t = host.to(dev)
            r.device.sleep(0.3)  # the op waits for this; the caller goes on
            work = op(t, async_op=True)
            if not r.device.accelerated:
                work.wait()
                return r.matches(t, ref)
            del t  # the op still reads and writes it
            other = torch.full((n,), 7.0, device=dev)  # must not get its memory
            work.wait()
            r.device.synchronize()
            return r.matches(other, torch.full((n,), 7.0))

    @r.check("barrier() returns once the device work queued before it is done")
    def _():
        t = torch.zeros(n, device=dev)
        r.device.sleep(0.5)
        t.fill_(5.0)  # queued behind the delay
        dist.barrier()
        seen = r.device.peek(t)
        return bool(torch.equal(seen, torch.full((n,), 5.0))), f"the device memory holds {seen.unique().tolist()}"

    devices = r.device.module.device_count() if r.device.accelerated else 1
    for index in range(2):  # a second device where the rank sees one (the fake MLU has two)
        @r.check(f"all_reduce on the process's device {index}, where there is one")
        def _():
            host = _input(torch.float32, n, rank, f"device{index}").round()
            ref = host.clone()
            dist.all_reduce(ref, group=r.gloo)
            t = host.to(torch.device(dev.type, min(index, devices - 1)) if r.device.accelerated else dev)
            dist.all_reduce(t)
            return bool(torch.equal(t.cpu(), ref))

    @r.check("reduce_scatter stages back the rank's stripe only")
    def _():
        backend = dist.group.WORLD._get_backend(dev)
        x = _input(torch.float32, n * world, rank, "staging").to(dev)
        out = torch.empty(n, device=dev)
        before = backend.staged_bytes()
        dist.reduce_scatter_tensor(out, x)
        d2h, h2d = (a - b for a, b in zip(backend.staged_bytes(), before))
        if not r.device.accelerated or world == r.args.device_ranks:  # host ranks; or the vendor alone does it
            ok = (d2h, h2d) == (0, 0)
        else:  # all of its group's partial when alone in the group, else its share (and its stripe)
            ok = h2d == 4 * n and (d2h == 4 * n * world if r.args.device_ranks == 1 else d2h < 4 * n * world)
        return ok, f"device->host {d2h} B, host->device {h2d} B of a {4 * n * world} B input"


def _model():
    import torch

    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def _batches(world: int, steps: int, seed: int = 99):
    """Per step: the global batch (x, y) and each rank's unequal slice of it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        sizes = [(5 + 3 * q + 2 * step) % 11 + 1 for q in range(world)]
        x = torch.randn(sum(sizes), 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (sum(sizes),), generator=g)
        ends = [sum(sizes[:q + 1]) for q in range(world)]
        out.append((x, y, [slice(e - s, e) for e, s in zip(ends, sizes)]))
    return out


def _train(model, batches, rank: int, loss_of, device, lr: float = 0.5) -> None:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y, parts in batches:
        opt.zero_grad()
        loss_of(model(x[parts[rank]].to(device)), y[parts[rank]].to(device)).backward()
        opt.step()


def _worst(params, ref_params) -> float:
    return max(float((p.detach().cpu() - q.detach().cpu()).abs().max()) for p, q in zip(params, ref_params))


@contextlib.contextmanager
def cpu_buckets_beside_cuda():
    """Lets torch's comm hooks run on CPU buckets in a process that sees a GPU.

    torch's PowerSGD hook calls ``torch.cuda.synchronize(bucket device)`` whenever
    CUDA is available, a CPU bucket's too (``ValueError: Expected a cuda device,
    but got: cpu``): the gloo reference's buckets are CPU tensors, with nothing
    queued on a device to wait for, so their sync is skipped while it trains.
    """
    import torch

    real = torch.cuda.synchronize

    def synchronize(device=None):
        if device is not None and torch.device(device).type == "cpu":
            return
        real(device)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = real


def phase_training(r: Rank) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import kaitian

    dev, rank = r.device.torch, r.rank
    batches = _batches(r.world, 4)
    ref = _model()
    _train(ref, [(x, y, [slice(None)] * r.world) for x, y, _ in batches], 0, F.cross_entropy, "cpu")

    def scaled(out, y):
        return kaitian.scale_loss(F.cross_entropy(out, y), count=len(y))

    def exact(model, params=None) -> tuple:
        worst = _worst(params if params is not None else model.parameters(), ref.parameters())
        return worst < 1e-12, f"largest difference {worst}"

    @r.check("kaitian DDP on unequal batches = one process (fp64)")
    def _():
        model = kaitian.DistributedDataParallel(_model().to(dev))
        _train(model, batches, rank, F.cross_entropy, dev)
        return exact(model.module)

    for view in (True, False):
        @r.check(f"torch DDP (gradient_as_bucket_view={view}) + scale_loss = one process (fp64)")
        def _():
            model = TorchDDP(_model().to(dev), gradient_as_bucket_view=view)
            _train(model, batches, rank, scaled, dev)
            return exact(model.module)

    @r.check("FSDP2 fully_shard + scale_loss on unequal batches = one process (fp64)")
    def _():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(dev.type, (r.world,))
        model = _model().to(dev)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, batches, rank, scaled, dev)
        return exact(model, [p.full_tensor() for p in model.parameters()])

    hooks = {
        "fp16_compress_hook": (lambda pg: (pg, default_hooks.fp16_compress_hook), 2e-3),
        "PowerSGD": (lambda pg: (powerSGD_hook.PowerSGDState(process_group=pg, matrix_approximation_rank=1,
                                                             start_powerSGD_iter=2, random_seed=0),
                                 powerSGD_hook.powerSGD_hook), 1e-6),
    }
    for name, (hook, tol) in hooks.items():
        @r.check(f"torch DDP with {name} = the same over gloo")
        def _():
            longer = _batches(r.world, 6)
            model = TorchDDP(_model().to(dev))
            model.register_comm_hook(*hook(None))
            on_gloo = TorchDDP(_model(), process_group=r.gloo)
            on_gloo.register_comm_hook(*hook(r.gloo))
            _train(model, longer, rank, scaled, dev)
            with cpu_buckets_beside_cuda():
                _train(on_gloo, longer, rank, scaled, "cpu")
            worst = _worst(model.parameters(), on_gloo.parameters())
            return worst < tol, f"largest difference {worst} (tolerance {tol})"


def phase_clock(r: Rank) -> None:
    """Steps 0-1: the device is busy before backward (the count exchange starts
    behind that) and after the last gradient bucket (the step's end event waits
    for that); the last step: the last rank is slow, so rank 0 waits in the
    gradient all_reduce."""
    import torch
    import torch.nn.functional as F

    import kaitian
    from kaitian.training import ddp as ddp_module

    dev, rank, world, device = r.device.torch, r.rank, r.world, r.device

    class SlowBackward(torch.autograd.Function):
        """Identity whose backward queues a device delay: device work after every bucket."""

        seconds = 0.0

        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            device.sleep(SlowBackward.seconds)
            return grad

    calls = []
    exchange = ddp_module.gather_per_rank

    def timed_exchange(*args, **kwargs):
        start = time.perf_counter()
        try:
            return exchange(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)

    batches = _batches(world, 4)
    ddp_module.gather_per_rank = timed_exchange
    try:
        sampler = kaitian.DistributedSampler(list(range(64 * world)), batch_size=8)
        model = kaitian.DistributedDataParallel(_model().to(dev))
        balancer = kaitian.Rebalancer(sampler, model, every=1000, warmup_steps=0)
        seen, backward_s = [], []
        model.add_step_listener(seen.append)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y, parts) in enumerate(batches):
            busy = step < 2
            xs = x[parts[rank]].to(dev).requires_grad_(True)
            opt.zero_grad()
            SlowBackward.seconds = 1.5 if busy else 0.0
            loss = F.cross_entropy(model(SlowBackward.apply(xs)), y[parts[rank]].to(dev))
            device.synchronize()
            if busy:
                device.sleep(0.6)
            elif rank == world - 1 and step == len(batches) - 1:
                time.sleep(0.4)
            start = time.perf_counter()
            loss.backward()
            backward_s.append(time.perf_counter() - start)
            opt.step()
            if step == 0:
                r.report("a step's timing comes when the next step ends (device) or at once (CPU)",
                         len(seen) == (0 if device.accelerated else 1), f"{len(seen)} after step 0")
        device.synchronize()
        timings = list(model.step_timings)  # completes the newest step's record
    finally:
        ddp_module.gather_per_rank = exchange
    accelerated = device.accelerated
    r.report("the count exchange in the backward hook does not wait for the device",
             not accelerated or max(calls[:2]) < 0.3, f"slowest {max(calls[:2]):.3f} s behind a 0.6 s delay")
    r.report("backward does not wait for device work queued after its last bucket",
             not accelerated or max(backward_s[:2]) < 1.5,
             f"backward took {[round(b, 2) for b in backward_s[:2]]} s (0.6 s queued before, 1.5 s after)")
    r.report("communication time includes waiting for a slower peer", rank != 0 or timings[-1].comm_s > 0.1,
             str([round(t.comm_s, 3) for t in timings]))
    r.report("every step timed, times finite",
             len(timings) == len(seen) == len(batches) and all(0 < t.compute_s < 60 and 0 <= t.comm_s < 60
                                                                for t in timings),
             str([(round(t.compute_s, 3), round(t.comm_s, 3)) for t in timings]))
    decision = balancer.rebalance()
    r.report("Rebalancer: every rank's time per sample measured, finite",
             all(0 < t < 60 for t in decision.per_sample_s), str(decision.per_sample_s))


def phase_failstop(r: Rank) -> None:
    """Each case on a new group with a short timeout; the last ends a rank."""
    import torch
    import torch.distributed as dist

    dev, rank, last, T = r.device.torch, r.rank, r.world - 1, FAIL_TIMEOUT
    timeout = timedelta(seconds=T)

    def raises(name: str, fn, texts, within: float, ranks=None) -> None:
        start = time.monotonic()
        try:
            fn()
            error = ""
        except Exception as e:  # the expected failure
            error = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        r.report(name, bool(error) and all(t in error for t in texts) and took < within,
                 f"{took:.1f} s: {error or 'no error'}", ranks)

    def all_reduce(group):
        t = torch.ones(8, device=dev)
        dist.all_reduce(t, group=group)
        r.device.synchronize()

    late = dist.new_group(backend="kaitian", timeout=timeout)
    if rank == last:
        time.sleep(2 * T)
    raises("a late rank: every rank raises", lambda: all_reduce(late), [], 1.5 * T)
    raises("the group is broken after it", lambda: all_reduce(late), ["broken"], 1.0)

    mismatch = dist.new_group(backend="kaitian", timeout=timeout)
    call = (lambda: all_reduce(mismatch)) if rank == 0 else (lambda: dist.broadcast(torch.ones(8), 0, group=mismatch))
    if r.args.device_ranks > 1 and os.environ.get("KAITIAN_BRIDGE") == "tcp":
        # The device ranks meet first in their vendor's step (NCCL, CNCL), which
        # carries no call identity, and the TCP bridge cannot see the op a peer
        # is in: the mismatch shows as the step's timeout, on every rank.
        raises("a mismatched call: every rank raises (the vendor step times out)", call,
               ["timed out after"], 1.5 * T)
    else:  # (in a vendor's step, the shm bridge shows the op each peer is in)
        raises("a mismatched call: every rank names both", call,
               ["rank 0 called all_reduce(float32, 32 B, SUM)", "broadcast(float32, 32 B, root 0)"], T)

    if r.args.device_ranks > 0:
        stuck = dist.new_group(backend="kaitian", timeout=timeout)

        def stuck_device():
            t = torch.ones(1 << 12, device=dev)
            r.device.sleep(4 * T)  # rank 0's device queue is stuck well past the timeout
            dist.broadcast(t, 1, group=stuck)

        raises("a device queue stuck past the timeout fails the op at the timeout", stuck_device,
               ["timed out"], 1.5 * T)

    with r.device.stream():  # the default stream is still stuck
        dead = dist.new_group(backend="kaitian", timeout=timeout)
        dist.barrier(group=dead)
        if rank == last:
            os._exit(0)
        raises("a dead peer: every other rank raises naming it", lambda: all_reduce(dead), [f"rank {last}"], T,
               range(last))


def phase_bandwidth(r: Rank) -> None:
    import torch
    import torch.distributed as dist

    dev, world = r.device.torch, r.world
    if r.rank == 0:
        _say(f"{'op':<10}{'size':>10}{'kaitian ms':>12}{'busbw GB/s':>12}{'gloo ms':>10}{'busbw GB/s':>12}"
             f"{'ratio':>8}")
    for op in ("allreduce", "broadcast"):
        for nbytes in r.args.sizes:
            t = torch.ones(nbytes // 4, device=dev)

            def run_kaitian():
                dist.all_reduce(t) if op == "allreduce" else dist.broadcast(t, world - 1)

            def run_gloo():  # what a job without kaitian does: device -> host, gloo, host -> device
                host = t.cpu()
                if op == "allreduce":
                    dist.all_reduce(host, group=r.gloo)
                else:
                    dist.broadcast(host, world - 1, group=r.gloo)
                t.copy_(host)

            times = {}
            for name, fn in (("kaitian", run_kaitian), ("gloo", run_gloo)):
                fn()
                r.device.synchronize()
                dist.barrier(group=r.gloo)
                start = time.perf_counter()
                for _ in range(r.args.iters):
                    fn()
                r.device.synchronize()
                sec = torch.tensor([(time.perf_counter() - start) / r.args.iters], dtype=torch.float64)
                dist.all_reduce(sec, op=dist.ReduceOp.MAX, group=r.gloo)
                times[name] = float(sec)
            factor = 2 * (world - 1) / world if op == "allreduce" else 1.0
            bw = {k: nbytes / v / 1e9 * factor for k, v in times.items()}
            if r.rank == 0:
                _say(f"{op:<10}{nbytes >> 20:>7} MiB{times['kaitian'] * 1e3:>12.2f}{bw['kaitian']:>12.2f}"
                     f"{times['gloo'] * 1e3:>10.2f}{bw['gloo']:>12.2f}{bw['kaitian'] / bw['gloo']:>7.2f}x")


def _worker(args: argparse.Namespace) -> int:
    device_kind = os.environ.get("KAITIAN_DEVICE_TYPE", "cpu")
    import torch
    import torch.distributed as dist

    import kaitian  # noqa: F401  registers the backend (and installs the fake MLU: KAITIAN_FAKE_ACCELERATOR)

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(2)
    device = Device(device_kind)
    if device.accelerated:
        device.module.set_device(0)
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    r = Rank(args, device, store)
    for name in args.phases:
        if name == "bandwidth" and not args.sizes:
            continue
        with r.phase(name):
            globals()[f"phase_{name}"](r)
        if name == "failstop":
            break  # it ends a rank and breaks groups: nothing runs after it
    sys.stdout.flush()
    os._exit(1 if r.failures else 0)  # broken groups cannot be torn down collectively


# ------------------------------------------------------------------ the driver


def _summary(store, phases) -> tuple:
    """(the failed checks' names, how many checks there were), from the verdicts the ranks agreed on."""
    failed, count = [], 0
    for phase in phases:
        i = 0
        while store.check([f"checks/{phase}/{i}/verdict"]):
            verdict = json.loads(store.get(f"checks/{phase}/{i}/verdict"))
            if not verdict["ok"]:
                failed.append(f"{phase}: {verdict['name']}")
            i += 1
        count += i
    return failed, count


def _launch(args: argparse.Namespace) -> int:
    """Starts the job's ranks, hosts their store (the side channel: it outlives
    any rank) and watches them; 0 when every check passed."""
    import torch.distributed as dist

    world = args.device_ranks + args.cpu_ranks
    fake_mlus = max(2, args.device_ranks)
    run_dir = tempfile.mkdtemp(prefix="kaitian-device-check-")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_ids = visible.split(",") if visible else [str(i) for i in range(args.gpus)]
    procs = []
    try:
        for rank in range(world):
            env = {k: v for k, v in os.environ.items() if not k.startswith("KAITIAN_")}
            env.update(KAITIAN_RUN_DIR=run_dir, KAITIAN_CHUNK_BYTES=str(args.chunk_bytes), KAITIAN_BRIDGE=args.bridge,
                       PYTHONUNBUFFERED="1")
            if args.device == "mlu":
                env["KAITIAN_FAKE_ACCELERATOR"] = f"mlu:{fake_mlus}"
            if rank < args.device_ranks:
                index = gpu_ids[rank] if args.device == "cuda" else str(rank)
                env.update(KAITIAN_DEVICE_TYPE=args.device, KAITIAN_DEVICE_INDEX=index, KAITIAN_GROUP=args.device)
                if args.device == "cuda":
                    env["CUDA_VISIBLE_DEVICES"] = index
                elif args.device_ranks == 1:  # its MLU, and a second one for the memory phase's second-device check
                    env["MLU_VISIBLE_DEVICES"] = "0,1"
                else:  # a vendor group drives one device per rank (as NCCL and CNCL do)
                    env["MLU_VISIBLE_DEVICES"] = index
            else:
                env.update(KAITIAN_DEVICE_TYPE="cpu", KAITIAN_DEVICE_INDEX=str(rank), KAITIAN_GROUP="cpu",
                           CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2")
            cmd = [sys.executable, os.path.abspath(__file__), "--_worker", "--rank", str(rank),
                   "--world-size", str(world), "--store-port", str(store.port),
                   "--check-timeout", str(args.check_timeout),
                   "--device-ranks", str(args.device_ranks),
                   "--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters),
                   "--big-mib", str(args.big_mib), "--phases", ",".join(args.phases)]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.monotonic() + sum(PHASES[p] for p in args.phases) + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for rank, p in enumerate(procs):  # the ranks stop waiting for one that exited
                if p.poll() is not None and not store.check([f"exited/{rank}"]):
                    store.set(f"exited/{rank}", str(p.returncode))
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        failed, count = _summary(store, args.phases)
        stopped = [f"{phase} stopped on rank {q}" for phase in args.phases for q in range(world)
                   if store.check([f"stopped/{phase}/{q}"])]
        print(f"cuda_check: {count} checks, {count - len(failed)} passed, {len(failed)} failed"
              + "".join(f"\nFAILED  {line}" for line in failed + stopped), flush=True)
        if any(c is None for c in codes):
            print(f"FAIL  job: ranks still running after every phase's watchdog; exit codes {codes}", flush=True)
            return 1
        if any(codes) and not (failed or stopped):
            print(f"FAIL  job: rank exit codes {codes} (a watchdog)", flush=True)
        return 1 if any(codes) or failed or stopped else 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


NPROC_AUTO_WORKER = "--_nproc_auto_worker"


def _nproc_auto_worker() -> int:
    """A kaitianrun worker: one all_reduce on its device, its view in one JSON line."""
    import torch
    import torch.distributed as dist

    import kaitian

    dist.init_process_group("kaitian")
    device = kaitian.set_device()
    t = torch.full((4,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(t)
    world = dist.get_world_size()
    print(json.dumps({"rank": dist.get_rank(), "device": str(t.device), "ok": bool((t == world * (world + 1) // 2).all()),
                      **{k: v for k, v in os.environ.items() if k.startswith("KAITIAN_DEVICE")}}), flush=True)
    dist.destroy_process_group()
    return 0


def _check_nproc_auto(args: argparse.Namespace) -> int:
    """``kaitianrun --nproc-auto`` end to end: GPUs found through NVML (a GPU
    machine) or simulated CPU groups; every worker's collective right."""
    print("== kaitianrun --nproc-auto", flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAITIAN_", "USE_"))}
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-auto", "--standalone"]
    if args.device == "cuda":
        from kaitian.devices.vendors import nvidia

        found = nvidia.probe()
        sources = {d.source for d in found}
        print(f"{'PASS' if sources == {'nvml'} else 'FAIL'}  kaitianrun: GPUs found through NVML "
              f"({len(found)} found, sources {sorted(sources)})", flush=True)
        env.update(USE_CUDA="0", USE_CPU="0")
        want = {"cuda", "cpu"}
    elif args.device == "mlu":  # two fake MLUs found through KAITIAN_FAKE_ACCELERATOR, one cncl group
        env.update(KAITIAN_FAKE_ACCELERATOR="mlu:2", USE_MLU="0,1", USE_CPU="-1")
        want = {"mlu"}
    else:  # no device: two simulated CPU groups
        cmd += ["--cpu-slots", "2", "--cpu-groups", "2"]
        env.update(USE_CUDA="-1", USE_MLU="-1")
        want = {"cpu"}
    proc = subprocess.run(cmd + [os.path.abspath(__file__), NPROC_AUTO_WORKER], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    ranks = [json.loads(line[line.index("{"):]) for line in proc.stdout.splitlines() if "{" in line]
    ok = proc.returncode == 0 and len(ranks) == 2 and all(q["ok"] for q in ranks) and \
        {q.get("KAITIAN_DEVICE_TYPE") for q in ranks} == want
    print(f"{'PASS' if ok else 'FAIL'}  kaitianrun --nproc-auto: one worker per selected device, "
          f"collective right ({[(q.get('KAITIAN_DEVICE_TYPE'), q['device']) for q in ranks]})", flush=True)
    if not ok:
        print(f"      exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [NPROC_AUTO_WORKER]:
        return _nproc_auto_worker()
    ap = argparse.ArgumentParser(description="kaitian: device + CPU ranks, correctness and bridge bandwidth")
    ap.add_argument("--device", choices=("cuda", "mlu"), default="cuda",
                    help="the device: cuda (GPUs) or mlu (kaitian's fake MLU, no hardware needed)")
    ap.add_argument("--device-ranks", "--cuda-ranks", dest="device_ranks", type=int, default=1,
                    help="ranks on the device, one device each (default 1; 0: a CPU-only dry run)")
    ap.add_argument("--cpu-ranks", type=int, default=2, help="CPU ranks, one group (default 2)")
    ap.add_argument("--sizes", default="4M,64M,256M",
                    help="bandwidth sizes in bytes (default 4M,64M,256M; empty: no bandwidth phase)")
    ap.add_argument("--iters", type=int, default=10, help="calls per bandwidth measurement")
    ap.add_argument("--big-mib", type=int, default=100, help="the largest reduction of the sizes phase, MiB")
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20, help="KAITIAN_CHUNK_BYTES of the job")
    ap.add_argument("--bridge", choices=("auto", "shm", "tcp"), default="auto", help="KAITIAN_BRIDGE of the job")
    ap.add_argument("--phases", default=",".join(p for p in PHASES if p != "harness"),
                    help="phases to run, in order (default: all; harness: the checks' own test, first)")
    ap.add_argument("--check-timeout", type=float, default=60.0,
                    help="seconds a check may take before it counts as hung (its groups' timeout too)")
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world-size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [_parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        print(f"cuda_check: unknown phase(s) {unknown}; known: {', '.join(PHASES)}", file=sys.stderr)
        return 2
    if args._worker:
        return _worker(args)
    if args.device_ranks == 0:
        args.device = "cpu"
    args.gpus = 0
    if args.device == "cuda":
        import torch

        args.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if args.device_ranks > args.gpus:
            print(f"cuda_check: {args.device_ranks} CUDA rank(s) asked for but {args.gpus} GPU(s) visible; "
                  f"use --device mlu (the fake MLU) or --device-ranks 0 (CPU only)", file=sys.stderr)
            return 2
    if args.device_ranks + args.cpu_ranks < 2:
        print("cuda_check: need at least 2 ranks in total", file=sys.stderr)
        return 2
    start = time.monotonic()
    print(f"cuda_check: {args.device_ranks} {args.device if args.device_ranks else 'device'} rank(s) + "
          f"{args.cpu_ranks} CPU rank(s)", flush=True)
    code = _launch(args)
    code |= _check_nproc_auto(args)
    print(f"cuda_check: {'all checks passed' if code == 0 else 'FAILED'} in {time.monotonic() - start:.0f} s",
          flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
