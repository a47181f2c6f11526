"""One rank of the collective matrix (cases in ``support/collective_cases.py``).

Initialises the group under test (``--backend``, normally ``kaitian``) and a
gloo group over the same ranks, runs every case on this rank's device
(``kaitian.device()``: a fake MLU with ``KAITIAN_FAKE_ACCELERATOR``, else the
CPU) and writes one JSON line per case to ``KT_OUT`` (flushed as it goes, so a
hang still names its case).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Optional, Sequence

from support import collective_cases
from support.collective_cases import Ctx, build_cases, case_names
from support.worker_env import rank_env

torch = dist = None  # imported in _run: --list stays cheap


def _run(args: argparse.Namespace) -> int:
    # The test driver sends SIGUSR1 before killing a hung rank: dump the stacks.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    global torch, dist
    collective_cases._import_torch()
    torch, dist = collective_cases.torch, collective_cases.dist
    torch.set_num_threads(1)
    me = rank_env()
    groups = me.groups
    import kaitian  # registers the backend; installs the fake MLUs of KAITIAN_FAKE_ACCELERATOR

    device = kaitian.set_device()
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(args.backend, timeout=timeout)
    # The reference group outlasts the group under test, so that after a case
    # that failed on some ranks only, the others' timeout still re-aligns them.
    ref_timeout = timeout * 3
    ctx = Ctx(me.rank, me.world_size, groups, None, dist.new_group(backend="gloo", timeout=ref_timeout),
              args.fault, device)
    # Subgroups must be created by every rank, in the same order.
    w = me.world_size
    cross = sorted({0, w - 1})
    same = [r for r in range(w) if groups[r] == groups[0]]
    # one subgroup names the backend explicitly, the other inherits the default
    ctx.subgroups = {"cross": dist.new_group(cross, backend=args.backend), "same": dist.new_group(same)}
    ctx.ref_subgroups = {"cross": dist.new_group(cross, backend="gloo", timeout=ref_timeout),
                         "same": dist.new_group(same, backend="gloo", timeout=ref_timeout)}
    from kaitian.testing import fake_accelerator

    cases = [c for c in build_cases(w, fake_device=fake_accelerator.installed() is not None)
             if c.core or not args.core_only]
    if args.only:
        cases = [c for c in cases if any(o in c.name for o in args.only)]
    cases = [c for c in cases if not any(o in c.name for o in args.skip)]
    with open(me.out, "w") as out:
        # Prove which backend is under test, and which transports it chose.
        backend = dist.get_backend()
        ok = backend == args.backend and device.type == os.environ.get("KAITIAN_DEVICE_TYPE", device.type)
        msg = f"default group backend {backend!r}, expected {args.backend!r}; tensors on {device}"
        if args.backend == "kaitian":
            impl = dist.group.WORLD._get_backend(torch.device("cpu"))
            groups_seen = [impl.group_names()[g] for g in impl.group_of()]
            bridge, flat = impl.bridge_kind(), impl.flat_intra()
            msg += f"; groups {groups_seen}, bridge {bridge}, flat intra {flat}"
            if os.environ.get("KAITIAN_DEVICE_TYPE"):  # the layout's groups were given
                ok = ok and groups_seen == groups
            if os.environ.get("KAITIAN_BRIDGE") == "tcp":
                ok = ok and bridge == "tcp"
            if os.environ.get("KAITIAN_INTRA") == "gloo":
                ok = ok and not flat
            if os.environ.get("KAITIAN_INTRA") == "shm":
                ok = ok and flat
        out.write(json.dumps({"case": "__init__", "ok": ok, "msg": msg}) + "\n")
        out.flush()
        for case in cases:
            ctx.case = case.name
            out.write(json.dumps({"case": case.name, "start": True}) + "\n")
            out.flush()
            t0 = time.perf_counter()
            try:
                case.fn(ctx)
                rec = {"case": case.name, "ok": True, "msg": ""}
            except AssertionError as e:
                rec = {"case": case.name, "ok": False, "msg": str(e)}
            except Exception as e:  # an error raised by the backend is a failure of the case
                rec = {"case": case.name, "ok": False,
                       "msg": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"}
            rec["s"] = round(time.perf_counter() - t0, 4)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            # Re-align the ranks after a failure on some of them (cheap, gloo).
            dist.barrier(group=ctx.ref)
    # Let gloo's worker threads free finished Work (which may need the GIL)
    # before the groups are destroyed: see the note in workers/ddp_parity.py.
    time.sleep(0.3)
    dist.destroy_process_group()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="kaitian")
    ap.add_argument("--world-size", type=int, default=1, help="with --list")
    ap.add_argument("--core-only", action="store_true")
    ap.add_argument("--only", action="append", default=[], help="run cases whose name contains this")
    ap.add_argument("--skip", action="append", default=[], help="skip cases whose name contains this")
    ap.add_argument("--fault", default=None)
    ap.add_argument("--timeout", type=float, default=30.0, help="timeout of the group under test")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(case_names(args.world_size, args.core_only)))
        return 0
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
