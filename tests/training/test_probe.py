"""A benched rank's probe of its own speed leaves its model as it was; the cost it publishes is checked."""

import pytest
import torch

from kaitian.training.probe import probe_seconds


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _state(net):
    return ([t.clone() for t in net.state_dict().values()],
            [None if p.grad is None else p.grad.clone() for p in net.parameters()])


def _same(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_the_probe_times_a_step_and_leaves_parameters_buffers_gradients_and_mode_as_they_were():
    net = _net()
    x = torch.randn(32, 8)
    torch.nn.functional.cross_entropy(net(x), torch.randint(0, 3, (32,))).backward()  # gradients to keep
    grads = [p.grad for p in net.parameters()]
    before = _state(net)
    seconds = probe_seconds(net, ((x,), {}), torch.device("cpu"))
    assert seconds is not None and seconds > 0
    assert _same(before, _state(net))  # BatchNorm's running statistics included
    assert all(p.grad is g for p, g in zip(net.parameters(), grads))  # the same tensors, not copies
    assert net.training


def test_without_gradients_before_there_are_none_after_and_eval_mode_stays():
    net = _net().eval()
    seconds = probe_seconds(net, ((), {"input": torch.randn(4, 8)}), torch.device("cpu"))
    assert seconds is not None and seconds > 0
    assert all(p.grad is None for p in net.parameters()) and not net.training


def test_inputs_made_by_another_model_whose_graph_is_freed_are_probed_as_inputs():
    """A GAN's critic last trained on the generator's output: the probe's backward stops at its inputs
    (that graph was freed by the step's backward) and leaves the generator's gradients alone."""
    net, generator = _net(), torch.nn.Linear(4, 8)
    fake = generator(torch.randn(32, 4))
    net(fake).sum().backward()  # frees the generator's graph, as the training step did
    generator_grads = [p.grad.clone() for p in generator.parameters()]
    assert probe_seconds(net, ((fake,), {}), torch.device("cpu")) > 0
    assert all(torch.equal(p.grad, g) for p, g in zip(generator.parameters(), generator_grads))


def test_an_output_with_nothing_to_differentiate_is_no_probe():
    net = _net()
    for p in net.parameters():
        p.requires_grad_(False)
    assert probe_seconds(net, ((torch.randn(4, 8),), {}), torch.device("cpu")) is None
    assert net.training


def test_a_published_cost_is_checked_before_the_trainers_use_it():
    from kaitian.training.rebalance import published_cost
    from kaitian.training.stepcost import StepCost

    assert published_cost(b"0.002,0.0005") == StepCost(0.002, 0.0005)
    assert published_cost(b"none") is None  # withdrawn: the rank trained again
    for garbage in (b"1,2,3", b"nan,0.1", b"0.1,inf", b"-1,0.1", b"0.1,0", b"\xff\xfe", b"", b"0.1"):
        with pytest.raises(ValueError, match="is not 'FIXED,PER_SAMPLE' seconds"):
            published_cost(garbage)
