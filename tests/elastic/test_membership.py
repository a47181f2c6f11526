"""The decision of a generation (``kaitian.elastic.membership.decide``) and the quorum
protocol over a real c10d store, without processes."""

import threading
import time
import torch.distributed as dist

from kaitian.elastic.membership import Announcement, Membership, decide


def _a(member, applied, share=0.5, group="cpu0", failure="lost", epoch=0, step=None):
    return Announcement(member, applied, epoch, applied if step is None and applied is not None else (step or 0),
                        share, group, failure)


def test_survivors_in_old_rank_order_redo_the_step_in_flight_re_split_by_share():
    expected = ["n/0/0", "n/1/0", "n/2/0"]
    announced = {m: _a(m, 7, share=s) for m, s in (("n/2/0", 0.25), ("n/0/0", 0.5))}
    decision = decide(1, expected, announced, gone={"n/1/0"}, joiners=[], global_batch=48, min_batch=1)
    assert decision.members == ["n/0/0", "n/2/0"] and decision.excluded == ["n/1/0"] and not decision.error
    assert decision.split == [32, 16] and decision.applied == 7 and decision.source == -1  # same state: nothing sent


def test_a_survivor_one_step_behind_takes_the_state_of_the_first_that_applied_it():
    """The lost rank died inside the commit: rank 1 applied step 8, rank 0 did not."""
    announced = {"n/0/0": _a("n/0/0", 7), "n/1/0": _a("n/1/0", 8), "n/2/0": _a("n/2/0", 8)}
    decision = decide(1, ["n/0/0", "n/1/0", "n/2/0", "n/3/0"], announced, gone={"n/3/0"}, joiners=[],
                  global_batch=48, min_batch=1)
    assert decision.members == ["n/0/0", "n/1/0", "n/2/0"]
    assert decision.applied == 8 and decision.step == 8 and decision.source == 1  # everyone continues from step 8, once


def test_joiners_are_weighted_like_their_vendor_group_and_get_the_state():
    announced = {"n/0/0": _a("n/0/0", 3, share=0.75, group="cpu0", failure=""),
                 "n/1/0": _a("n/1/0", 3, share=0.25, group="cpu1", failure="")}
    joiners = [Announcement("n/2/1", None, group="cpu1"), Announcement("m/0/0", None, group="cuda")]
    decision = decide(2, ["n/0/0", "n/1/0"], announced, gone=set(), joiners=joiners, global_batch=70, min_batch=1,
                  joiners_seen=2)
    assert decision.members == ["n/0/0", "n/1/0", "n/2/1", "m/0/0"] and decision.joiners_seen == 2
    assert decision.split == [30, 10, 10, 20]  # the cpu1 joiner like cpu1 (0.25), a new vendor like the mean (0.5)
    assert decision.source == 0 and not decision.error


def test_what_cannot_go_on_says_why():
    lost_all = decide(3, ["n/0/0"], {}, gone={"n/0/0"}, joiners=[Announcement("n/0/1", None)],
                      global_batch=8, min_batch=1)
    assert "no member holds the training state" in lost_all.error
    one_node = decide(1, ["a/0/0", "b/0/0"], {"a/0/0": _a("a/0/0", 2)}, gone={"b/0/0"}, joiners=[],
                      global_batch=8, min_batch=1, min_nodes=2)
    assert one_node.error == "only 1 node(s) left, below --nnodes MIN=2"
    nobody_lost = decide(1, ["a/0/0", "a/1/0"], {m: _a(m, 2, failure="ranks issued different collectives")
                                                 for m in ("a/0/0", "a/1/0")}, gone=set(), joiners=[],
                         global_batch=8, min_batch=1)
    assert nobody_lost.error.startswith("the process group failed but no member was lost: ranks issued")


def test_a_benched_rank_called_back_by_a_joiner_is_no_failure_and_takes_the_state():
    """Joiners make the trainers re-form: the benched rank (no share) saw its wait end, which is
    no failure of the group; it trains again, weighted like the others, from the live state."""
    announced = {"n/0/0": _a("n/0/0", 12, share=1.0, failure=""),
                 "n/1/0": _a("n/1/0", 10, share=0.0, group="cpu1", failure="the members agree on generation 1")}
    decision = decide(1, ["n/0/0", "n/1/0"], announced, gone=set(), joiners=[Announcement("n/2/0", None)],
                  global_batch=48, min_batch=1, joiners_seen=1)
    assert not decision.error and decision.members == ["n/0/0", "n/1/0", "n/2/0"]
    assert decision.split == [16, 16, 16] and decision.source == 0 and decision.applied == 12


def test_a_benched_rank_as_far_as_the_trainers_still_takes_their_live_state():
    """A trainer is lost between an epoch's last step and the next epoch start's word: the benched
    rank took that epoch's end (as many steps as the trainers), but its copy left the optimizer step
    before the schedule's step after it; it takes the live state of a training rank even when it
    comes first, and its own copy only when no trainer is left."""
    announced = {"n/0/0": _a("n/0/0", 10, share=0.0, group="cpu1"), "n/1/0": _a("n/1/0", 10, share=0.5)}
    decision = decide(1, ["n/0/0", "n/1/0", "n/2/0"], announced, gone={"n/2/0"}, joiners=[], global_batch=48,
                      min_batch=1)
    assert decision.members == ["n/0/0", "n/1/0"] and decision.applied == 10 and decision.source == 1
    alone = decide(1, ["n/0/0", "n/1/0"], {"n/0/0": announced["n/0/0"]}, gone={"n/1/0"}, joiners=[],
                   global_batch=48, min_batch=1)
    assert alone.members == ["n/0/0"] and alone.source == -1 and not alone.error


def test_quorum_waits_for_a_silent_member_then_the_lowest_survivor_decides_once():
    store = dist.HashStore()
    decisions, began = {}, time.monotonic()

    def member(me):
        m = Membership(store, "0", me, quorum_timeout=0.5)
        decisions[me] = (m.agree(1, ["n/0/0", "n/1/0", "n/2/0"], _a(me, 4), 48, 1, 1, 0), time.monotonic() - began)

    threads = [threading.Thread(target=member, args=(me,)) for me in ("n/0/0", "n/2/0")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    (decision, waited), (other, _) = decisions["n/0/0"], decisions["n/2/0"]
    assert decision == other  # one decision for the generation
    assert decision.members == ["n/0/0", "n/2/0"] and decision.excluded == ["n/1/0"]
    assert waited >= 0.5  # nobody marked n/1/0 gone: the deadline passed first


def test_a_member_marked_gone_is_decided_without_waiting():
    m = Membership(dist.HashStore(), "0", "n/0/0", quorum_timeout=30.0)
    m.mark_gone("n/1/0")
    began = time.monotonic()
    decision = m.agree(1, ["n/0/0", "n/1/0"], _a("n/0/0", 4), 48, 1, 1, 0)
    assert decision.members == ["n/0/0"] and time.monotonic() - began < 5 and m.latest() == 1
