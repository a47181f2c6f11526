"""Who trains and how much: a step-cost model per rank and the split that minimises the step.

A rank's busy time in a step (its step minus every collective wait, device
time on accelerators) is modelled as ``t_r(n) = a_r + b_r * n``: a fixed part
``a_r`` (forward and backward at any batch, optimizer, Python) and a part per
sample ``b_r``. Each rank fits its own ``a_r, b_r`` by least squares over the
batch sizes it has trained (:class:`StepCostFit`). A synchronised step of the
ranks ``S`` then takes

    T(S, n) = max_{r in S} (a_r + b_r * n_r) + c(S)

where ``c(S)`` is the gradient exchange: nothing for one rank, else as
measured (the smallest communication time of any rank in the step, which
waits for nobody), apart for ranks that span vendor groups (the bridge:
``exchange_s``) and ranks all in one group (its vendor library: ``within_s``
of that group; one not measured yet is charged nothing, so that the solver
tries it and measures it). :func:`solve_split` chooses, for a fixed global batch, the
split with the smallest predicted ``T`` over the subsets of ranks (a rank may
get zero samples), each vendor group alone among them, so the step it
predicts is never slower than the fastest group alone would take.

Everything here is deterministic: ranks that feed it the same numbers get the
same split.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from kaitian.errors import SplitError

__all__ = ["StepCostFit", "StepCost", "Candidate", "SplitDecision", "solve_split", "predicted_step", "exchange_of",
           "halfway", "follow_exchange"]

# Batch sizes whose spread (relative to their mean) is below ALIKE cannot tell a from b; from
# SEPARATED on they tell it as well as the machine's drift lets them, and in between the fixed part
# counts in proportion. Two sizes a spread s apart whose times drift by e between them leave a
# off by about 2e/s of the step: 5 % of drift (this machine, epoch to epoch) read 0.19 s of a
# 0.62 s step as fixed from sizes 11 % apart, and the split moved 46 % the wrong way.
ALIKE, SEPARATED = 0.05, 0.5
# Steps a fit needs before a step far off it counts as a change of regime ...
_SETTLED = 4
# ... and steps in a row far off it that start a new fit.
_NEW_REGIME = 3
# Steps in a row at one batch size that set the fit's level there, and the most recent of them
# that count (see StepCostFit.cost).
_ANCHOR, _ANCHOR_MAX = 3, 12
# Steps judged against one fit before it is made again: a step's check then costs a comparison,
# not a least-squares pass over the window, on the step's own critical path.
_REFIT_EVERY = 8
# A round's exchange time moves the one kept this many times up or down at most.
EXCHANGE_STEP = 2.0
# Up to this many ranks every subset is tried (4096 split computations); beyond, whole vendor
# groups and the fastest ranks of them.
_EVERY_SUBSET = 12


@dataclass(frozen=True)
class StepCost:
    """``t(n) = fixed_s + per_sample_s * n``; ``per_sample_s <= 0``: not measured yet."""

    fixed_s: float
    per_sample_s: float

    def at(self, n: int) -> float:
        return self.fixed_s + self.per_sample_s * n if n > 0 else 0.0

    @property
    def known(self) -> bool:
        return self.per_sample_s > 0


class StepCostFit:
    """This rank's step-cost model from its recent steps: ``(samples, busy seconds)``.

    Args:
        window: how many recent steps the fit uses.
        half_life: a step's weight halves with every this many newer steps, so
            that the fit follows a device that slows down or speeds up.
    """

    def __init__(self, window: int = 48, half_life: float = 12.0) -> None:
        self.points: Deque[Tuple[int, float]] = deque(maxlen=window)
        self.half_life = half_life
        self._surprises = 0  # steps in a row far off the fit
        self._reference: Optional[Tuple[StepCost, bool, float]] = None  # (fit, varied, mean size)
        self._reference_age = 0

    def add(self, samples: int, seconds: float) -> None:
        """Adds a step. Steps in a row off what the fit expects by more than twice (either way)
        start a new fit from them: a device that became several times slower (or faster) is a
        new regime, and a fit across both would read the change as a fixed cost. A busy machine
        stretches single steps that much, rarely several in a row."""
        if not (samples > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        if len(self.points) >= _SETTLED:
            low, high = self._expected(samples)
            self._surprises = self._surprises + 1 if not 0.5 * low <= seconds <= 2.0 * high else 0
        self.points.append((int(samples), float(seconds)))
        if self._surprises >= _NEW_REGIME:
            for _ in range(len(self.points) - _NEW_REGIME):
                self.points.popleft()
            self._surprises = 0
            self._reference = None

    def _expected(self, samples: int) -> Tuple[float, float]:
        """The range a step of ``samples`` should take: the fit's prediction; from alike batch
        sizes (fixed and per-sample parts unknown) anything from all-fixed to all-per-sample."""
        if self._reference is None or self._reference_age >= _REFIT_EVERY:
            mean_n = sum(n for n, _ in self.points) / len(self.points)
            self._reference, self._reference_age = (self.cost(), self.varied, mean_n), 0
        self._reference_age += 1
        cost, varied, mean_n = self._reference
        if varied:
            return cost.at(samples), cost.at(samples)
        per_sample, fixed = cost.at(samples), cost.at(samples) * mean_n / samples
        return min(per_sample, fixed), max(per_sample, fixed)

    def clear(self) -> None:
        self.points.clear()
        self._surprises = 0
        self._reference = None

    @property
    def spread(self) -> float:
        """How far apart the batch sizes seen are, relative to their mean."""
        if not self.points:
            return 0.0
        sizes = [n for n, _ in self.points]
        return (max(sizes) - min(sizes)) * len(sizes) / sum(sizes)

    @property
    def varied(self) -> bool:
        """Whether the batch sizes seen differ enough to tell the fixed part from the per-sample one."""
        return self.spread >= ALIKE

    def cost(self) -> StepCost:
        """The weighted least-squares fit, its fixed part as far as the sizes' spread tells it
        (with alike sizes all of the time is per sample, ``a = 0``: the cautious reading never
        benches a rank for a fixed cost it has not seen), scaled so that it predicts the steps at
        the current batch size (the last ``_ANCHOR`` or more in a row) as measured.

        The scaling matters after the split moves: the points from the sizes left behind weigh by
        their size and their number, so a machine that warmed up since, or a cost per sample that
        depends on the size (a batch that no longer fits a cache), kept the fit off where the rank
        now trains for as long as they stayed in the window."""
        fit = self._least_squares()
        size = self.points[-1][0] if self.points else 0
        recent = [t for _, t in itertools.islice(
            itertools.takewhile(lambda p: p[0] == size, reversed(self.points)), _ANCHOR_MAX)]
        if len(recent) < _ANCHOR or not fit.known:
            return fit
        # the mean, as the step times the exchange's cost is measured against (c(S)): a rank's
        # throughput, and the lock-step's, are its steps' mean
        scale = sum(recent) / len(recent) / fit.at(size)
        return StepCost(fit.fixed_s * scale, fit.per_sample_s * scale)

    def _least_squares(self) -> StepCost:
        if not self.points:
            return StepCost(0.0, 0.0)
        n = [float(p[0]) for p in self.points]
        t = [p[1] for p in self.points]
        w = [0.5 ** ((len(n) - 1 - i) / self.half_life) for i in range(len(n))]
        total = sum(w)
        mean_n = sum(wi * x for wi, x in zip(w, n)) / total
        mean_t = sum(wi * y for wi, y in zip(w, t)) / total
        proportional = mean_t / mean_n
        var = sum(wi * (x - mean_n) ** 2 for wi, x in zip(w, n))
        spread = self.spread
        if spread < ALIKE or var <= 1e-12 * total * mean_n ** 2:  # alike, or the recent steps, which weigh, are
            return StepCost(0.0, proportional)
        slope = sum(wi * (x - mean_n) * (y - mean_t) for wi, x, y in zip(w, n, t)) / var
        # Noise can make either part negative; keep both physical and the fit's mean.
        slope = min(max(slope, 0.02 * proportional), proportional)
        fixed = (mean_t - slope * mean_n) * min(1.0, (spread - ALIKE) / (SEPARATED - ALIKE))
        return StepCost(fixed, (mean_t - fixed) / mean_n)


@dataclass(frozen=True)
class Candidate:
    """One subset of ranks and its best split."""

    split: Tuple[int, ...]
    predicted_s: float


@dataclass
class SplitDecision:
    """What :func:`solve_split` chose, and what it compared.

    Attributes:
        split: the chosen split (zeros: benched ranks).
        predicted_s: its predicted step time.
        current_s: the current split's predicted step time.
        alone_s: each vendor group alone: ``{group: predicted step}``.
    """

    split: List[int]
    predicted_s: float
    current_s: float
    alone_s: Dict[str, float] = field(default_factory=dict)

    @property
    def benched(self) -> List[int]:
        return [r for r, n in enumerate(self.split) if n == 0]


def exchange_of(ranks: Sequence[int], exchange_s: float, groups: Optional[Sequence[str]] = None,
                within_s: Optional[Mapping[str, float]] = None) -> float:
    """``c(S)``: nothing for one rank; ``within_s`` of their group for ranks all in one vendor
    group (a group not in it is not measured yet: nothing); else ``exchange_s``. Without
    ``within_s`` (or the groups), ``exchange_s`` for any two ranks or more."""
    if len(ranks) < 2:
        return 0.0
    if within_s is None or not groups:
        return exchange_s
    names = {groups[r] for r in ranks}
    return within_s.get(names.pop(), 0.0) if len(names) == 1 else exchange_s


def follow_exchange(kept: Optional[float], measured: float) -> float:
    """The exchange time kept after a round measured ``measured`` (``kept``: ``None`` before any):
    the reading, but at most ``EXCHANGE_STEP`` times above or below the kept time.

    A round's reading swings far from the typical one (0.1 to 34 ms between rounds of one run
    under CPU quotas), and the kept time outlives its round: while one group trains alone
    nothing measures the exchange across groups. Kept whole, one loaded round's reading kept
    the other group benched; one lucky round's would keep a group training that slows every
    step. A real change is followed within a few rounds."""
    if kept is None or kept <= 0:
        return measured
    return min(max(measured, kept / EXCHANGE_STEP), kept * EXCHANGE_STEP)


def predicted_step(split: Sequence[int], costs: Sequence[StepCost], exchange_s: float,
                   groups: Optional[Sequence[str]] = None, within_s: Optional[Mapping[str, float]] = None) -> float:
    """``T`` of a split: the slowest training rank plus the exchange of the ranks that train."""
    active = [r for r, n in enumerate(split) if n > 0]
    slowest = max(costs[r].at(split[r]) for r in active)
    return slowest + exchange_of(active, exchange_s, groups, within_s)


def _water_fill(total: int, ranks: Sequence[int], costs: Sequence[StepCost], minimum: int,
                caps: Sequence[Optional[int]], world: int) -> Optional[List[int]]:
    """The integer split of ``total`` over ``ranks`` that minimises the slowest ``a + b n``
    (every one of them at least ``minimum``, at most its cap); ``None`` if it cannot fit.

    The continuous optimum puts every free rank at one level ``T`` (ranks that would fall
    below the minimum or above their cap are pinned there); its floors are all at or below
    the integer optimum, and the samples left each go to the rank whose time they raise
    least, which is optimal for increasing linear costs.
    """
    if total < minimum * len(ranks):
        return None
    if all(caps[r] is not None for r in ranks) and sum(caps[r] for r in ranks) < total:
        return None
    pinned: Dict[int, int] = {}
    free = list(ranks)
    shares: Dict[int, float] = {}
    while free:
        left = total - sum(pinned.values())
        level = (left + sum(costs[r].fixed_s / costs[r].per_sample_s for r in free)) / sum(
            1.0 / costs[r].per_sample_s for r in free)
        shares = {r: (level - costs[r].fixed_s) / costs[r].per_sample_s for r in free}
        low = [r for r in free if shares[r] < minimum]
        high = [r for r in free if caps[r] is not None and shares[r] > caps[r]]
        if not low and not high:
            break
        for r in low:
            pinned[r] = minimum
        for r in high:
            pinned[r] = caps[r]
        free = [r for r in free if r not in pinned]
    split = [0] * world
    for r, n in pinned.items():
        split[r] = n
    for r in free:
        split[r] = max(minimum, int(math.floor(shares[r])))
    while sum(split) > total:  # pinned caps and minimums may overshoot: the slowest gives back
        r = max((r for r in ranks if split[r] > minimum), key=lambda r: (costs[r].at(split[r]), -r))
        split[r] -= 1
    while sum(split) < total:
        r = min((r for r in ranks if caps[r] is None or split[r] < caps[r]),
                key=lambda r: (costs[r].at(split[r] + 1), r))
        split[r] += 1
    return split


def halfway(old: Sequence[int], new: Sequence[int]) -> List[int]:
    """The integer split halfway from ``old`` to ``new`` (the same total; the samples that halving
    leaves go to the ranks with a half, lower ranks first). Between two splits that respect a
    minimum and caps, so does it."""
    target = [(a + b) / 2 for a, b in zip(old, new)]
    split = [math.floor(t) for t in target]
    halves = sorted(range(len(split)), key=lambda r: (split[r] - target[r], r))
    for r in halves[:sum(new) - sum(split)]:
        split[r] += 1
    return split


def _rank_order(candidate: Candidate) -> tuple:
    """The faster candidate first; on a tie, the one whose samples sit on lower ranks."""
    return candidate.predicted_s, tuple(-n for n in candidate.split)


def solve_split(
    global_batch: int,
    costs: Sequence[StepCost],
    groups: Sequence[str],
    exchange_s: float,
    current: Sequence[int],
    minimum: int = 1,
    caps: Optional[Sequence[Optional[int]]] = None,
    allow_bench: bool = False,
    training: Optional[Sequence[int]] = None,
    within_s: Optional[Mapping[str, float]] = None,
) -> SplitDecision:
    """The split of ``global_batch`` with the smallest predicted step.

    Args:
        global_batch: samples per step over all ranks.
        costs: each rank's step cost (all known).
        groups: each rank's vendor group (a group alone is always a candidate).
        exchange_s: the gradient exchange's time when ranks of several vendor groups train
            (of any two ranks or more without ``within_s``).
        within_s: per vendor group, the exchange's time when only ranks of that group train
            (a group not in it is charged nothing: it is tried, and measured).
        current: the split in use.
        minimum: the smallest batch of a rank that trains.
        caps: per-rank maximum batch (``None`` = no cap).
        allow_bench: a rank may get zero samples; otherwise every rank trains.
        training: only these ranks may train (default: all).

    Returns:
        The decision (the same on every rank for the same inputs).

    Raises:
        SplitError: no subset can hold the global batch.
    """
    world = len(costs)
    caps = [None] * world if caps is None else list(caps)
    allowed = list(range(world)) if training is None else sorted(training)
    if not allow_bench:
        subsets = [allowed]
    elif len(allowed) <= _EVERY_SUBSET:
        subsets = [list(c) for k in range(1, len(allowed) + 1) for c in itertools.combinations(allowed, k)]
    else:
        # Every set of whole groups; within it, the ranks sorted by their cost at an equal
        # share, each leading part.
        names = sorted(set(groups[r] for r in allowed))
        subsets = []
        for k in range(1, len(names) + 1):
            for chosen in itertools.combinations(names, k):
                ranks = [r for r in allowed if groups[r] in chosen]
                share = max(1, global_batch // len(ranks))
                ranks.sort(key=lambda r: (costs[r].at(share), r))
                subsets += [sorted(ranks[:m]) for m in range(1, len(ranks) + 1)]
        subsets += [[r for r in allowed if groups[r] == name] for name in names]  # each group alone
    best: Optional[Candidate] = None
    alone: Dict[str, float] = {}
    for ranks in subsets:
        split = _water_fill(global_batch, ranks, costs, minimum, caps, world)
        if split is None:
            continue
        candidate = Candidate(tuple(split), predicted_step(split, costs, exchange_s, groups, within_s))
        own = {groups[r] for r in ranks}
        if len(own) == 1 and len(ranks) == sum(1 for r in allowed if groups[r] in own):
            alone[own.pop()] = candidate.predicted_s
        if best is None or _rank_order(candidate) < _rank_order(best):
            best = candidate
    if best is None:
        raise SplitError(f"no set of ranks can hold the global batch {global_batch} (minimum {minimum}, caps {caps})")
    return SplitDecision(list(best.split), best.predicted_s,
                         predicted_step(current, costs, exchange_s, groups, within_s), alone)
