"""kaitian.training.clock.StepClock: host clock on CPU, device events elsewhere (faked here: no GPU in CI)."""

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
    t = clock.take()
    assert 0.015 < t["compute_s"] < 0.5 and 0.005 < t["comm_s"] < 0.5
    assert clock.take() == {"compute_s": 0.0, "comm_s": 0.0}  # marks are cleared


class _FakeEvent:
    """Records when the fake device reached it (device time), like torch.cuda.Event."""

    device_time = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None
        self.synchronized = False

    def record(self):
        self.at = _FakeEvent.device_time

    def synchronize(self):
        self.synchronized = True

    def elapsed_time(self, other):  # milliseconds, as torch's events
        return (other.at - self.at) * 1000.0


def test_device_events_time_device_work_not_host_time(monkeypatch):
    monkeypatch.setattr(torch, "ktfake", types.SimpleNamespace(Event=_FakeEvent), raising=False)
    clock = StepClock(types.SimpleNamespace(type="ktfake"))
    assert clock.on_device
    _FakeEvent.device_time = 1.0
    clock.mark("start")
    _FakeEvent.device_time = 1.3  # the device finished forward + backward 0.3 s later ...
    clock.mark("compute_end")
    _FakeEvent.device_time = 1.35  # ... and the allreduce 0.05 s after that
    clock.mark("end")
    end = clock._marks["end"]
    t = clock.take()
    assert abs(t["compute_s"] - 0.3) < 1e-9 and abs(t["comm_s"] - 0.05) < 1e-9
    assert end.synchronized  # read only after the step's last event completed
