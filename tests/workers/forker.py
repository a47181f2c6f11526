"""Forks a child that records its pid in OUT_DIR/child.<RANK> and sleeps, then exits 0
(a data-loader or helper process the script forgot to join)."""
import os
import sys
import time

if os.fork() == 0:
    with open(os.path.join(sys.argv[1], f"child.{os.environ['RANK']}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    os._exit(0)
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(sys.argv[1], f"child.{os.environ['RANK']}")) and time.monotonic() < deadline:
    time.sleep(0.05)
