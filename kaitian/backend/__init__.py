"""Backend ``"kaitian"``: registration with torch.distributed.

(Scaffold: the backend work replaces this with the real registration.)
"""

__all__ = ["register_backend"]


def register_backend() -> None:
    """Registers the ``"kaitian"`` backend with torch (idempotent)."""
