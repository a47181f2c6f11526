"""The collective test matrix's cases: every op x dtype x reduce op, checked against gloo.

``tests/workers/collective_matrix.py`` runs them in every rank. Each rank initialises the
process group under test (``--backend``, normally ``kaitian``) as the default
group and a ``gloo`` group over the same ranks, then runs every case of the
matrix: the same inputs go through both groups and the results are compared
(exactly for data movement, integers, MIN/MAX; with a tolerance against a
float64 gloo reference where the arithmetic may differ in rounding). One JSON
line per case goes to ``--out`` (flushed as it goes, so a hang still leaves the
name of the case it hung in).

The pytest side (``tests/backend/test_collectives.py``) starts the ranks of a
layout once and turns each line into its own test case. Case names::

    python tests/workers/collective_matrix.py --list --world-size 3

``--backend gloo`` runs gloo against gloo (the harness's self-check) and
``--fault NAME`` corrupts the result under test for cases whose name contains
NAME, which the harness must report as failures.
"""

from __future__ import annotations

import os
import time
import warnings
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, List, Optional

__all__ = ["Case", "Ctx", "build_cases", "case_names"]

# torch is imported lazily so `--list` and the pytest collection stay cheap.
torch = None  # type: ignore[assignment]
dist = None  # type: ignore[assignment]


def _import_torch() -> None:
    global torch, dist
    if torch is None:
        import torch as _torch
        import torch.distributed as _dist

        torch, dist = _torch, _dist
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)


# dtype names -> torch attribute; the matrix is written in names so that the
# case list can be built without importing torch.
FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int8", "int16", "int32", "int64", "uint8")
ALL_DTYPES = FLOATS + INTS + ("bool",)
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
LATE_INPUT_S = 0.001  # how late a fake device's input lands (see Ctx.make)


def _ops_for(dtype: str) -> tuple:
    """Reduce ops that make sense for ``dtype``."""
    if dtype in FLOATS:
        return ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM")
    # Integer / bool: no AVG or PREMUL_SUM (NCCL rejects them too).
    return ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


@dataclass
class Case:
    """One check of the matrix.

    Attributes:
        name: unique, stable name (``op-dtype-variant``), used as the pytest id.
        fn: runs the check on every rank; raises ``AssertionError`` on a mismatch.
        core: part of the reduced matrix run on the transport-variant layouts.
    """

    name: str
    fn: Callable[["Ctx"], None]
    core: bool = False


class Ctx:
    """Per-rank state shared by the cases."""

    def __init__(self, rank: int, world: int, groups: List[str], dut, ref, fault: Optional[str],
                 device=None):
        self.rank = rank
        self.world = world
        self.groups = groups  # group name of every rank
        self.dut = dut  # process group under test (None = default group)
        self.ref = ref  # gloo group over the same ranks (CPU tensors)
        self.fault = fault
        self.device = torch.device(device or "cpu")  # where this rank's tensors under test live
        self.case = ""

    # -- inputs -----------------------------------------------------------
    def gen(self, rank: int, salt: str = ""):
        g = torch.Generator()
        g.manual_seed(zlib.crc32(f"{self.case}/{salt}/{rank}".encode()))
        return g

    def make(self, dtype: str, shape, rank: Optional[int] = None, op: str = "SUM", salt: str = ""):
        """Deterministic input of ``rank`` (default: this rank) for this case, on this rank's device.

        On the fake accelerator it lands late: its copy is queued behind a
        delay on the current stream, so that an op which does not wait for the
        caller's stream reads garbage.
        """
        x = self.make_on_host(dtype, shape, self.rank if rank is None else rank, op, salt)
        if self.device.type == "cpu":
            return x
        from kaitian.testing import fake_accelerator

        if fake_accelerator.installed() == self.device.type:
            fake_accelerator.sleep(LATE_INPUT_S)
        return x.pin_memory().to(self.device, non_blocking=True)

    def make_on_host(self, dtype: str, shape, rank: int, op: str = "SUM", salt: str = ""):
        """The same input as a CPU tensor."""
        g = self.gen(rank, salt)
        dt = getattr(torch, dtype)
        if dtype == "bool":
            return torch.randint(0, 2, shape, generator=g).bool()
        if dtype in FLOATS:
            if op == "PRODUCT":
                x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
            else:
                x = torch.randn(shape, generator=g, dtype=torch.float64) * 4
            return x.to(dt)
        info = torch.iinfo(dt)
        if op in ("BAND", "BOR", "BXOR", "MIN", "MAX"):
            lo, hi = info.min, info.max
        elif op == "PRODUCT":
            lo, hi = (0, 3) if info.min == 0 else (-2, 2)
        else:  # sums of up to 4 ranks must not overflow the narrow types
            lo, hi = (0, 60) if info.min == 0 else (-30, 30)
        if dtype == "int64" and op in ("BAND", "BOR", "BXOR", "MIN", "MAX"):
            lo, hi = -(1 << 62), 1 << 62
        return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64).to(dt)

    # -- fault injection (harness self-check) -----------------------------
    def corrupt(self, t):
        """With ``--fault``, perturbs a result under test of a matching case."""
        if self.fault and self.fault in self.case and t.numel() > 0:
            flat = t.view(-1) if t.is_contiguous() else t.reshape(-1)
            if t.dtype == torch.bool:
                flat[0] = ~flat[0]
            else:
                flat[0] += 1
            if not t.is_contiguous():
                t.copy_(flat.view(t.shape))
        return t


