"""``kaitian images build``: build the vendor container images."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from kaitian.errors import KaitianError
from kaitian.images import TARGETS, build

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kaitian images build",
        description="Build kaitian's container images (for kaitianrun --runtime docker).",
    )
    p.add_argument(
        "targets", nargs="*", metavar="IMAGE", default=None,
        help=f"images to build: {', '.join(TARGETS)} (default: cpu-host). "
             "cpu-host runs this host's Python and needs no registry.",
    )
    p.add_argument("-t", "--tag", help="image name (one target only; default kaitian:<vendor>)")
    p.add_argument("--base", help="base image for the Dockerfile's BASE argument")
    p.add_argument("--no-cache", action="store_true", help="do not use docker's build cache")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kaitian images build [IMAGE ...] [-t TAG] [--base IMAGE] [--no-cache]``."""
    args = _parser().parse_args(list(argv or []))
    targets = args.targets or ["cpu-host"]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        print(f"kaitian images build: unknown image {unknown[0]!r}; choose from: {', '.join(TARGETS)}",
              file=sys.stderr)
        return 2
    if args.tag and len(targets) > 1:
        print("kaitian images build: --tag needs exactly one image", file=sys.stderr)
        return 2
    try:
        for target in targets:
            build(target, tag=args.tag, base=args.base, no_cache=args.no_cache)
    except KaitianError as exc:
        print(f"kaitian images build: {exc}", file=sys.stderr)
        return 1
    return 0

