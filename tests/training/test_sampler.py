"""kaitian.DistributedSampler invariants over many dataset sizes and capability mixes.

Pure Python: every rank's sampler is built in this process with explicit
``num_replicas`` / ``rank`` / ``capabilities``, as the ranks of a job would.
"""

import collections
import itertools

import pytest
from hypothesis import given, settings, strategies as st

import kaitian
from kaitian.errors import TrainingError
from kaitian.training.sampler import DistributedSampler, SplitError
from kaitian.training.split import proportional_split
from kaitian.training.weighting import check_whole_steps

caps_strategy = st.lists(
    st.floats(min_value=0.05, max_value=50.0, allow_nan=False), min_size=1, max_size=6
)


def _ranks(n, batch, caps, **kw):
    return [
        DistributedSampler(list(range(n)), batch_size=batch, num_replicas=len(caps), rank=r,
                           capabilities=caps, **kw)
        for r in range(len(caps))
    ]


def _epoch(samplers, epoch=0):
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s.epoch_batches()) for s in samplers]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 700), batch=st.integers(1, 40), caps=caps_strategy,
       shuffle=st.booleans(), seed=st.integers(0, 1000), epoch=st.integers(0, 50))
def test_every_sample_once_equal_steps_minimal_padding(n, batch, caps, shuffle, seed, epoch):
    samplers = _ranks(n, batch, caps, shuffle=shuffle, seed=seed)
    batches = _epoch(samplers, epoch)
    world = len(caps)
    steps = {len(b) for b in batches}
    assert len(steps) == 1, "ranks disagree on the number of steps"
    assert steps.pop() == samplers[0].num_steps == -(-n // (batch * world))
    counts = collections.Counter(i for b in batches for step in b for i in step)
    assert set(counts) == set(range(n)), "a sample is missing"
    padding = sum(counts.values()) - n
    remainder = n % (batch * world)
    assert padding == (max(0, world - remainder) if remainder else 0)
    assert all(c == 1 for c in counts.values()) or padding > 0
    assert max(counts.values()) <= 1 + -(-world // n)
    for r, s in enumerate(samplers):
        assert len(s) == sum(len(step) for step in batches[r])
        assert all(len(step) == s.local_batch_size for step in batches[r][:-1])
        assert 1 <= len(batches[r][-1]) <= s.local_batch_size
        # the classic sampler= path yields the same indices in the same order
        assert list(s) == [i for step in batches[r] for i in step]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 500), batch=st.integers(1, 30), caps=caps_strategy)
def test_drop_last_uses_only_full_steps(n, batch, caps):
    world = len(caps)
    if n < batch * world:
        with pytest.raises(SplitError, match="lower batch_size"):
            _epoch(_ranks(n, batch, caps, drop_last=True))
        return
    batches = _epoch(_ranks(n, batch, caps, drop_last=True))
    flat = [i for b in batches for step in b for i in step]
    assert len(flat) == len(set(flat)) == (n // (batch * world)) * batch * world


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 64), caps=caps_strategy)
def test_split_is_proportional_to_capability(batch, caps):
    samplers = _ranks(1000, batch, caps)
    split = samplers[0].split
    assert sum(split) == batch * len(caps) and min(split) >= 1
    assert all(s.split == split for s in samplers)
    total = batch * len(caps)
    ideal = [total * c / sum(caps) for c in caps]
    for got, want in zip(split, ideal):
        # largest remainder, except where the minimum of 1 had to be given
        assert got == 1 or abs(got - want) < 1 + len(caps)
    # faster never gets fewer samples than slower
    order = sorted(range(len(caps)), key=lambda r: caps[r])
    assert all(split[a] <= split[b] for a, b in zip(order, order[1:]) if caps[a] < caps[b])


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 300), batch=st.integers(1, 20), caps=caps_strategy,
       seed=st.integers(0, 100), epoch=st.integers(0, 10))
def test_deterministic_for_seed_and_epoch(n, batch, caps, seed, epoch):
    a = _epoch(_ranks(n, batch, caps, seed=seed), epoch)
    b = _epoch(_ranks(n, batch, caps, seed=seed), epoch)
    assert a == b


def test_epochs_and_seeds_shuffle_differently():
    base = _epoch(_ranks(500, 8, [2.0, 1.0]), 0)
    assert _epoch(_ranks(500, 8, [2.0, 1.0]), 1) != base
    assert _epoch(_ranks(500, 8, [2.0, 1.0], seed=5), 0) != base
    unshuffled = _epoch(_ranks(500, 8, [2.0, 1.0], shuffle=False), 3)
    assert unshuffled[0][0] == list(range(11)) and unshuffled[1][0] == list(range(11, 16))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 400), batch=st.integers(1, 20), caps=caps_strategy,
       data=st.data())
