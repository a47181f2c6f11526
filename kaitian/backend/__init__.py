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
    """Device types of the vendor table that this torch knows (``mlu`` only once
    torch_mlu has registered it), so torch routes their tensors to kaitian."""
    import torch

    from kaitian.devices.vendors import VENDORS

    found = []
    for name in VENDORS:
        try:
            torch.device(name)
        except RuntimeError:
            continue
        found.append(name)
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
