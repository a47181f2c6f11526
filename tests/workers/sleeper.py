"""Records its pid in OUT_DIR/pid.<RANK> and sleeps (for signal and cleanup tests)."""
import os
import sys
import time

with open(os.path.join(sys.argv[1], f"pid.{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
