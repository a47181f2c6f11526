"""Records its pid in OUT_DIR/pid.<RANK> and sleeps (for signal and cleanup tests).

With ``KT_TERM_HANDLER=1`` it exits from a SIGTERM handler, as training scripts
that checkpoint on SIGTERM do (a handled signal waits while the process is stopped).
"""
import os
import signal
import sys
import time

if os.environ.get("KT_TERM_HANDLER") == "1":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

with open(os.path.join(sys.argv[1], f"pid.{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
