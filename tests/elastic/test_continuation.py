"""Continue mode's bookkeeping on one node (kaitian.launcher.continuing), without processes."""

from types import SimpleNamespace

from kaitian import _torch as _te
from kaitian.launcher.continuing import Continuation, WorkerProcess


class _GoneStore:
    """A job record whose store's host has exited (node 0 leaves once every member finished)."""

    def __getattr__(self, name):
        def unreachable(*args):
            raise RuntimeError("Connection reset by peer")
        return unreachable


class _Runtime:
    def __init__(self, codes):
        self.codes = codes

    def exit_codes(self, context):
        return self.codes

    def forget_worker(self, pid):
        pass


def _continuation(codes):
    context = SimpleNamespace(pids=lambda: {0: 100, 1: 101}, error_files={})
    c = Continuation(record=_GoneStore(), runtime=_Runtime(codes), restart=None, can_restart=lambda w: False)
    c.watch([WorkerProcess(local_rank=r, member=f"n/{r}/0", incarnation=0, context=context, key=r) for r in (0, 1)])
    return c


def test_workers_that_finish_after_the_store_host_left_succeed():
    result = _continuation({0: 0, 1: 0}).monitor({0: 4, 1: 5})
    assert result.state == _te.WorkerState.SUCCEEDED
    assert result.return_values == {4: None, 5: None} and not result.failures


def test_a_worker_lost_when_the_store_is_gone_hands_over_with_its_failure():
    result = _continuation({0: None, 1: 3}).monitor({0: 4, 1: 5})
    assert result.state == _te.WorkerState.FAILED
    assert list(result.failures) == [5] and result.failures[5].exitcode == 3
