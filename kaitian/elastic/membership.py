"""Who is in the job: the store protocol of :mod:`kaitian.elastic` (docs/elastic.md).

A *generation* is one process group over a list of members. Its :class:`Decision`
is decided once, by :func:`decide`, from what the survivors announced, and
written to the workers' store with ``compare_set``, so every member of the
generation reads the same decision. Agents read the same keys (:class:`JobRecord`)
to kill excluded workers and to mark exited ones gone.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

from kaitian.errors import ElasticError, SplitError

__all__ = [
    "Announcement", "Decision", "JobRecord", "Membership", "MemberLost", "decide", "node_of", "store_prefix",
]

_log = logging.getLogger(__name__)

_POLL_S = 0.01  # store polling while agreeing: short, the whole wait is bounded


def store_prefix(run: str) -> str:
    """Where one start of a worker group keeps its keys."""
    return f"kaitian/elastic/{run}/"


def node_of(member: str) -> str:
    """The node (agent) a member id ``<node>/<local rank>/<incarnation>`` belongs to."""
    return member.rsplit("/", 2)[0]


class MemberLost(Exception):
    """A member of the generation being formed is gone: agree on the next one."""


class _Record:
    """A dataclass that travels through the store as JSON."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str):
        return cls(**json.loads(raw))


@dataclass(frozen=True)
class Announcement(_Record):
    """What a member tells the decider of a generation.

    Attributes:
        id: its member id.
        applied: optimizer steps it applied; ``None`` for a joiner without the state.
        epoch: the epoch of its next step.
        step: the step within that epoch.
        share: its weight for the next split (its share of the last split).
        group: its vendor group (a joiner is weighted like its group).
        failure: the failure that broke its group ("": it is admitting joiners).
    """

    id: str
    applied: Optional[int]
    epoch: int = 0
    step: int = 0
    share: float = 0.0
    group: str = ""
    failure: str = ""



@dataclass(frozen=True)
class Decision(_Record):
    """One generation, the same for every member.

    Attributes:
        generation: its number (0: the launch world).
        members: member ids in rank order.
        split: the global batch cut per rank.
        source: the rank whose state every member takes (``-1``: all hold the same).
        applied, epoch, step: where training goes on (steps applied; the next step).
        excluded: members of the previous generation left out (gone or late).
        joiners_seen: joiners registered when the decision was made (all admitted or gone).
        error: why the job cannot go on ("" if it can).
    """

    generation: int
    members: List[str]
    split: List[int]
    source: int = -1
    applied: int = 0
    epoch: int = 0
    step: int = 0
    excluded: List[str] = field(default_factory=list)
    joiners_seen: int = 0
    error: str = ""



