"""Out-of-range arguments of the training API are one ValueError at construction, before a
process group, a collective or a measurement: a value that cannot mean anything (a NaN gain, a
zero timeout) must not train on with a split that never changes or fail later as something else."""

from __future__ import annotations

import math

import pytest
import torch

from kaitian.elastic import Trainer
from kaitian.training.rebalance import Rebalancer


@pytest.mark.parametrize("kwargs,message", [
    ({"every": 0}, "every must be a positive number of steps or 'epoch', got 0"),
    ({"seconds": -1}, "seconds must be >= 0, got -1"),
    ({"seconds": math.nan}, "seconds must be >= 0, got nan"),
    ({"smoothing": 0}, "smoothing must be in (0, 1], got 0"),
    ({"min_gain": -0.1}, "min_gain must be in [0, 1), got -0.1"),
    ({"min_gain": 1.0}, "min_gain must be in [0, 1), got 1.0"),
    ({"min_gain": math.nan}, "min_gain must be in [0, 1), got nan"),
    ({"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),
    ({"max_batch_size": 0}, "max_batch_size must be at least 1, got 0"),
    ({"max_batch_size": [4, 0]}, "max_batch_size must be at least 1 (or None) per rank, got [4, 0]"),
    ({"measure": "wall"}, "measure must be 'busy' or 'compute', got 'wall'"),
    ({"probe_every_s": -1}, "probe_every_s must be >= 0, got -1"),
])
def test_rebalancer_refuses_a_setting_out_of_range(kwargs, message):
    with pytest.raises(ValueError) as err:
        Rebalancer(None, None, **kwargs)
    assert str(err.value) == message


def test_rebalancer_in_range_settings_reach_the_model_check():
    with pytest.raises(TypeError, match="kaitian.DistributedDataParallel"):
        Rebalancer(None, None, every="epoch", seconds=0, min_gain=0, warmup_steps=0, max_batch_size=[None, 3])


@pytest.mark.parametrize("kwargs,message", [
    ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    ({"timeout": math.inf}, "timeout must be a positive number of seconds, got inf"),
    ({"quorum_timeout": -1}, "quorum_timeout must be a finite number of seconds >= 0, got -1"),
    ({"quorum_timeout": math.nan}, "quorum_timeout must be a finite number of seconds >= 0, got nan"),
    ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
])
def test_elastic_trainer_refuses_an_argument_out_of_range(kwargs, message):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError) as err:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), list(range(8)), **kwargs)
    assert str(err.value) == message
