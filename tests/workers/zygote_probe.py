"""Reports what a started process sees of itself (tests/unit/test_zygote.py).

Usage: zygote_probe.py OUT MODE; MODE exit3 ends with SystemExit(3), raise with
an uncaught exception, killed by SIGKILL (what it printed must be in its log),
hang sleeps until it is killed (SIGUSR1 dumps its stack).
Writes JSON to OUT, then OUT.atexit from an atexit handler.
"""
import atexit
import faulthandler
import json
import os
import signal
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
atexit.register(lambda: open(out + ".atexit", "w").close())
report = {
    "argv": sys.argv,
    "name": __name__,
    "file": __file__,
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "path": sys.path[:sys.path.index(os.path.dirname(os.__file__))],
    "own_session": os.getsid(0) == os.getpid(),
    "stdin": sys.stdin.read(),
    "threads": len(os.listdir("/proc/self/task")),
    "kaitian_imported": any(m == "kaitian" or m.startswith("kaitian.") for m in sys.modules),
    "dont_write_bytecode": sys.dont_write_bytecode,
}
with open(out, "w") as fh:
    json.dump(report, fh)
print("to stdout")
print("to stderr", file=sys.stderr)
if mode == "raise":
    raise ValueError("the probe raised")
if mode == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "hang":  # as the rank workers do: SIGUSR1 dumps the stacks
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    time.sleep(600)
sys.exit(3)