def decide(
    generation: int,
    expected: Sequence[str],
    announced: Dict[str, Announcement],
    gone: Iterable[str],
    joiners: Sequence[Announcement],
    global_batch: int,
    min_batch: int,
    min_nodes: int = 1,
    joiners_seen: int = 0,
) -> Decision:
    """The decision of ``generation``: who is in, in which order, with which split, from which state.

    Members are the previous generation's (``expected``, in their rank order)
    that announced and are not gone, then the joiners in the order they came
    (as many as the global batch can give ``min_batch`` each). Training goes
    on from the most steps any member applied; the first member that applied
    them (a training one where one is left) is the source of the state when
    members differ or one was benched. A group that failed while every
    member is still there lost nobody: a bug in the script (ranks
    issuing different collectives) or a peer slower than the timeout, which
    another generation would only repeat; the decision says so.

    Args:
        generation: the generation being decided.
        expected: the previous generation's members, in rank order.
        announced: announcements by member id.
        gone: ids of workers that exited (their agents said so).
        joiners: joiners registered since the previous decision, in order.
        global_batch: samples per step over all ranks.
        min_batch: the smallest batch a rank may get.
        min_nodes: ``--nnodes`` MIN.
        joiners_seen: joiners registered in all (the decision's ``joiners_seen``).

    Returns:
        The decision; ``error`` says why it cannot go on, if so.
    """
    from kaitian.training.split import proportional_split

    gone = set(gone)
    survivors = [announced[m] for m in expected if m in announced and m not in gone]
    taken = {a.id for a in survivors}
    fresh = [j for j in joiners if j.id not in gone and j.id not in taken and j.id not in expected]
    room = max(0, global_batch // max(1, min_batch) - len(survivors))
    members = survivors + fresh[:room]
    ids = [a.id for a in members]
    excluded = [m for m in expected if m not in ids]
    decision = Decision(generation, ids, [], excluded=excluded, joiners_seen=joiners_seen)
    holders = [a for a in members if a.applied is not None]
    if not holders:
        return _failed(decision, "no member holds the training state (every worker that trained was lost)")
    # a benched rank (no share) sees the group end under its wait for state: a symptom, not a failure
    failures = [a.failure for a in survivors if a.failure and a.share > 0]
    if failures and not excluded:
        return _failed(decision, f"the process group failed but no member was lost: {failures[0]}")
    nodes = {node_of(m) for m in ids}
    if len(nodes) < min_nodes:
        return _failed(decision, f"only {len(nodes)} node(s) left, below --nnodes MIN={min_nodes}")
    best = max(a.applied for a in holders)
    # A benched rank's state is its copy of the epoch's end, which left the optimizer step before the
    # loop's own steps after it (a per-step LR schedule, a GradScaler's update): a trainer's is live.
    current = [a for a in holders if a.applied == best]
    lead = next((a for a in current if a.share > 0), current[0])
    shares = [a.share for a in holders if a.share > 0]
    mean = sum(shares) / len(shares) if shares else 1.0
    weights = [a.share if a.applied is not None and a.share > 0 else _group_mean(a.group, holders, mean)
               for a in members]
    try:
        split = proportional_split(global_batch, weights, minimum=min_batch)
    except SplitError as e:
        return _failed(decision, f"cannot split the global batch over {len(members)} members: {e}")
    transfer = any(a.applied != best or a.share == 0 for a in members if a is not lead)
    return Decision(generation, ids, split, source=ids.index(lead.id) if transfer else -1, applied=best,
                epoch=lead.epoch, step=lead.step, excluded=excluded, joiners_seen=joiners_seen)


def _group_mean(group: str, holders: Sequence[Announcement], fallback: float) -> float:
    same = [a.share for a in holders if a.group == group and a.share > 0]
    return sum(same) / len(same) if same else fallback


def _failed(decision: Decision, why: str) -> Decision:
    return Decision(decision.generation, decision.members, decision.split, excluded=decision.excluded,
                joiners_seen=decision.joiners_seen, error=why)


class JobRecord:
    """The job's keys in the workers' store, read and written by workers and agents.

    Args:
        store: a client of the workers' store.
        run: the worker group's start (``KAITIAN_ELASTIC_RUN``).
    """

    def __init__(self, store, run: str) -> None:
        self.store = store
        self.prefix = store_prefix(run)

    def key(self, name: str) -> str:
        return self.prefix + name

    def _get(self, name: str) -> Optional[str]:
        key = self.key(name)
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key)).decode()

    def _list(self, name: str) -> List[str]:
        raw = self._get(name)
        return [line for line in raw.split("\n") if line] if raw else []

    def _append(self, name: str, line: str) -> None:
        self.store.append(self.key(name), line + "\n")

    # -- what agents write and read ------------------------------------------

    def mark_gone(self, member: str) -> None:
        """An agent saw ``member`` exit."""
        self._append("gone", member)

    def gone(self) -> set:
        return set(self._list("gone"))

    def latest(self) -> int:
        """The newest generation with a decision (-1 before the first)."""
        raw = self._get("latest")
        return int(raw) if raw else -1

    def decision(self, generation: int) -> Optional[Decision]:
        raw = self._get(f"decision/{generation}")
        return Decision.from_json(raw) if raw else None

    def stop_reason(self) -> str:
        """Why the job cannot go on ("" while it can)."""
        return self._get("stop") or ""

    def done(self) -> bool:
        """Training is over (waiting joiners leave)."""
        return self._get("done") is not None

    def finished(self) -> set:
        return set(self._list("finished"))

    # -- what members write ----------------------------------------------------

    def publish(self, decision: Decision) -> Decision:
        """Writes ``decision`` unless one exists for its generation; returns the one that counts."""
        key = self.key(f"decision/{decision.generation}")
        mine = decision.to_json()
        won = bytes(self.store.compare_set(key, "", mine)).decode()
        chosen = Decision.from_json(won)
        self.note_latest(chosen.generation)
        if chosen.error:
            self.store.set(self.key("stop"), chosen.error)
        return chosen

    def note_latest(self, generation: int) -> None:
        if generation > self.latest():
            self.store.set(self.key("latest"), str(generation))


