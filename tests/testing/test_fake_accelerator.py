"""The fake accelerator punishes missing synchronisation: each check reads with
the wait missing (wrong result) and with the right wait (right result). A gate
(``hold``) holds the producing stream, so the missing wait shows however
loaded the machine is.

Each case runs in its own interpreter: installing the device renames torch's
PrivateUse1 backend for the whole process.
"""

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import torch
from kaitian.testing import fake_accelerator as fa
fa.install("mlu", 2)
"""


def run(body: str, env=None) -> str:
    import os
    # A hang guard, not a bar: the first device op imports torch._dynamo (torch's
    # Python shape functions), which in a fresh venv compiles thousands of modules.
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_ops_and_views_compute_like_cpu():
    out = run("""
        x = torch.arange(12., device="mlu").reshape(3, 4)
        ref = torch.arange(12.).reshape(3, 4)
        for f in (lambda t: t * 2 + 1, lambda t: t.t().contiguous(), lambda t: t[:, 1:3].sum(0),
                  lambda t: t @ t.t(), lambda t: torch.cat([t, t]), lambda t: t[t > 4]):
            assert torch.equal(f(x).cpu(), f(ref)), f
        print(x.device, torch.mlu.device_count())
    """)
    assert out == "mlu:0 2"


def test_non_blocking_d2h_is_stale_until_synchronised():
    out = run("""
        x = torch.ones(1 << 16, device="mlu")
        for wait in (False, True):
            host = torch.zeros(1 << 16, pin_memory=True)
            with fa.hold():
                host.copy_(x, non_blocking=True)  # queued behind the gate
                if not wait:
                    print(wait, host.sum().item())
            if wait:
                e = torch.mlu.Event(); e.record(); e.synchronize()
                print(wait, host.sum().item())
    """)
    assert out.splitlines() == ["False 0.0", f"True {float(1 << 16)}"]


def test_once_python_exits_workers_keep_what_their_tasks_captured():
    """Letting go of a tensor Python also holds takes the GIL, and a worker
    asking a finalizing interpreter for it ends the process in std::terminate
    (seen in CI as an abort at exit). From Python's exit on, a worker keeps what
    a task captured instead: here the pinned tensor a finished copy wrote stays
    alive after Python dropped it."""
    out = run("""
        import gc, weakref
        x = torch.ones(4, device="mlu")
        for exited in (False, True):
            if exited:
                fa._ext().python_exits()  # what atexit calls
            host = torch.zeros(4, pin_memory=True)
            host.copy_(x, non_blocking=True)
            torch.mlu.synchronize()
            alive = weakref.ref(host)
            del host
            gc.collect()
            print(exited, alive() is not None)
    """)
    assert out.splitlines() == ["False False", "True True"]


def test_exits_with_work_still_queued():
    """The streams are not drained at exit: work held behind a gate that opens
    only while the interpreter finalizes (as work waiting for a peer that never
    comes) does not hold the process, as queued GPU work does not."""
    out = run("""
        import time
        class OpensTheGateAtFinalization:
            def __init__(self, gate, host):
                self.gate, self.host = gate, host
            def __del__(self):
                self.gate.release()  # the copy runs now, during finalization
                time.sleep(0.5)
        x = torch.ones(4, device="mlu")
        host = torch.zeros(4, pin_memory=True)
        opener = OpensTheGateAtFinalization(fa.hold(), host)
        host.copy_(x, non_blocking=True)
        print("queued")
    """)
    assert out == "queued"


def test_cross_stream_use_needs_wait_stream():
    out = run("""
        side = torch.mlu.Stream()
        for wait in (False, True):
            x = torch.zeros(1000, device="mlu")
            with fa.hold():
                x.fill_(1.0)                  # queued behind the gate on the current stream
                if wait:
                    side.wait_stream(torch.mlu.current_stream())
                with torch.mlu.stream(side):
                    y = x + x
                if not wait:
                    side.synchronize()        # without the wait, y is done before the fill
            side.synchronize()
            torch.mlu.synchronize()
            print(wait, y.sum().item())
    """)
    assert out.splitlines() == ["False 0.0", "True 2000.0"]


def test_memory_reuse_needs_record_stream():
    out = run("""
        side = torch.mlu.Stream()
        for record in (False, True):
            x = torch.ones(1000, device="mlu")
            side.wait_stream(torch.mlu.current_stream())
            with torch.mlu.stream(side):
                gate = fa.hold()
                y = x + x                     # reads x once the gate opens
            if record:
                x.record_stream(side)
            del x
            z = torch.full((1000,), 7.0, device="mlu")  # may reuse x's block at once
            torch.mlu.current_stream().synchronize()    # the fill ran
            gate.release()
            side.synchronize()
            print(record, y.sum().item())
            torch.mlu.synchronize()
    """)
    assert out.splitlines() == ["False 14000.0", "True 2000.0"]


def test_future_with_devices_orders_the_waiting_stream():
    out = run("""
        side = torch.mlu.Stream()
        for wait in (False, True):
            x = torch.zeros(1000, device="mlu")
            side.wait_stream(torch.mlu.current_stream())
            fut = torch.futures.Future(devices=["mlu:0"])
            with torch.mlu.stream(side):
                gate = fa.hold()
                x.fill_(5.0)
                fut.set_result(x)             # records an event on `side`, behind the gate
            if wait:
                fut.wait()                    # the current stream waits for that event
            y = x + 0 * x                     # queued on the current stream
            if not wait:
                torch.mlu.current_stream().synchronize()  # y is done before the gate opens
            gate.release()
            torch.mlu.synchronize(); side.synchronize()
            print(wait, y.sum().item())
    """)
    assert out.splitlines() == ["False 0.0", "True 5000.0"]


def test_elapsed_time_and_pinned_memory():
    out = run("""
        a, b = torch.mlu.Event(enable_timing=True), torch.mlu.Event(enable_timing=True)
        a.record(); fa.sleep(0.1); b.record(); b.synchronize()
        print(a.elapsed_time(b) >= 100.0, torch.empty(4, pin_memory=True).is_pinned(),
              torch.ones(3).pin_memory().is_pinned(), torch.ones(3).is_pinned())
    """)
    assert out == "True True True False"


def test_streams_come_from_a_pool_as_cudas_do():
    # Code that takes a pool stream per op (kaitian's backend does) must not
    # start a thread per op: before the pool, 200 collectives left 200 threads.
    out = run("""
        import os
        before = len(os.listdir("/proc/self/task"))
        ids = {torch.mlu.Stream().stream_id for _ in range(200)}
        print(len(ids), len(os.listdir("/proc/self/task")) - before < 40, 0 in ids)
    """)
    assert out == "32 True False"


@pytest.mark.parametrize("visible,count", [("1", 1), ("1,0", 2), ("", 0)])
def test_visible_devices(visible, count):
    assert run("print(torch.mlu.device_count())", {"MLU_VISIBLE_DEVICES": visible}) == str(count)


def test_torch_load_onto_a_device():
    """``torch.load(map_location="mlu:1")`` (an elastic joiner loads the state it is sent so)
    makes the device current while it copies (``torch.mlu.device``), and a copy that waits
    for its stream while holding the GIL completes (the stream's worker frees the last
    copy's tensors under the GIL: it deadlocked a joiner)."""
    out = run("""
        import io
        buf = io.BytesIO()
        torch.save({f"w{i}": torch.arange(4.0) + i for i in range(16)}, buf)
        for _ in range(20):
            buf.seek(0)
            state = torch.load(buf, map_location="mlu:1", weights_only=True)
        w = state["w3"]
        print(w.device, w.cpu().tolist(), torch.mlu.current_device())
    """)
    assert out == "mlu:1 [3.0, 4.0, 5.0, 6.0] 0"
