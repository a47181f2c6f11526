"""Path containment: the one rule the docker runtime's mounts, image mounts,
hand-overs and environment share."""

from __future__ import annotations

from typing import Iterable, List

__all__ = ["inside", "outermost"]


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or below it (absolute, normalised paths)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def outermost(paths: Iterable[str]) -> List[str]:
    """The paths not inside another one of them, shortest first (one inside
    another is already visible through it)."""
    kept: List[str] = []
    for path in sorted(set(paths), key=len):
        if not any(inside(path, k) for k in kept):
            kept.append(path)
    return kept
