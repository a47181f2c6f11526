"""``kaitian bench …``: commands that print numbers, kaitian beside its baseline in one run.

Convention: a benchmark's per-rank worker is the benchmark's own module run with
``--worker`` under torchrun's environment (started by kaitianrun, torchrun, or
the module's local rank spawner), so a bench is one file.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["BenchParser"]


class BenchParser(argparse.ArgumentParser):
    """A benchmark's flags: a bad one is one line on stderr and exit 2, before anything starts."""

    def error(self, message: str):  # type: ignore[override]
        print(f"{self.prog}: {message} (see --help)", file=sys.stderr)
        sys.exit(2)
