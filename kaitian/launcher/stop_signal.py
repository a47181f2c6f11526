"""The stop signal the agent got, kept so that nothing can swallow it.

torch's handler for SIGTERM, SIGINT, SIGHUP and SIGQUIT (installed by each
process context's start) raises ``SignalException``, an ``Exception``. Where it
lands inside an ``except Exception`` (logging's emit, an engine call whose
errors the agent tolerates, a slow docker engine's), it is swallowed, and the
agent would go on running as if nobody had pressed Ctrl-C. :class:`StopSignal`
puts a handler over torch's that records the signal first; the agent raises a
recorded signal again at its next monitoring step.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Optional

from kaitian import _torch as _te

__all__ = ["STOP_SIGNALS", "StopSignal"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class StopSignal:
    def __init__(self) -> None:
        self.received: Optional[signal.Signals] = None

    def hold(self) -> None:
        """Records each stop signal before its current handler (torch's) runs. Called after every start
        (a process context's start installs torch's handler again); main thread only, as ``signal.signal``."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            then = signal.getsignal(sig)
            if callable(then) and getattr(then, "records_for", None) is not self:
                signal.signal(sig, self._recording(then))

    def _recording(self, then: Callable[[int, Optional[FrameType]], Any]) -> Callable[[int, Optional[FrameType]], Any]:
        def handler(signum: int, frame: Optional[FrameType]) -> Any:
            self.received = signal.Signals(signum)
            return then(signum, frame)

        handler.records_for = self  # type: ignore[attr-defined]
        return handler

    def raise_received(self) -> None:
        """Raises the recorded stop signal as torch's handler does, if there is one."""
        if self.received is not None:
            raise _te.SignalException(f"Process {os.getpid()} got signal: {self.received}", sigval=self.received)
