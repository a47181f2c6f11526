"""Callbacks between the training helpers, held weakly where a strong hold would close a cycle."""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional

__all__ = ["Listeners"]


class Listeners:
    """A list of callbacks.

    Args:
        weak: hold bound methods weakly, dropping them once their object is
            gone (a sampler's listeners: the re-balancer holds the sampler);
            ``False``: hold them, keeping their objects alive (a model's: its
            re-balancer lives as long as the model does).
    """

    def __init__(self, weak: bool = True) -> None:
        self._weak = weak
        self._refs: List[Callable[[], Optional[Callable]]] = []

    def add(self, callback: Callable) -> None:
        if self._weak and hasattr(callback, "__self__") and hasattr(callback, "__func__"):
            self._refs.append(weakref.WeakMethod(callback))
        else:
            self._refs.append(lambda: callback)

    def __call__(self, *args: Any) -> None:
        for ref in list(self._refs):
            callback = ref()
            if callback is not None:
                callback(*args)