class Membership(JobRecord):
    """One member's side of the protocol.

    Args:
        store: a client of the workers' store.
        run: the worker group's start.
        me: this member's id.
        quorum_timeout: how long to wait for a member that neither announced
            nor is gone (a stopped worker, a lost node) before deciding without it.
    """

    def __init__(self, store, run: str, me: str, quorum_timeout: float) -> None:
        super().__init__(store, run)
        self.me = me
        self.quorum_timeout = float(quorum_timeout)

    def launch(self, rank: int, world: int, timeout: float) -> Decision:
        """Generation 0: the launch world, in launch-rank order (every launch worker calls it)."""
        self.store.set(self.key(f"hello/{rank}"), self.me)
        keys = [self.key(f"hello/{r}") for r in range(world)]
        _wait_keys(self.store, keys, timeout)
        members = [bytes(v).decode() for v in self.store.multi_get(keys)]
        decision = Decision(0, members, [])  # the launch split is the sampler's (capabilities)
        if rank == 0:
            decision = self.publish(decision)
        return decision

    def announcements(self, generation: int) -> Dict[str, Announcement]:
        out = {}
        for line in self._list(f"alive/{generation}"):
            a = Announcement.from_json(line)
            out[a.id] = a
        return out

    def announced(self, generation: int) -> bool:
        """Whether a member announced itself for ``generation`` (one cheap store request)."""
        return bool(self.store.check([self.key(f"alive/{generation}")]))

    def joiners(self) -> List[Announcement]:
        return [Announcement.from_json(line) for line in self._list("joiners")]

    def joiner_count(self) -> int:
        """Joiners registered so far (one cheap store request: rank 0 asks at commits)."""
        return int(self.store.add(self.key("joiner_count"), 0))

    def agree(self, generation: int, expected: Sequence[str], mine: Announcement,
              global_batch: int, min_batch: int, min_nodes: int, joiners_before: int) -> Decision:
        """Announces ``mine`` and returns the decision of ``generation`` (decided here or by another member).

        The first member that sees every expected member announced or gone
        decides; otherwise the first announced member decides after the quorum
        deadline, the next one a deadline later (in case the first died too), ...
        Joiners registered after the first ``joiners_before`` are admitted.
        """
        self._append(f"alive/{generation}", mine.to_json())
        start = time.monotonic()
        while True:
            decision = self.decision(generation)
            if decision is not None:
                self.note_latest(generation)
                return decision
            announced, gone = self.announcements(generation), self.gone()
            complete = all(m in announced or m in gone for m in expected)
            live = [m for m in expected if m in announced and m not in gone]
            turn = live.index(self.me) if self.me in live else len(live)
            if complete or time.monotonic() - start > self.quorum_timeout * (1 + turn):
                joiners = self.joiners()
                decided = decide(generation, expected, announced, gone, joiners[joiners_before:],
                                 global_batch, min_batch, min_nodes, joiners_seen=len(joiners))
                return self.publish(decided)
            time.sleep(_POLL_S)

    def ready(self, decision: Decision) -> None:
        """Waits until every member of ``decision`` is ready to build its group.

        Raises:
            MemberLost: a member is gone, or not ready within the quorum deadline.
        """
        self._append(f"ready/{decision.generation}", self.me)
        start = time.monotonic()
        while True:
            gone = [m for m in decision.members if m in self.gone()]
            if gone:
                raise MemberLost(f"{', '.join(gone)} left while generation {decision.generation} was forming")
            ready = set(self._list(f"ready/{decision.generation}"))
            if all(m in ready for m in decision.members):
                return
            if time.monotonic() - start > self.quorum_timeout:
                late = [m for m in decision.members if m not in ready]
                raise MemberLost(f"{', '.join(late)} not ready within {self.quorum_timeout:g} s "
                                 f"for generation {decision.generation}")
            time.sleep(_POLL_S / 2)

    def register_joiner(self, mine: Announcement) -> None:
        self._append("joiners", mine.to_json())
        self.store.add(self.key("joiner_count"), 1)

    def await_admission(self, poll_s: float = 0.05) -> Optional[Decision]:
        """A joiner: the first decision that includes it, or ``None`` once training is over.

        Raises:
            ElasticError: the job cannot go on.
        """
        checked = self.latest()
        while True:
            latest = self.latest()
            for generation in range(checked + 1, latest + 1):
                decision = self.decision(generation)
                if decision is not None and self.me in decision.members:
                    return decision
            checked = max(checked, latest)
            reason = self.stop_reason()
            if reason:
                raise ElasticError(f"kaitian elastic: the job cannot go on: {reason}")
            if self.done():
                return None
            time.sleep(poll_s)

    def finish(self, rank: int) -> None:
        """Training is over for this member (rank 0 also ends it for waiting joiners)."""
        self._append("finished", self.me)
        if rank == 0:
            self.store.set(self.key("done"), "1")


def _wait_keys(store, keys: List[str], timeout: float) -> None:
    from datetime import timedelta

    store.wait(keys, timedelta(seconds=timeout))
