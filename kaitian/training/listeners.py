"""Callbacks between the training helpers, held so that no helper keeps another alive."""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional

__all__ = ["Listeners"]


def _weak_callable(callback: Callable) -> Callable[[], Optional[Callable]]:
    """A weak reference to a bound method (no sampler/model <-> re-balancer cycle), else a strong one."""
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        return weakref.WeakMethod(callback)
    return lambda: callback


class Listeners:
    """A list of callbacks; bound methods are held weakly and dropped once their object is gone."""

    def __init__(self) -> None:
        self._refs: List[Callable[[], Optional[Callable]]] = []

    def add(self, callback: Callable) -> None:
        self._refs.append(_weak_callable(callback))

    def __call__(self, *args: Any) -> None:
        for ref in list(self._refs):
            callback = ref()
            if callback is not None:
                callback(*args)
