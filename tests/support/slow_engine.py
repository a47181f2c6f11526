"""``kaitianrun`` under a docker engine that answers the agent late: every
``SLOW_ENGINE_CALL`` (an Engine API client method: ``create_container``,
``exec_inspect``) the agent's main thread makes is done, and its
answer arrives ``SLOW_ENGINE_S`` seconds later; the file ``SLOW_ENGINE_MARKER``
appears when the call is done, so that a test can signal the agent while it
waits for the answer.

Run as ``python -m support.slow_engine KAITIANRUN-ARGS...``.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time

from docker.api.client import APIClient


def main() -> None:
    name, marker = os.environ["SLOW_ENGINE_CALL"], os.environ["SLOW_ENGINE_MARKER"]
    seconds = float(os.environ.get("SLOW_ENGINE_S", "3"))
    call = getattr(APIClient, name)

    def slow_call(self, *args, **kwargs):
        answer = call(self, *args, **kwargs)
        if threading.current_thread() is threading.main_thread():
            open(marker, "a").close()
            time.sleep(seconds)
        return answer

    setattr(APIClient, name, slow_call)
    sys.argv[0] = "kaitianrun"
    runpy.run_module("kaitian.launcher.cli", run_name="__main__")


if __name__ == "__main__":
    main()
