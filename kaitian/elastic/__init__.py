"""``kaitian.elastic``: keep training when a device is lost (``kaitianrun --on-failure continue``).

:class:`Trainer` owns the model, the optimizer, the sampler and the
re-balancer; after a loss the survivors re-form the process group, redo the
step in flight with the same global batch, and a restarted worker joins with
the live state. See docs/elastic.md.
"""

from kaitian.elastic.trainer import Event, StepInfo, Trainer
from kaitian.errors import ElasticError

__all__ = ["Trainer", "StepInfo", "Event", "ElasticError"]
