"""Writes this worker's environment (plus its CPU affinity) to OUT_DIR/env.<RANK>.json."""
import json
import os
import sys
import time

env = dict(os.environ)
# The agent pins a worker right after starting it: read the mask once that has
# happened (a worker importing torch is never faster than this).
time.sleep(0.5)
env["_AFFINITY"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
run_dir = env.get("KAITIAN_RUN_DIR")
if run_dir:
    env["_RUN_DIR_MODE"] = oct(os.stat(run_dir).st_mode & 0o777)
with open(os.path.join(sys.argv[1], f"env.{os.environ['RANK']}.json"), "w") as f:
    json.dump(env, f)
print("dumped", os.environ["RANK"])