def test_mid_epoch_split_change_keeps_coverage(n, batch, caps, data):
    samplers = _ranks(n, batch, caps)
    world = len(caps)
    steps = samplers[0].num_steps
    change_at = data.draw(st.integers(0, steps))
    weights = data.draw(st.lists(st.floats(0.1, 10.0), min_size=world, max_size=world))
    new = proportional_split(batch * world, weights)
    iters = [s.epoch_batches() for s in samplers]
    batches = [[] for _ in range(world)]
    for step in range(steps):
        if step == change_at:
            for s in samplers:
                s.set_split(new, after_draws=0)
        for r in range(world):
            batches[r].append(next(iters[r]))
    for it in iters:
        assert next(it, None) is None
    flat = collections.Counter(i for b in batches for step in b for i in step)
    assert set(flat) == set(range(n))
    assert sum(flat.values()) - n == (max(0, world - n % (batch * world)) if n % (batch * world) else 0)
    if change_at < n // (batch * world):  # a full step right after the change
        assert [len(batches[r][change_at]) for r in range(world)] == new


def test_split_change_at_next_epoch_and_listeners():
    samplers = _ranks(100, 10, [1.0, 1.0])
    seen = []
    samplers[0].add_split_listener(lambda old, new: seen.append((old, new)))
    for s in samplers:
        s.set_split([15, 5])
    assert samplers[0].local_batch_size == 10  # not before the next epoch
    batches = _epoch(samplers, 1)
    assert [len(b[0]) for b in batches] == [15, 5]
    assert seen == [([10, 10], [15, 5])]


def test_the_length_after_set_epoch_counts_the_split_its_pass_starts_with():
    """A split decided in ``set_epoch`` (the re-balancer's epoch-start round: a rank benched or called
    back) takes effect at the epoch's first draw. ``len()`` asked in between - a loop that reads
    ``len(loader)`` before iterating, to end its last accumulation window - counts the pass that
    follows: a rank called back yielded batches where its length said 0 (its last window never
    stepped, its collectives apart from the others'), a benched one none where it said 5."""
    samplers = _ranks(100, 10, [1.0, 1.0])
    for split, epoch in (([20, 0], 1), ([10, 10], 2)):
        _epoch(samplers, epoch - 1)  # the pass before, drawn to its end
        for s in samplers:
            s.enable_benching()
            s.set_split(split)
            s.set_epoch(epoch)
        lengths = [(len(s), len(s.batch_sampler())) for s in samplers]
        batches = [list(s.batch_sampler()) for s in samplers]
        assert lengths == [(sum(map(len, b)), len(b)) for b in batches], (split, lengths)
        assert [len(b) for b in batches] == [5 if n else 0 for n in split]


def test_a_raised_minimum_also_lifts_a_split_change_that_waits():
    samplers = _ranks(100, 10, [1.0, 1.0])
    for s in samplers:
        s.set_split([19, 1])  # for the next epoch
        s.require_min_batch_size(2)  # the model has BatchNorm
    batches = _epoch(samplers, 1)
    assert [len(b[0]) for b in batches] == [18, 2]


@pytest.mark.parametrize("bad, match", [
    ([10], "entries"), ([0, 20], "at least 1"), ([12, 12], "global batch"),
])
def test_bad_split_is_refused(bad, match):
    with pytest.raises(SplitError, match=match):
        _ranks(100, 10, [1.0, 1.0])[0].set_split(bad)


def test_unknown_capabilities_get_the_known_mean():
    s = DistributedSampler(range(100), batch_size=10, num_replicas=3, rank=0, capabilities={0: 4.0, 2: 2.0})
    assert s.capabilities == [4.0, 3.0, 2.0]
    assert DistributedSampler(range(100), batch_size=10, num_replicas=2, rank=1).split == [10, 10]


def test_proportional_split_caps_and_errors():
    assert proportional_split(100, [3, 1], caps=[60, None]) == [60, 40]
    assert proportional_split(5, [6, 4, 2]) == [2, 2, 1]
    with pytest.raises(SplitError, match="add up to less"):
        proportional_split(100, [1, 1], caps=[10, 10])
    with pytest.raises(SplitError, match="at least 1"):
        proportional_split(2, [1, 1, 1])


def test_optimize_batch_size_without_a_process_group_is_the_batch():
    # with one: the sampler's share from the same capabilities (tests/workers/exact_grad.py)
    assert kaitian.optimize_batch_size(16) == 16


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="not in"):
        DistributedSampler(range(10), batch_size=2, num_replicas=2, rank=2)


def test_is_a_torch_distributed_sampler_with_a_batch_sampler():
    import torch.utils.data as tud

    s = DistributedSampler(range(100), 2, 1, batch_size=10, capabilities=[3.0, 1.0])
    assert isinstance(s, tud.DistributedSampler) and (s.num_replicas, s.rank) == (2, 1)
    bs = s.batch_sampler()
    assert isinstance(bs, tud.BatchSampler) and bs.batch_size == s.local_batch_size == 5
    assert s.num_samples == len(s) == sum(len(b) for b in bs)
    assert DistributedSampler(range(100), num_replicas=2, rank=0).batch_size == 32  # the default


