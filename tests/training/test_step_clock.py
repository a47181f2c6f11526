"""kaitian.training.clock.StepClock: host clock on CPU, device events elsewhere (a stand-in
module here; on the fake accelerator in tests/testing/test_device_path.py)."""

import time
import types

import torch

from kaitian.training.clock import StepClock


def test_cpu_marks_measure_host_time():
    clock = StepClock(torch.device("cpu"))
    assert not clock.on_device
    clock.mark("start")
    time.sleep(0.02)
    clock.mark("compute_end")
    time.sleep(0.01)
    clock.mark("end")
    [(step, t)] = clock.finish("step 0")  # known at once
    assert step == "step 0"
    assert 0.015 < t["compute_s"] < 0.5 and 0.005 < t["comm_s"] < 0.5
    assert clock.finish("step 1") == [("step 1", {"compute_s": 0.0, "comm_s": 0.0})]  # marks are cleared


class _FakeEvent:
    """Records when the fake device reached it (device time), like torch.cuda.Event."""

    device_time = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None
        self.synchronized = False

    def record(self, stream=None):
        self.at = _FakeEvent.device_time
        self.stream = stream

    def synchronize(self):
        self.synchronized = True

    def elapsed_time(self, other):  # milliseconds, as torch's events
        return (other.at - self.at) * 1000.0


def _fake_module(monkeypatch):
    module = types.SimpleNamespace(Event=_FakeEvent, current_stream=lambda device: ("stream of", device))
    monkeypatch.setattr(torch, "ktfake", module, raising=False)


def _step(clock, start, compute, comm):
    _FakeEvent.device_time = start
    clock.mark("start")
    _FakeEvent.device_time = start + compute
    clock.mark("compute_end")
    _FakeEvent.device_time = start + compute + comm
    clock.mark("end")
    return clock._marks["end"]


def test_device_events_time_device_work_a_step_late(monkeypatch):
    _fake_module(monkeypatch)
    clock = StepClock(types.SimpleNamespace(type="ktfake"))
    assert clock.on_device
    # the device finished forward + backward 0.3 s after the start, the allreduce 0.05 s later
    end = _step(clock, 1.0, 0.3, 0.05)
    assert clock.finish("step 0") == [] and not end.synchronized  # no wait for the device now
    _step(clock, 2.0, 0.2, 0.1)
    [(step, t)] = clock.finish("step 1")  # step 0's events are a step old: read now
    assert step == "step 0" and end.synchronized
    assert abs(t["compute_s"] - 0.3) < 1e-9 and abs(t["comm_s"] - 0.05) < 1e-9
    [(step, t)] = clock.flush()
    assert step == "step 1" and abs(t["compute_s"] - 0.2) < 1e-9 and abs(t["comm_s"] - 0.1) < 1e-9
    assert clock.flush() == []


def test_events_are_recorded_on_the_ranks_device_and_stream(monkeypatch):
    # a bare Event.record() records on the *current* device's stream (cuda:0
    # unless set), not on the rank's (issue 16)
    _fake_module(monkeypatch)
    device = types.SimpleNamespace(type="ktfake", index=3)
    clock = StepClock(device)
    clock.mark("start")
    assert clock._marks["start"].stream == ("stream of", device)
