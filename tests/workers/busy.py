"""Spins for WALL seconds; writes what it observed to OUT_DIR/cpu.<RANK>.json.

Recorded: the CPU time it got, how often its loop was held up for more than
10 ms (a SIGSTOP duty cycle shows as many such gaps), and, when it runs in a
cgroup-v1 cpu cgroup, that cgroup's quota, period and throttling counter.
"""
import json
import os
import sys
import time

out, wall = sys.argv[1], float(sys.argv[2])
start_cpu, start = time.process_time(), time.monotonic()
last, gaps = start, 0
while True:
    now = time.monotonic()
    if now - last > 0.01:
        gaps += 1
    last = now
    if now - start >= wall:
        break
result = {"cpu": time.process_time() - start_cpu, "wall": time.monotonic() - start, "gaps": gaps}
with open("/proc/self/cgroup") as f:
    for line in f:
        _, controllers, path = line.strip().split(":", 2)
        if "cpu" in controllers.split(",") and path.startswith("/kaitian/"):
            base = "/sys/fs/cgroup/cpu" + path
            result["cgroup"] = path
            result["quota_us"] = int(open(base + "/cpu.cfs_quota_us").read())
            result["period_us"] = int(open(base + "/cpu.cfs_period_us").read())
            stat = dict(line.split() for line in open(base + "/cpu.stat"))
            result["nr_throttled"] = int(stat["nr_throttled"])
with open(os.path.join(out, f"cpu.{os.environ['RANK']}.json"), "w") as f:
    json.dump(result, f)