def test_a_dataloader_whose_batches_cut_the_steps_is_named():
    """The rule kaitian's DDP and scale_loss apply to each step's exchanged ``yielded``
    (end to end, refused at the first step: tests/workers/weighting_cases.py)."""
    import torch.utils.data as tud

    samplers = _ranks(100, 8, [3.0, 1.0])  # split [12, 4]
    for s in samplers:
        next(iter(tud.DataLoader(range(100), batch_size=8, sampler=s)))
    assert [s.yielded for s in samplers] == [8, 8]
    with pytest.raises(TrainingError, match=r"^rank 0's DataLoader has taken 8 samples, not whole steps of 12 "
                                            r"\(kaitian's split \[12, 4\]\).*batch_sampler=sampler.batch_sampler\(\)"):
        check_whole_steps(samplers[1], [8, 8])
    for s in samplers:
        s.set_epoch(1)
    loaders = [tud.DataLoader(range(100), batch_size=s.local_batch_size, sampler=s) for s in samplers]
    steps = 0
    for batches in zip(*loaders):  # whole steps at every step, the short last one too
        check_whole_steps(samplers[0], [s.yielded for s in samplers])
        steps += 1
    assert steps == samplers[0].num_steps and [s.yielded for s in samplers] == [len(s) for s in samplers]
    batches = [b.tolist() for b in tud.DataLoader(range(100), batch_size=samplers[0].local_batch_size,
                                                  sampler=samplers[0])]
    assert batches == list(samplers[0].epoch_batches()) and samplers[0].yielded == 0


def test_state_dict_resumes_mid_epoch_without_repeats_or_gaps():
    def make():
        return DistributedSampler(range(90), num_replicas=2, rank=1, batch_size=8, seed=3,
                                  capabilities=[1.0, 1.0])

    full = make()
    full.set_epoch(2)
    want = list(full.epoch_batches())
    first = make()
    first.set_epoch(2)
    it = first.epoch_batches()
    seen = [next(it) for _ in range(3)]
    first.set_split([6, 10], after_draws=0)  # a re-balance was pending at the checkpoint
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rest = list(resumed.epoch_batches())
    assert seen == want[:3] and len(seen) + len(rest) == resumed.num_steps
    assert resumed.split == [6, 10] and all(len(b) == 10 for b in rest[:-1])
    # the other rank resumes alike: together every sample once
    other = DistributedSampler(range(90), num_replicas=2, rank=0, batch_size=8, seed=3, capabilities=[1.0, 1.0])
    other.load_state_dict(state)
    mine = [i for b in rest for i in b] + [i for b in list(other.epoch_batches()) for i in b]
    first_part = [i for b in seen for i in b] + [i for b in _rank0_first(3) for i in b]
    assert sorted(mine + first_part) == list(range(90))
    with pytest.raises(SplitError, match="cannot resume"):
        DistributedSampler(range(90), num_replicas=2, rank=0, batch_size=9).load_state_dict(state)


def _rank0_first(n):
    s = DistributedSampler(range(90), num_replicas=2, rank=0, batch_size=8, seed=3, capabilities=[1.0, 1.0])
    s.set_epoch(2)
    it = s.epoch_batches()
    return [next(it) for _ in range(n)]



@pytest.mark.parametrize("ahead", [0, 1, 4])
def test_losses_claim_the_batches_in_hand_out_order_however_far_the_loader_draws_ahead(ahead):
    """A loader that draws ``ahead`` batches early (workers, Accelerate): each claim is the batch
    being trained, across a split change mid-epoch and the short last step; a claim with none left
    raises, and a new pass over the epoch starts with none."""
    sampler = DistributedSampler(list(range(473)), batch_size=16, num_replicas=2, rank=1, capabilities=[5, 1])
    sampler.set_epoch(0)
    batches = sampler.batch_sampler()
    it = iter(batches)
    drawn = collections.deque([next(it)])
    sampler.set_split([20, 12], after_draws=6)  # from the 8th batch on
    drawn.extend(itertools.islice(it, ahead))
    trained, claimed = [], []
    while drawn:
        trained.append(len(drawn.popleft()))
        claimed.append(sampler.claim_batch())
        drawn.extend(itertools.islice(it, 1))
    assert trained == [5] * 7 + [12] * 7 + [9]
    assert [c.size for c in claimed] == trained and [c.step for c in claimed] == list(range(15))
    assert [sampler.step_samples(c.step) for c in claimed] == [32] * 14 + [25]
    with pytest.raises(TrainingError, match="every batch it handed out this epoch is claimed already"):
        sampler.claim_batch()
    sampler.set_epoch(1)
    next(iter(batches))
    next(iter(batches))  # a pass abandoned after one batch, then a new one
    assert sampler.claim_batch() == (0, 12)
    with pytest.raises(TrainingError):
        sampler.claim_batch()
