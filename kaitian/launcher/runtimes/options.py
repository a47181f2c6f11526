"""Typed runtime options: built once from kaitianrun's flags, read by the runtimes.

Every runtime flag is checked before anything starts (a bad value is a
one-line error), whichever runtime was chosen, so ``--image x`` is refused
the same way with ``--runtime local``. Each runtime owns its options class
(``from_args(args, config)``); this module holds only what all share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Type, TypeVar

__all__ = ["RuntimeOptions"]

T = TypeVar("T")


@dataclass(frozen=True)
class RuntimeOptions:
    """Every runtime option of one run.

    Attributes:
        duplicate_stdout_filters: torchrun's ``--duplicate-stdout-filters`` (every runtime).
        duplicate_stderr_filters: torchrun's ``--duplicate-stderr-filters`` (every runtime).
        own: each runtime's own options, by runtime name.
    """

    duplicate_stdout_filters: Optional[List[str]] = None
    duplicate_stderr_filters: Optional[List[str]] = None
    own: Mapping[str, object] = field(default_factory=dict)

    def of(self, name: str, cls: Type[T]) -> T:
        """Runtime ``name``'s options (``cls()``, its defaults, when none were given)."""
        found = self.own.get(name)
        return found if isinstance(found, cls) else cls()
