"""``kaitianrun`` under a docker engine that answers the agent slowly: every
exec inspection the agent's main thread makes (its monitoring) takes
``SLOW_ENGINE_S`` seconds, and creates the file ``SLOW_ENGINE_MARKER`` first, so
that a test can signal the agent while it waits on the engine.

Run as ``python -m support.slow_engine KAITIANRUN-ARGS...``.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time

from docker.api.exec_api import ExecApiMixin


def main() -> None:
    marker, seconds = os.environ["SLOW_ENGINE_MARKER"], float(os.environ.get("SLOW_ENGINE_S", "3"))
    inspect = ExecApiMixin.exec_inspect

    def slow_inspect(self, exec_id):
        if threading.current_thread() is threading.main_thread():
            open(marker, "a").close()
            time.sleep(seconds)
        return inspect(self, exec_id)

    ExecApiMixin.exec_inspect = slow_inspect
    sys.argv[0] = "kaitianrun"
    runpy.run_module("kaitian.launcher.cli", run_name="__main__")


if __name__ == "__main__":
    main()