# -- comparison helpers ------------------------------------------------------

_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


def _check(ctx: Ctx, what: str, got, expected, dtype: str, scale: float = 1.0, exact: bool = False) -> None:
    """Asserts ``got`` matches ``expected`` (same shape; dtype of ``dtype``), compared on the host."""
    got, expected = got.cpu(), expected.cpu()
    if tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != expected {tuple(expected.shape)}")
    if str(got.dtype) != f"torch.{dtype}":
        raise AssertionError(f"{what}: dtype {got.dtype} != torch.{dtype}")
    if got.numel() == 0:
        return
    if exact or dtype not in FLOATS:
        eq = got == expected.to(got.dtype)
        if dtype in FLOATS:
            eq = eq | (torch.isnan(got) & torch.isnan(expected.to(got.dtype)))
        if not bool(eq.all()):
            idx = int((~eq).reshape(-1).nonzero()[0])
            raise AssertionError(
                f"{what}: {int((~eq).sum())}/{got.numel()} elements differ; first at flat index {idx}: "
                f"got {got.reshape(-1)[idx].item()!r}, expected {expected.reshape(-1)[idx].item()!r}"
            )
        return
    g = got.double()
    e = expected.double()
    # Rounding differs with the summation order and, for fp16/bf16, kaitian
    # sums across groups in fp32: allow a few ulps of the dtype per rank.
    tol = 4 * ctx.world * _EPS[dtype] * (e.abs() + scale)
    bad = (g - e).abs() > tol
    if bool(bad.any()):
        idx = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{got.numel()} elements off by more than the tolerance; first at flat "
            f"index {idx}: got {g.reshape(-1)[idx].item()!r}, expected {e.reshape(-1)[idx].item()!r}"
        )


def _redop(name: str, factor: float = 0.5):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, name)


def _ref_allreduce(ctx: Ctx, x, op: str):
    """gloo's all_reduce of ``x`` (on a host copy; float64 for arithmetic on floats)."""
    x = x.cpu()
    dtype = str(x.dtype).replace("torch.", "")
    if dtype in FLOATS and op in ("SUM", "AVG", "PRODUCT", "PREMUL_SUM"):
        y = x.double().contiguous().clone()
    elif dtype == "int16":  # gloo has no int16: carry it in int32 (wraps the same way)
        y = x.to(torch.int32).contiguous().clone()
    else:
        y = x.contiguous().clone()
    if op == "PREMUL_SUM":
        y.mul_(0.5)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=ctx.ref)
    elif op == "AVG":
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=ctx.ref)
        y.div_(ctx.world)
    else:
        dist.all_reduce(y, op=getattr(dist.ReduceOp, op), group=ctx.ref)
    if dtype not in FLOATS or op in ("MIN", "MAX"):
        y = y.to(x.dtype)
    return y


def _ref_allgather(ctx: Ctx, x) -> list:
    """Every rank's ``x`` through gloo (host copies; int16 carried in int32)."""
    x = x.cpu()
    carry = x.to(torch.int32) if x.dtype == torch.int16 else x.contiguous()
    out = [torch.empty_like(carry) for _ in range(ctx.world)]
    dist.all_gather(out, carry, group=ctx.ref)
    return [o.to(x.dtype) for o in out]


def _scale(ctx: Ctx, dtype: str, shape, op: str) -> float:
    if dtype not in FLOATS:
        return 1.0
    return max(float(ctx.make_on_host(dtype, shape, r, op).double().abs().max()) if _numel(shape) else 0.0
               for r in range(ctx.world))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- the cases -------------------------------------------------------------------


def _allreduce_case(dtype: str, op: str, shape=(1025,), noncontig: bool = False, async_op: bool = False):
    def fn(ctx: Ctx) -> None:
        x = ctx.make(dtype, shape, op=op)
        expected = _ref_allreduce(ctx, x, op)
        if noncontig:
            # The view is every other column of a wider base; the columns in
            # between must come out untouched (gloo 2.13 corrupts them).
            base = ctx.make(dtype, (shape[0], shape[1] * 2), op=op, salt="base")
            view = base[:, ::2]
            view.copy_(x)
            snapshot = base.clone()
            t = view
        else:
            t = x.clone()
        work = dist.all_reduce(t, op=_redop(op), group=ctx.dut, async_op=async_op)
        if async_op:
            work.wait(timedelta(seconds=60))
            fut = work.get_future().wait()
            if not (isinstance(fut, list) and len(fut) == 1 and fut[0].data_ptr() == t.data_ptr()):
                raise AssertionError(f"work.get_future() value {fut!r} is not [the reduced tensor]")
        ctx.corrupt(t)
        exact = op in ("MIN", "MAX")
        _check(ctx, "all_reduce result", t, expected, dtype, _scale(ctx, dtype, shape, op), exact)
        if noncontig:
            _check(ctx, "memory between the view's columns", base[:, 1::2], snapshot[:, 1::2], dtype, exact=True)

    return fn


