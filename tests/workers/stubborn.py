"""Ignores SIGINT and SIGTERM, records its pid, sleeps: only SIGKILL stops it."""
import os
import signal
import sys
import time

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(sys.argv[1], f"pid.{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
