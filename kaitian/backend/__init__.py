"""Backend ``"kaitian"``: registration with torch.distributed.

``import kaitian`` calls :func:`register_backend`; afterwards
``dist.init_process_group("kaitian")`` and ``dist.new_group(backend="kaitian")``
build a :class:`kaitian._C.KaitianBackend` through
:func:`kaitian.backend.factory.create_kaitian_backend`.
"""

from __future__ import annotations

__all__ = ["BACKEND_NAME", "backend_devices", "register_backend"]

BACKEND_NAME = "kaitian"


def backend_devices() -> list:
    """Device types torch routes to kaitian: those of the vendor table this torch
    knows, and torch's PrivateUse1 slot unless a known one is it.

    A vendor plug-in such as torch_mlu renames PrivateUse1 when it is imported,
    possibly after ``import kaitian``; registered as ``privateuseone``, its
    tensors still reach kaitian, whatever the import order.
    """
    import torch

    from kaitian.devices.vendors import VENDORS

    found = []
    for name in VENDORS:
        try:
            torch.device(name)
        except RuntimeError:
            continue
        found.append(name)
    if torch.device("privateuseone").type not in found:
        found.append("privateuseone")
    return found


def _creator(dist_opts, backend_options=None):
    from kaitian.backend.factory import create_kaitian_backend

    return create_kaitian_backend(dist_opts, backend_options)


def register_backend() -> None:
    """Registers the ``"kaitian"`` backend with torch (idempotent)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from kaitian import _torch

    if BACKEND_NAME.upper() in _torch.backend_plugins():
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _creator, extended_api=True, devices=backend_devices()
    )