def _allreduce_coalesced_case(dtype: str, op: str, via: str):
    shapes = [(17,), (3, 100), (0,), (1,)]

    def fn(ctx: Ctx) -> None:
        xs = [ctx.make(dtype, s, op=op, salt=str(i)) for i, s in enumerate(shapes)]
        expected = [_ref_allreduce(ctx, x, op) for x in xs]
        ts = [x.clone() for x in xs]
        if via == "api":
            dist.all_reduce_coalesced(ts, op=_redop(op), group=ctx.dut)
        else:
            with dist._coalescing_manager(group=ctx.dut, async_ops=True) as cm:
                for t in ts:
                    dist.all_reduce(t, op=_redop(op), group=ctx.dut)
            cm.wait()
        for i, (t, e) in enumerate(zip(ts, expected)):
            ctx.corrupt(t)
            _check(ctx, f"tensor {i}", t, e, dtype, _scale(ctx, dtype, shapes[i], op), op in ("MIN", "MAX"))

    return fn


def _broadcast_case(dtype: str, src: int, shape=(513,), noncontig: bool = False, async_op: bool = False):
    def fn(ctx: Ctx) -> None:
        src_r = src % ctx.world
        x = ctx.make(dtype, shape, rank=src_r)
        # gloo's broadcast of the same data is the reference (int16 carried in int32)
        ref = (x.clone() if ctx.rank == src_r else ctx.make(dtype, shape, salt="junk")).cpu()
        ref = ref.to(torch.int32) if dtype == "int16" else ref.contiguous()
        dist.broadcast(ref, src_r, group=ctx.ref)
        ref = ref.to(x.dtype)
        if noncontig:
            base = ctx.make(dtype, (shape[0], shape[1] * 2), salt="base")
            t = base[:, ::2]
            if ctx.rank == src_r:
                t.copy_(x)
            snapshot = base.clone()
        else:
            t = x.clone() if ctx.rank == src_r else ctx.make(dtype, shape, salt="junk")
        work = dist.broadcast(t, src_r, group=ctx.dut, async_op=async_op)
        if async_op:
            work.wait()
        ctx.corrupt(t)
        _check(ctx, f"broadcast from {src_r}", t, ref, dtype, exact=True)
        _check(ctx, "gloo reference (sanity)", ref, x, dtype, exact=True)
        if noncontig:
            _check(ctx, "memory between the view's columns", base[:, 1::2], snapshot[:, 1::2], dtype, exact=True)

    return fn


def _reduce_case(dtype: str, op: str, dst: int, shape=(257,), noncontig: bool = False):
    def fn(ctx: Ctx) -> None:
        dst_r = dst % ctx.world
        x = ctx.make(dtype, shape, op=op)
        expected = _ref_allreduce(ctx, x, op)
        if noncontig:
            base = ctx.make(dtype, (shape[0], shape[1] * 2), op=op, salt="base")
            t = base[:, ::2]
            t.copy_(x)
            snapshot = base.clone()
        else:
            t = x.clone()
        dist.reduce(t, dst_r, op=_redop(op), group=ctx.dut)
        if ctx.rank == dst_r:
            ctx.corrupt(t)
            _check(ctx, f"reduce to {dst_r}", t, expected, dtype, _scale(ctx, dtype, shape, op), op in ("MIN", "MAX"))
        if noncontig:
            _check(ctx, "memory between the view's columns", base[:, 1::2], snapshot[:, 1::2], dtype, exact=True)

    return fn


