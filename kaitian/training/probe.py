"""A benched rank's look at its own speed: its last batch's forward and backward, timed.

A hot spare trains no step, so nothing else measures it; a device that
became faster while benched (another job on it ended) would stay benched
on its old cost. The probe runs the spare's model on the inputs of its last
training step and leaves the model as it was: in eval mode (no running
statistics move, no dropout draws), its gradients put back. Only the ratio
of two probes is used (see :class:`kaitian.Rebalancer`), so what the probe
leaves out of a step (the loss, the optimizer, data loading) cancels.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Tuple

import torch

from kaitian.training.ddp import _grad_tensors, _map_tensors

__all__ = ["probe_seconds"]


def probe_seconds(module: torch.nn.Module, inputs: Tuple[Any, dict], device: torch.device,
                  repeats: int = 3) -> Optional[float]:
    """The fastest of ``repeats`` forward + backward passes of ``module`` on ``inputs`` (``(args, kwargs)``)
    in seconds; ``None`` if the output has nothing to differentiate.

    The module's parameters, buffers, gradients and training mode are as before.
    """
    args, kwargs = _on(device, inputs)  # as torch's DDP moves them with device_ids
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    was_training = module.training
    module.eval()
    best: Optional[float] = None
    try:
        for _ in range(repeats):
            for p in params:
                p.grad = None
            _synchronize(device)
            start = time.perf_counter()
            outputs = _grad_tensors(module(*args, **kwargs))
            if not outputs:
                return None
            torch.autograd.backward([t.sum() for t in outputs])
            _synchronize(device)
            spent = time.perf_counter() - start
            best = spent if best is None else min(best, spent)
    finally:
        module.train(was_training)
        for p, g in zip(params, grads):
            p.grad = g
    return best


def _on(device: torch.device, value: Any) -> Any:
    """``value`` with every tensor in it (tuples, lists, dicts) on ``device``, cut from the graph that made
    it (another model's output, a GAN's generated batch: that graph is freed), still asking for its gradient
    if it did."""
    return _map_tensors(lambda t: t.detach().to(device).requires_grad_(t.requires_grad), value)


def _synchronize(device: torch.device) -> None:
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)
