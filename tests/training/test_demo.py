"""The main job end to end: examples/train_digits.py under kaitianrun, as the demo runs it.

Two simulated vendor groups (cpu1 limited to a third of a core), backend
kaitian, re-balancing on, ``--monitor``: the job must reach the accuracy, print
each group's batch, throughput and speed (cpu1's slower from the first epoch;
or that a group is benched, when the step-cost model finds that it does not pay
on this machine), and leave the monitor's plot and summary, of this run only.
"""

import json
import os
import re
import subprocess
import sys

from kaitian.training.capability import write_config

from support import REPO as ROOT


def test_digits_demo_trains_to_accuracy_with_monitor(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # a `kaitian init` config: kaitianrun hands each rank its KAITIAN_CAPABILITY,
    # and the sampler starts from the 3:1 capability split
    config = tmp_path / "config.toml"
    write_config({"version": 1, "devices": {
        "cpu:0": {"vendor": "cpu", "index": 0, "name": "slot 0", "capability": 3000.0},
        "cpu:1": {"vendor": "cpu", "index": 1, "name": "slot 1", "capability": 1000.0},
    }}, str(config))
    env["KAITIAN_CONFIG"] = str(config)
    monitor = tmp_path / "monitor"
    monitor.mkdir()
    (monitor / "rank-0.jsonl").write_text('{"rank": 0, "step": 0, "samples": 64}\n')  # an earlier run's
    cmd = [sys.executable, "-m", "kaitian.launcher.cli", "--nproc-auto", "--cpu-slots", "2",
           "--cpu-groups", "2", "--cpu-quota", "1,0.33", "--monitor", str(monitor),
           os.path.join(ROOT, "examples", "train_digits.py"), "--epochs", "12",
           "--batch-size", "64", "--min-accuracy", "0.95"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # either group may be benched (on a busy machine the model may find cpu0 the slower); never both
    epochs = re.findall(r"epoch +(\d+) .*cpu0: batch +(\d+|benched) .*cpu1: batch +(\d+|benched) "
                        r".*total +(\d+) samples/s", out)
    assert len(epochs) == 12, out[-3000:]
    batch = lambda b: 0 if b == "benched" else int(b)  # noqa: E731
    assert all(batch(a) + batch(b) == 128 for _, a, b, _ in epochs)  # global batch kept
    # each group's own speed, cpu1's slower from the first epoch on (in lock-step their throughputs are alike)
    speeds = re.search(r"epoch +1 .*cpu0: .*\(speed +(\d+)/s\) .*cpu1: .*\(speed +(\d+)/s\)", out)
    assert speeds and int(speeds.group(2)) < int(speeds.group(1)), out[-3000:]
    assert (monitor / "previous" / "rank-0.jsonl").exists()  # set aside, not counted below
    records = [json.loads(line) for line in (monitor / "rank-0.jsonl").read_text().splitlines()]
    first = next(r for r in records if r.get("kind", "step") == "step")
    assert first["samples"] == 96  # the first step: the capability split from the config (3:1)
    accuracy = float(re.search(r"final test accuracy: ([\d.]+)", out).group(1))
    assert accuracy >= 0.95
    assert (monitor / "monitor.png").stat().st_size > 1000
    summary = (monitor / "summary.txt").read_text()
    rows = [l.split() for l in summary.splitlines()[1:3]]
    assert [r[2] for r in rows] == ["cpu0", "cpu1"]
    for group, row in enumerate(rows):  # steps recorded: every one, or until the group was benched
        benched = [e[1 + group] == "benched" for e in epochs]
        assert (row[5] == "benched") == benched[-1], (summary, out[-3000:])
        assert (int(row[3]) < 12 * 12) == any(benched), summary
    assert "job throughput" in summary and "vs an equal split: " in summary