def _allgather_case(dtype: str, variant: str, shape=(129,), async_op: bool = False):
    """variant: list | into_tensor | into_tensor_coalesced | coalesced | noncontig."""

    def fn(ctx: Ctx) -> None:
        if variant == "noncontig":
            base = ctx.make(dtype, (shape[0], 2 * shape[1]), salt="base")
            x = base[:, ::2]
        else:
            x = ctx.make(dtype, shape)
        expected = [ctx.make(dtype, x.shape, rank=r) if variant != "noncontig"
                    else ctx.make(dtype, (shape[0], 2 * shape[1]), rank=r, salt="base")[:, ::2]
                    for r in range(ctx.world)]
        ref = _ref_allgather(ctx, x)
        for r in range(ctx.world):
            _check(ctx, f"gloo reference from {r} (sanity)", ref[r], expected[r], dtype, exact=True)
        if variant in ("list", "noncontig"):
            out = [ctx.make(dtype, x.shape, salt="junk") for _ in range(ctx.world)]
            work = dist.all_gather(out, x, group=ctx.dut, async_op=async_op)
            if async_op:
                work.wait()
                fut = work.get_future().wait()
                # gloo gives the output list itself; [[...]] is accepted too
                flat = fut[0] if isinstance(fut, list) and len(fut) == 1 and isinstance(fut[0], list) else fut
                if not (isinstance(flat, list) and [t.data_ptr() for t in flat] == [t.data_ptr() for t in out]):
                    raise AssertionError(f"work.get_future() value is not the output list: {fut!r}")
            got = out
        elif variant == "into_tensor":
            out = torch.empty((ctx.world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=ctx.device)
            work = dist.all_gather_into_tensor(out, x, group=ctx.dut, async_op=async_op)
            if async_op:
                work.wait()
            got = list(out.chunk(ctx.world)) if x.numel() else [out[:0]] * ctx.world
        elif variant == "into_tensor_coalesced":
            y = ctx.make(dtype, (7, 3), salt="second")
            out = torch.empty((ctx.world * x.shape[0],), dtype=x.dtype, device=ctx.device)
            out2 = torch.empty((ctx.world * 7, 3), dtype=x.dtype, device=ctx.device)
            with dist._coalescing_manager(group=ctx.dut, async_ops=True) as cm:
                dist.all_gather_into_tensor(out, x, group=ctx.dut)
                dist.all_gather_into_tensor(out2, y, group=ctx.dut)
            cm.wait()
            for r in range(ctx.world):
                _check(ctx, f"second tensor, block of rank {r}", out2[r * 7:(r + 1) * 7],
                       ctx.make(dtype, (7, 3), rank=r, salt="second"), dtype, exact=True)
            got = list(out.chunk(ctx.world))
        elif variant == "coalesced":
            # output_tensor_lists[r] holds rank r's copy of every input tensor
            y = ctx.make(dtype, (5,), salt="second")
            out = [[torch.empty_like(x), torch.empty_like(y)] for _ in range(ctx.world)]
            dist.all_gather_coalesced(out, [x, y], group=ctx.dut)
            for r in range(ctx.world):
                _check(ctx, f"second tensor of rank {r}", out[r][1], ctx.make(dtype, (5,), rank=r, salt="second"),
                       dtype, exact=True)
            got = [o[0] for o in out]
        else:
            raise ValueError(variant)
        for r in range(ctx.world):
            ctx.corrupt(got[r])
            _check(ctx, f"block of rank {r}", got[r], ref[r], dtype, exact=True)

    return fn


def _gather_case(dtype: str, dst: int, shape=(65,)):
    def fn(ctx: Ctx) -> None:
        dst_r = dst % ctx.world
        x = ctx.make(dtype, shape)
        ref = _ref_allgather(ctx, x)
        out = [ctx.make(dtype, shape, salt="junk") for _ in range(ctx.world)] if ctx.rank == dst_r else None
        dist.gather(x, out, dst=dst_r, group=ctx.dut)
        if ctx.rank == dst_r:
            for r in range(ctx.world):
                ctx.corrupt(out[r])
                _check(ctx, f"gather to {dst_r}, block of rank {r}", out[r], ref[r], dtype, exact=True)

    return fn


def _scatter_case(dtype: str, src: int, shape=(65,)):
    def fn(ctx: Ctx) -> None:
        src_r = src % ctx.world
        chunks = [ctx.make(dtype, shape, rank=src_r, salt=f"chunk{r}") for r in range(ctx.world)]
        t = ctx.make(dtype, shape, salt="junk")
        dist.scatter(t, [c.clone() for c in chunks] if ctx.rank == src_r else None, src=src_r, group=ctx.dut)
        # gloo's scatter of the same chunks is the reference.
        carry = (lambda c: c.to("cpu", torch.int32)) if dtype == "int16" else (lambda c: c.cpu().clone())
        r_out = carry(torch.empty_like(t))
        dist.scatter(r_out, [carry(c) for c in chunks] if ctx.rank == src_r else None, src=src_r, group=ctx.ref)
        ctx.corrupt(t)
        _check(ctx, f"scatter from {src_r}", t, r_out.to(t.dtype), dtype, exact=True)
        _check(ctx, "gloo reference (sanity)", r_out.to(t.dtype), chunks[ctx.rank], dtype, exact=True)

    return fn


def _reduce_scatter_case(dtype: str, op: str, variant: str, block: int = 33):
    """variant: list | tensor | tensor_coalesced | zero."""

    def fn(ctx: Ctx) -> None:
        blk = 0 if variant == "zero" else block
        full = ctx.make(dtype, (ctx.world * blk,), op=op)
        expected = _ref_allreduce(ctx, full, op)[ctx.rank * blk:(ctx.rank + 1) * blk]
        scale = _scale(ctx, dtype, (ctx.world * blk,), op)
        out = ctx.make(dtype, (blk,), salt="junk")
        if variant == "list":
            dist.reduce_scatter(out, [c.clone() for c in full.split(blk)] if blk else
                                [full.clone() for _ in range(ctx.world)], op=_redop(op), group=ctx.dut)
        elif variant in ("tensor", "zero"):
            dist.reduce_scatter_tensor(out, full.clone(), op=_redop(op), group=ctx.dut)
        elif variant == "tensor_coalesced":
            full2 = ctx.make(dtype, (ctx.world * 4, 2), op=op, salt="second")
            exp2 = _ref_allreduce(ctx, full2, op)[ctx.rank * 4:(ctx.rank + 1) * 4]
            out2 = torch.empty((4, 2), dtype=full2.dtype, device=ctx.device)
            with dist._coalescing_manager(group=ctx.dut, async_ops=True) as cm:
                dist.reduce_scatter_tensor(out, full.clone(), op=_redop(op), group=ctx.dut)
                dist.reduce_scatter_tensor(out2, full2.clone(), op=_redop(op), group=ctx.dut)
            cm.wait()
            _check(ctx, "second tensor", out2, exp2, dtype, _scale(ctx, dtype, (ctx.world * 4, 2), op),
                   op in ("MIN", "MAX"))
        ctx.corrupt(out)
        _check(ctx, "reduce_scatter block", out, expected, dtype, scale, op in ("MIN", "MAX"))

    return fn


def _alltoall_case(dtype: str, variant: str):
    """variant: list | list_uneven | single_even | single_uneven | single_zero."""

    def fn(ctx: Ctx) -> None:
        w = ctx.world
        if variant in ("list", "list_uneven"):
            # even: 6 elements per pair (gloo's alltoall needs equal blocks and is the
            # reference); uneven: rank r sends (r + d + 1) elements to d, checked
            # against the known data.
            size = (lambda s, d: s + d + 1) if variant == "list_uneven" else (lambda s, d: 6)
            send = [ctx.make(dtype, (size(ctx.rank, d),), salt=f"to{d}") for d in range(w)]
            out = [ctx.make(dtype, (size(s, ctx.rank),), salt="junk") for s in range(w)]
            dist.all_to_all(out, [t.clone() for t in send], group=ctx.dut)
            if variant == "list":
                carry = (lambda c: c.to("cpu", torch.int32)) if dtype == "int16" else (lambda c: c.cpu().clone())
                ref = [carry(torch.empty_like(o)) for o in out]
                try:
                    dist.all_to_all(ref, [carry(t) for t in send], group=ctx.ref)
                except RuntimeError as exc:  # gloo before torch 2.12 has no list alltoall: known data only
                    if "does not support alltoall" not in str(exc):
                        raise
                    ref = None
            for s in range(w):
                exp = ctx.make(dtype, (size(s, ctx.rank),), rank=s, salt=f"to{ctx.rank}")
                if variant == "list" and ref is not None:
                    _check(ctx, f"gloo reference block from rank {s} (sanity)", ref[s].to(out[s].dtype), exp, dtype,
                           exact=True)
                ctx.corrupt(out[s])
                _check(ctx, f"block from rank {s}", out[s], exp, dtype, exact=True)
            return

        def split(src: int, dst: int) -> int:
            if variant == "single_even":
                return 16
            if variant == "single_zero":
                return 0 if (src + dst) % 2 else 3
            return (src * 3 + dst * 5) % 7  # uneven, some zero

        in_splits = [split(ctx.rank, d) for d in range(w)]
        out_splits = [split(s, ctx.rank) for s in range(w)]
        x = ctx.make(dtype, (sum(in_splits), 2))
        out = ctx.make(dtype, (sum(out_splits), 2), salt="junk")
        even = variant == "single_even"
        dist.all_to_all_single(out, x, None if even else out_splits, None if even else in_splits, group=ctx.dut)
        # reference: the same exchange through gloo
        carry = (lambda c: c.to("cpu", torch.int32)) if dtype == "int16" else (lambda c: c.cpu().clone())
        ref = carry(torch.empty_like(out))
        dist.all_to_all_single(ref, carry(x), None if even else out_splits, None if even else in_splits,
                               group=ctx.ref)
        ctx.corrupt(out)
        _check(ctx, "all_to_all_single output", out, ref.to(out.dtype), dtype, exact=True)

    return fn


def _barrier_case(ctx: Ctx) -> None:
    # Every rank drops a file, then waits in the barrier; after it every file
    # must exist. The rank with the most work arrives last.
    marker_dir = os.environ["KT_MATRIX_MARKERS"]
    round_dir = os.path.join(marker_dir, ctx.case)
    os.makedirs(round_dir, exist_ok=True)
    if ctx.rank == ctx.world - 1:
        time.sleep(0.2)
    with open(os.path.join(round_dir, str(ctx.rank)), "w"):
        pass
    dist.barrier(group=ctx.dut)
    present = sorted(os.listdir(round_dir))
    if len(present) != ctx.world:
        raise AssertionError(f"barrier returned before every rank arrived: markers {present}")
    dist.barrier(group=ctx.ref)  # keep the next case's directory listing clean


def _sendrecv_case(dtype: str, variant: str):
    """variant: blocking | async | batch | anysource."""

    def fn(ctx: Ctx) -> None:
        w = ctx.world
        if variant == "batch":
            # ring in both directions with batch_isend_irecv
            nxt, prv = (ctx.rank + 1) % w, (ctx.rank - 1) % w
            out_a = ctx.make(dtype, (37,), salt="junk")
            out_b = ctx.make(dtype, (37,), salt="junk2")
            ops = [dist.P2POp(dist.isend, ctx.make(dtype, (37,), salt="fwd"), nxt, group=ctx.dut),
                   dist.P2POp(dist.irecv, out_a, prv, group=ctx.dut),
                   dist.P2POp(dist.isend, ctx.make(dtype, (37,), salt="bwd"), prv, group=ctx.dut),
                   dist.P2POp(dist.irecv, out_b, nxt, group=ctx.dut)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            ctx.corrupt(out_a)
            _check(ctx, f"from {prv}", out_a, ctx.make(dtype, (37,), rank=prv, salt="fwd"), dtype, exact=True)
            _check(ctx, f"from {nxt}", out_b, ctx.make(dtype, (37,), rank=nxt, salt="bwd"), dtype, exact=True)
            return
        if variant == "anysource":
            # every rank > 0 sends to rank 0, which receives from any source
            if ctx.rank == 0:
                seen = set()
                for _ in range(w - 1):
                    t = ctx.make(dtype, (11,), salt="junk")
                    sender = dist.recv(t, group=ctx.dut)
                    ctx.corrupt(t)
                    _check(ctx, f"message reported from {sender}", t,
                           ctx.make(dtype, (11,), rank=sender, salt="msg"), dtype, exact=True)
                    seen.add(sender)
                if seen != set(range(1, w)):
                    raise AssertionError(f"any-source receives reported senders {sorted(seen)}")
            else:
                dist.send(ctx.make(dtype, (11,), salt="msg"), 0, group=ctx.dut)
            return
        # every ordered pair (s, d), one at a time, inside and between groups
        for s in range(w):
            for d in range(w):
                if s == d:
                    continue
                size = (s * w + d) * 7 + 1
                if ctx.rank == s:
                    x = ctx.make(dtype, (size,), salt=f"{s}->{d}")
                    if variant == "async":
                        dist.isend(x, d, group=ctx.dut).wait()
                    else:
                        dist.send(x, d, group=ctx.dut)
                elif ctx.rank == d:
                    t = ctx.make(dtype, (size,), salt="junk")
                    if variant == "async":
                        work = dist.irecv(t, s, group=ctx.dut)
                        work.wait()
                    else:
                        dist.recv(t, s, group=ctx.dut)
                    ctx.corrupt(t)
                    kind = "same group" if ctx.groups[s] == ctx.groups[d] else "between groups"
                    _check(ctx, f"{s}->{d} ({kind})", t, ctx.make(dtype, (size,), rank=s, salt=f"{s}->{d}"),
                           dtype, exact=True)

    return fn


def _async_mix_case(ctx: Ctx) -> None:
    """Several async collectives in flight at once, waited in reverse order."""
    a = ctx.make("float32", (4099,))
    b = ctx.make("int64", (300,), op="MAX")
    c = ctx.make("bfloat16", (513,))
    exp_a = _ref_allreduce(ctx, a, "SUM")
    exp_b = _ref_allreduce(ctx, b, "MAX")
    src_c = ctx.make("bfloat16", (513,), rank=ctx.world - 1)
    works = [dist.all_reduce(a, group=ctx.dut, async_op=True),
             dist.all_reduce(b, op=dist.ReduceOp.MAX, group=ctx.dut, async_op=True),
             dist.broadcast(c, ctx.world - 1, group=ctx.dut, async_op=True)]
    futs = [w.get_future() for w in works]
    for w in reversed(works):
        if not w.wait(timedelta(seconds=60)):
            raise AssertionError("work.wait(timeout) returned False")
    for i, f in enumerate(futs):
        f.wait()
        if not f.done():
            raise AssertionError(f"future {i} not done after wait")
    if ctx.device.type != "cpu":  # on a device, wait() orders the caller's stream, not the host
        getattr(torch, ctx.device.type).synchronize()
    for w in works:
        if not w.is_completed():
            raise AssertionError("work.is_completed() is False after wait")
    ctx.corrupt(a)
    _check(ctx, "async all_reduce float32", a, exp_a, "float32", _scale(ctx, "float32", (4099,), "SUM"))
    _check(ctx, "async all_reduce int64 MAX", b, exp_b, "int64", exact=True)
    _check(ctx, "async broadcast bfloat16", c, src_c, "bfloat16", exact=True)
    # a callback chained on the future sees the result
    t = ctx.make("float32", (10,))
    exp = _ref_allreduce(ctx, t, "SUM")
    fut = dist.all_reduce(t, group=ctx.dut, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    _check(ctx, "future.then() value", fut.wait(), exp * 2, "float32", 2 * _scale(ctx, "float32", (10,), "SUM"))


def _stream_order_case(ctx: Ctx) -> None:
    """Fake-device ranks: an async op's result is ordered on the caller's stream, not the host.

    The fake accelerator runs each stream on its own thread: until the caller
    waits, neither the host nor another stream sees the result (the missing
    wait gives a wrong answer); after ``work.wait()`` the caller's stream does,
    a stream that waits for it does, and so does the work's future.
    """
    x = ctx.make("float32", (4096,))
    expected = _ref_allreduce(ctx, x, "SUM")
    scale = _scale(ctx, "float32", (4096,), "SUM")
    if ctx.device.type == "cpu":  # a CPU rank only takes part
        dist.all_reduce(x.clone(), group=ctx.dut)
        return
    from kaitian.testing import fake_accelerator

    mod = getattr(torch, ctx.device.type)
    t = torch.zeros_like(x)
    side = mod.Stream()
    t * 1  # warm the op up: a first call may import more of torch than the delay lasts
    mod.synchronize()
    fake_accelerator.sleep(1.0)  # longer than the host needs to reach the checks, even under load
    t.copy_(x)  # lands after the delay, and so does the op's result
    work = dist.all_reduce(t, group=ctx.dut, async_op=True)
    done_early = work.is_completed()
    early_host = fake_accelerator.host_alias(t).clone()
    with mod.stream(side):
        early = t * 1  # no wait: reads t as it is now
    work.wait()
    side.wait_stream(mod.current_stream())
    with mod.stream(side):
        late = t * 1
    from_future = work.get_future().wait()[0]
    side.synchronize()
    mod.synchronize()
    if done_early or not work.is_completed():
        raise AssertionError(f"work.is_completed() was {done_early} before its stream got there and "
                             f"{work.is_completed()} after synchronize()")
    if torch.equal(early_host, expected) or torch.equal(early.cpu(), expected):
        raise AssertionError("a read without work.wait() saw the result: the missing wait went unpunished")
    ctx.corrupt(t)
    _check(ctx, "after work.wait(), on the caller's stream", t, expected, "float32", scale)
    _check(ctx, "after work.wait(), on a stream that waits for the caller's", late, expected, "float32", scale)
    _check(ctx, "the work's future", from_future, expected, "float32", scale)


def _subgroup_case(kind: str):
    """Collectives on ``dist.new_group`` subgroups of the backend under test."""

    def fn(ctx: Ctx) -> None:
        w = ctx.world
        if kind == "cross":  # first and last rank: spans groups when there are several
            ranks = sorted({0, w - 1})
        else:  # all ranks of rank 0's group
            ranks = [r for r in range(w) if ctx.groups[r] == ctx.groups[0]]
        sub = ctx.subgroups[kind]
        ref_sub = ctx.ref_subgroups[kind]
        if ctx.rank not in ranks:
            return
        x = ctx.make("float32", (300,))
        t = x.clone()
        dist.all_reduce(t, group=sub)
        e = x.cpu()
        dist.all_reduce(e, group=ref_sub)
        ctx.corrupt(t)
        _check(ctx, f"subgroup {ranks} all_reduce", t, e, "float32", _scale(ctx, "float32", (300,), "SUM"))
        out = [torch.empty(5, dtype=torch.int64, device=ctx.device) for _ in ranks]
        dist.all_gather(out, torch.full((5,), ctx.rank, dtype=torch.int64, device=ctx.device), group=sub)
        for i, r in enumerate(ranks):
            _check(ctx, f"subgroup {ranks} all_gather block {i}", out[i], torch.full((5,), r, dtype=torch.int64),
                   "int64", exact=True)
        b = torch.full((9,), float(ctx.rank), device=ctx.device)
        dist.broadcast(b, ranks[-1], group=sub)
        _check(ctx, f"subgroup {ranks} broadcast from {ranks[-1]}", b, torch.full((9,), float(ranks[-1])),
               "float32", exact=True)

    return fn


def build_cases(world: int, fake_device: bool = False) -> List[Case]:
    """The matrix for a world of ``world`` ranks, in execution order (``fake_device``:
    some ranks are on the fake accelerator)."""
    cases: List[Case] = []

    def add(name: str, fn, core: bool = False) -> None:
        cases.append(Case(name, fn, core))

    core_dtypes = ("float32", "bfloat16", "int32")
    for dtype in ALL_DTYPES:
        for op in _ops_for(dtype):
            add(f"all_reduce-{op}-{dtype}", _allreduce_case(dtype, op), core=dtype in core_dtypes)
    add("all_reduce-SUM-float32-large", _allreduce_case("float32", "SUM", (1_000_003,)), core=True)
    add("all_reduce-SUM-bfloat16-large", _allreduce_case("bfloat16", "SUM", (600_001,)), core=True)
    add("all_reduce-AVG-float16-large", _allreduce_case("float16", "AVG", (300_007,)))
    add("all_reduce-MAX-int64-large", _allreduce_case("int64", "MAX", (200_003,)))
    add("all_reduce-SUM-float32-one", _allreduce_case("float32", "SUM", (1,)), core=True)
    for dtype, op in (("float32", "SUM"), ("float32", "MAX"), ("int32", "SUM"), ("bfloat16", "SUM"),
                      ("float64", "AVG"), ("float32", "PREMUL_SUM"), ("uint8", "BOR")):
        add(f"all_reduce-{op}-{dtype}-noncontig", _allreduce_case(dtype, op, (8, 129), noncontig=True),
            core=dtype == "float32" and op == "SUM")
    add("all_reduce-SUM-float32-zero", _allreduce_case("float32", "SUM", (0,)), core=True)
    add("all_reduce-MAX-int64-zero", _allreduce_case("int64", "MAX", (0, 3)))
    add("all_reduce-SUM-float32-async", _allreduce_case("float32", "SUM", async_op=True), core=True)
    add("all_reduce-AVG-bfloat16-async", _allreduce_case("bfloat16", "AVG", async_op=True))
    for dtype, op in (("float32", "SUM"), ("float64", "MAX"), ("int64", "SUM"), ("bfloat16", "SUM"),
                      ("float32", "AVG"), ("int32", "BXOR")):
        for via in ("api", "manager"):
            add(f"all_reduce_coalesced-{op}-{dtype}-{via}", _allreduce_coalesced_case(dtype, op, via),
                core=dtype == "float32" and op == "SUM")

    for dtype in ALL_DTYPES:
        add(f"broadcast-{dtype}", _broadcast_case(dtype, -1), core=dtype in core_dtypes)
    for src in range(world):
        add(f"broadcast-float32-src{src}", _broadcast_case("float32", src), core=True)
    add("broadcast-float32-large", _broadcast_case("float32", 0, (1_000_003,)), core=True)
    add("broadcast-float32-noncontig", _broadcast_case("float32", -1, (8, 65), noncontig=True), core=True)
    add("broadcast-int8-noncontig", _broadcast_case("int8", 0, (8, 65), noncontig=True))
    add("broadcast-float32-zero", _broadcast_case("float32", 0, (0,)))
    add("broadcast-int64-async", _broadcast_case("int64", -1, async_op=True))

    for dtype in ALL_DTYPES:
        add(f"reduce-SUM-{dtype}", _reduce_case(dtype, "SUM", -1), core=dtype in core_dtypes)
    for dst in range(world):
        add(f"reduce-SUM-float32-dst{dst}", _reduce_case("float32", "SUM", dst), core=True)
    for dtype, op in (("int32", "MAX"), ("float64", "PRODUCT"), ("int64", "BAND"), ("float32", "MIN"),
                      ("bfloat16", "MAX"), ("float32", "AVG"), ("float64", "PREMUL_SUM")):
        add(f"reduce-{op}-{dtype}", _reduce_case(dtype, op, 0))
    add("reduce-SUM-float32-noncontig", _reduce_case("float32", "SUM", 0, (8, 33), noncontig=True))
    add("reduce-SUM-float32-zero", _reduce_case("float32", "SUM", 0, (0,)))

    for dtype in ALL_DTYPES:
        add(f"all_gather-{dtype}", _allgather_case(dtype, "list"), core=dtype in core_dtypes)
        add(f"all_gather_into_tensor-{dtype}", _allgather_case(dtype, "into_tensor"), core=dtype in core_dtypes)
    for dtype in ("float32", "int64", "bfloat16"):
        add(f"all_gather_into_tensor_coalesced-{dtype}", _allgather_case(dtype, "into_tensor_coalesced"),
            core=dtype == "float32")
        add(f"all_gather_coalesced-{dtype}", _allgather_case(dtype, "coalesced"))
    add("all_gather-float32-noncontig", _allgather_case("float32", "noncontig", (6, 17)), core=True)
    add("all_gather-float32-zero", _allgather_case("float32", "list", (0,)))
    add("all_gather_into_tensor-float32-zero", _allgather_case("float32", "into_tensor", (0,)))
    add("all_gather-float32-large", _allgather_case("float32", "list", (300_007,)), core=True)
    add("all_gather-float64-async", _allgather_case("float64", "list", async_op=True), core=True)

    for dtype in ALL_DTYPES:
        add(f"gather-{dtype}", _gather_case(dtype, -1), core=dtype in core_dtypes)
        add(f"scatter-{dtype}", _scatter_case(dtype, -1), core=dtype in core_dtypes)
    for r in range(world):
        add(f"gather-float32-dst{r}", _gather_case("float32", r), core=True)
        add(f"scatter-float32-src{r}", _scatter_case("float32", r), core=True)

    for dtype in FLOATS + INTS:
        for op in ("SUM", "MAX"):
            add(f"reduce_scatter_tensor-{op}-{dtype}", _reduce_scatter_case(dtype, op, "tensor"),
                core=dtype in core_dtypes)
            add(f"reduce_scatter-{op}-{dtype}", _reduce_scatter_case(dtype, op, "list"),
                core=dtype in core_dtypes and op == "SUM")
    for dtype, op in (("float32", "AVG"), ("float64", "PRODUCT"), ("int32", "MIN"), ("int64", "BOR"),
                      ("bfloat16", "AVG"), ("float32", "PREMUL_SUM"), ("bool", "MAX")):
        add(f"reduce_scatter_tensor-{op}-{dtype}", _reduce_scatter_case(dtype, op, "tensor"))
    for dtype in ("float32", "bfloat16", "int64"):
        add(f"reduce_scatter_tensor_coalesced-SUM-{dtype}", _reduce_scatter_case(dtype, "SUM", "tensor_coalesced"),
            core=dtype == "float32")
    add("reduce_scatter_tensor-SUM-float32-large", _reduce_scatter_case("float32", "SUM", "tensor", 200_003),
        core=True)
    add("reduce_scatter_tensor-SUM-float32-zero", _reduce_scatter_case("float32", "SUM", "zero"))

    for dtype in ALL_DTYPES:
        add(f"all_to_all-{dtype}", _alltoall_case(dtype, "list"), core=dtype in core_dtypes)
        add(f"all_to_all_single-uneven-{dtype}", _alltoall_case(dtype, "single_uneven"), core=dtype in core_dtypes)
    add("all_to_all-uneven-float32", _alltoall_case("float32", "list_uneven"), core=True)
    add("all_to_all-uneven-int8", _alltoall_case("int8", "list_uneven"))
    for dtype in ("float32", "int64"):
        add(f"all_to_all_single-even-{dtype}", _alltoall_case(dtype, "single_even"), core=True)
        add(f"all_to_all_single-zero-{dtype}", _alltoall_case(dtype, "single_zero"))

    add("barrier", _barrier_case, core=True)
    add("barrier-again", _barrier_case)
    if world > 1:
        for dtype in ("float32", "bfloat16", "int64", "uint8", "bool"):
            add(f"send_recv-{dtype}", _sendrecv_case(dtype, "blocking"), core=dtype == "float32")
        for dtype in ("float32", "int32"):
            add(f"isend_irecv-{dtype}", _sendrecv_case(dtype, "async"), core=dtype == "float32")
            add(f"batch_isend_irecv-{dtype}", _sendrecv_case(dtype, "batch"), core=dtype == "float32")
        add("recv_anysource-float32", _sendrecv_case("float32", "anysource"), core=True)
    add("async-mixed-in-flight", _async_mix_case, core=True)
    if fake_device:
        add("stream-order", _stream_order_case, core=True)
    add("subgroup-cross", _subgroup_case("cross"), core=True)
    add("subgroup-same-group", _subgroup_case("same"))

    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    return cases


def case_names(world: int, core_only: bool = False, fake_device: bool = False) -> List[str]:
    """Names of the cases run for a world of ``world`` ranks."""
    return [c.name for c in build_cases(world, fake_device) if c.core or not core_only]
