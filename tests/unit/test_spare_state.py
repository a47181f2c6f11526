"""The state a benched rank receives travels as one packed buffer: every tensor's bytes in place."""

import torch

from kaitian.training.rebalance import _ALIGN, _filled, _layout, _leaf_specs, _skeleton, _views


def _pack(tensors):
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    offsets, total = _layout(specs)
    flat = torch.full((total,), 0xAB, dtype=torch.uint8)
    torch._foreach_copy_(_views(flat, specs, offsets), tensors)
    return flat, specs, offsets


def test_tensors_of_every_dtype_and_shape_come_back_bit_for_bit_each_at_an_aligned_place():
    tensors = [torch.randn(3, 5), torch.tensor(2.5, dtype=torch.float64), torch.arange(7), torch.rand(3) > 0.5,
               torch.randn(2, 2, dtype=torch.complex64), torch.empty(0, 4), torch.randn(5).to(torch.bfloat16),
               torch.randint(0, 255, (3,), dtype=torch.uint8)]
    flat, specs, offsets = _pack(tensors)
    assert all(o % _ALIGN == 0 for o in offsets) and offsets == sorted(offsets)
    assert flat.numel() == offsets[-1] + _ALIGN  # the last: 3 bytes, in a place of 16
    back = _views(flat, specs, offsets)
    assert all(b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t) for b, t in zip(back, tensors))


def test_an_optimizers_state_comes_back_through_its_skeleton_and_the_packed_tensors():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(8, 4)).sum().backward()
    opt.step()
    leaves = []
    skeleton = _skeleton([opt.state_dict()], leaves)
    flat, specs, offsets = _pack([*net.parameters(), *net.buffers(), *leaves])
    assert _leaf_specs(skeleton) == specs[-len(leaves):]  # what the spare learns from the skeleton alone
    received = [v.clone() for v in _views(flat, specs, offsets)]
    other = torch.optim.Adam(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).parameters())
    other.load_state_dict(_filled(skeleton, iter(received[-len(leaves):]))[0])
    mine, theirs = opt.state_dict()["state"], other.state_dict()["state"]
    assert mine.keys() == theirs.keys() and all(
        torch.equal(mine[k][name], theirs[k][name]) for k in mine for name in mine[k])
