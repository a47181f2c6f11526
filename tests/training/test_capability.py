"""`kaitian init` writes a config that load_capabilities reads; the monitor writes its report."""

import json
import os
import subprocess
import sys
import time

import pytest

from kaitian.training.capability import CapabilityConfigError, load_capabilities
from kaitian.monitor.agent import AgentMonitor
from kaitian.monitor.records import StepRecorder
from kaitian.training.ddp import StepTiming

from support import REPO as ROOT


def _kaitian(*args, env_extra=None, timeout=120):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "kaitian", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_init_writes_config_and_refresh_remeasures(tmp_path):
    cfg = tmp_path / "cfg" / "config.toml"
    first = _kaitian("init", "--cpu-slots", "2", "--seconds", "0.2", "--config", str(cfg))
    assert first.returncode == 0, first.stderr
    assert "[2/2] cpu:1" in first.stdout and "samples/s" in first.stdout
    caps = load_capabilities(str(cfg))
    assert set(caps) == {"cpu:0", "cpu:1"} and all(v > 10 for v in caps.values())
    assert oct(cfg.stat().st_mode & 0o777) == "0o600"
    text = cfg.read_text()
    assert "cpus = [" in text and 'name = "mlp-512-1024-1024-10"' in text

    again = _kaitian("init", "--config", str(cfg))
    assert again.returncode == 0 and "already initialised" in again.stdout
    assert cfg.read_text() == text  # not measured again without -r

    refreshed = _kaitian("init", "-r", "--cpu-slots", "1", "--seconds", "0.2", "--config", str(cfg))
    assert refreshed.returncode == 0, refreshed.stderr
    new_caps = load_capabilities(str(cfg))
    assert new_caps["cpu:0"] != caps["cpu:0"]  # measured again (a 2-core slot now)
    assert "cpu:1" in new_caps  # entries not measured this time are kept

    # the launcher's inventory shows the measured capability
    devices = _kaitian("devices", "--cpu-slots", "1", env_extra={"KAITIAN_CONFIG": str(cfg)})
    assert devices.returncode == 0 and "/s" in devices.stdout


def test_bad_config_and_bad_arguments_are_one_line_errors(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("devices = [not toml\n")
    with pytest.raises(CapabilityConfigError, match="kaitian init -r"):
        load_capabilities(str(cfg))
    broken = _kaitian("init", "--config", str(cfg))
    assert broken.returncode == 2 and broken.stderr.count("\n") == 1
    assert "kaitian init -r" in broken.stderr
    bad = _kaitian("init", "--devices", "cpu:7", "--config", str(tmp_path / "x.toml"))
    assert bad.returncode == 2 and bad.stderr.startswith("kaitian init:")
    assert not (tmp_path / "x.toml").exists()
    for seconds in ("nan", "inf", "0"):  # nan measured nothing and wrote 0 samples/s; inf never ended
        bad = _kaitian("init", "--seconds", seconds, "--config", str(tmp_path / "x.toml"))
        assert bad.returncode == 2
        assert bad.stderr == f"kaitian init: --seconds must be a positive number, got {seconds}\n"
        assert not (tmp_path / "x.toml").exists()
    assert load_capabilities(str(tmp_path / "missing.toml")) == {}


def test_monitor_writes_plot_and_summary(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        mon = AgentMonitor(str(tmp_path), interval=0.1)
        mon.start()
        mon.watch({0: busy.pid, 1: os.getpid()}, {0: "cpu:0", 1: "cpu:1"})
        for rank in (0, 1):
            rec = StepRecorder(str(tmp_path / f"rank-{rank}.jsonl"), rank,
                               {"device": f"cpu:{rank}", "group": f"cpu{rank}"})
            for step in range(5):
                rec.record_step(StepTiming(step=step, samples=32 * (rank + 1), global_samples=96,
                                           compute_s=0.01, comm_s=0.005, step_s=0.02,
                                           end=time.time() + step * 0.02))
            rec.flush()
        time.sleep(0.8)
        mon.stop()
        table = mon.report()
    finally:
        busy.kill()
        busy.wait()
    assert (tmp_path / "monitor.png").stat().st_size > 1000
    assert (tmp_path / "summary.txt").read_text().strip() == table.strip()
    lines = table.splitlines()
    row0 = lines[1].split()
    assert row0[:5] == ["0", "cpu:0", "cpu0", "5", "160"]
    assert float(row0[6]) == pytest.approx(1600.0)  # 32 samples per 20 ms
    assert float(row0[12]) > 5  # the busy loop's CPU share was sampled
    assert "job throughput: 4800.0 samples/s" in table
    util = [json.loads(l) for l in (tmp_path / "utilisation.jsonl").read_text().splitlines()]
    assert {u["rank"] for u in util} == {0, 1}
