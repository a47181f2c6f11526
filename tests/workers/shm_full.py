"""Builds a 2-rank shm bridge (one thread per rank) in a /dev/shm with only a few
MiB left; run it in a private tmpfs (tests/backend/test_shm_full.py). Prints each
rank's error and the kaitian segments left, as JSON."""
import json
import os

from support.bridge_pair import build_pair

meet = os.path.join(os.environ["KT_WORKDIR"], "meet")
free = os.statvfs("/dev/shm")
with open("/dev/shm/filler", "wb") as f:  # leave about 4 MiB
    f.write(b"\0" * (free.f_bavail * free.f_frsize - (4 << 20)))

built = build_pair(meet, "f011f011", chunk_bytes=1 << 20)
errors = {r: str(b) if isinstance(b, Exception) else None for r, b in built.items()}
for b in built.values():
    if not isinstance(b, Exception):
        b.kaitian_shutdown()
os.unlink("/dev/shm/filler")
print(json.dumps({"errors": errors, "left": [n for n in os.listdir("/dev/shm") if n.startswith("kaitian-")]}))
