"""The pure rules of chunk claims (swarm/data/choice.py): which chunk a node picks, when its epoch
ends, and who wins a chunk two nodes claimed, as tables of cases."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from swarm.data.choice import HOLD, TAKE, YIELD, ClaimsSeen, Pick, contested, pick_next, settle, start_point
from swarm.data.claims import ClaimRecord
from swarm.p2p.identity import Identity

ME, A, B = (Identity.from_seed(bytes([i]) * 32).peer_id for i in (1, 2, 3))
N, NOW = 8, 1000.0


def bits(*chunks: int) -> np.ndarray:
    out = np.zeros(N, dtype=bool)
    out[list(chunks)] = True
    return out


def rec(owner, epoch=0, live=(), until=NOW + 30, done=None) -> ClaimRecord:
    return ClaimRecord(owner, epoch, tuple(live), until, done if done is not None else {epoch: bits()})


@dataclass
class Case:
    name: str
    records: tuple[ClaimRecord, ...] = ()
    done: tuple[int, ...] = ()
    held: tuple[tuple[int, float], ...] = ()
    after: int | None = None
    avoid: tuple[int, ...] = ()
    want: Pick | None = None  # None: check only that the chunk is the first free from the start point


CASES = [
    Case("an empty swarm: from our start point", want=Pick(0, start_point(ME, 0, N))),
    Case("after the chunk we trained last: the next one", after=3, want=Pick(0, 4)),
    Case("the next one wraps around", after=7, want=Pick(0, 0)),
    Case("peers' done chunks are skipped", records=(rec(A, done={0: bits(4, 5)}),), after=3, want=Pick(0, 6)),
    Case("our own done chunks are skipped", done=(4,), after=3, want=Pick(0, 5)),
    Case("a peer's live claim is skipped", records=(rec(A, live=[(4, NOW - 5)]),), after=3, want=Pick(0, 5)),
    Case("a lapsed claim is free again", records=(rec(A, live=[(4, NOW - 90)], until=NOW - 1),), after=3,
         want=Pick(0, 4)),
    Case("a claim of another epoch claims nothing in ours", records=(rec(A, epoch=1, live=[(4, NOW)]),), after=3,
         want=Pick(0, 4)),
    Case("done marks of another epoch count not", records=(rec(A, epoch=1, done={1: bits(4)}),), after=3,
         want=Pick(0, 4)),
    Case("our held chunks are not picked twice", held=((4, NOW),), after=3, want=Pick(0, 5)),
    Case("a chunk we just gave up is left to peers", avoid=(4,), after=3, want=Pick(0, 5)),
    Case("the last chunk, just given up: wait for a peer to take it", done=tuple(range(7)), avoid=(7,),
         want=Pick(0, None)),
    Case("all done: the next epoch, from its start point", done=tuple(range(N))),
    Case("the rest held by peers: wait (a dead claimant's chunks lapse to us)", done=tuple(range(6)),
         records=(rec(A, live=[(6, NOW - 10)]), rec(B, live=[(7, NOW - 10)])), want=Pick(0, None)),
    Case("ours are the last: wait for them, no new epoch", done=tuple(range(7)), held=((7, NOW),),
         want=Pick(0, None)),
    Case("done by peers whose records are in the next epoch already", done=tuple(range(6)),
         records=(rec(A, epoch=1, done={0: bits(6, 7), 1: bits()}),)),
    Case("in the next epoch, peers' claims there count", done=tuple(range(N)),
         records=(rec(A, epoch=1, live=[(c, NOW) for c in (0, 1)], done={0: bits(), 1: bits(*range(2, 8))}),),
         want=Pick(1, None, True)),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_pick_next(case: Case) -> None:
    seen = ClaimsSeen(ME, 0, bits(*case.done), case.held, case.records, NOW, case.after, avoid=frozenset(case.avoid))
    pick = pick_next(seen, N)
    if case.want is not None:
        assert pick == case.want
        return
    assert pick.epoch == 1 and pick.ended
    assert pick.chunk == start_point(ME, 1, N)


def test_a_new_claim_that_meets_a_peers_claim_yields() -> None:
    rival = rec(A, live=[(4, NOW - 1)])
    assert contested(ClaimsSeen(ME, 0, bits(), ((4, NOW),), (rival,), NOW), 0, frozenset({4, 5})) == {4}
    # a lapsed claim, or one of another epoch, contests nothing
    lapsed = rec(A, live=[(4, NOW - 99)], until=NOW - 1)
    other_epoch = rec(A, epoch=1, live=[(4, NOW)])
    for record in (lapsed, other_epoch):
        assert contested(ClaimsSeen(ME, 0, bits(), (), (record,), NOW), 0, frozenset({4})) == frozenset()
    # in the next epoch (a new epoch's first claim), that epoch's claims contest
    assert contested(ClaimsSeen(ME, 0, bits(), (), (other_epoch,), NOW), 1, frozenset({4})) == {4}


def test_after_a_yield_the_pick_starts_from_a_salted_point() -> None:
    none = np.zeros(1000, dtype=bool)
    picks = {pick_next(ClaimsSeen(ME, 0, none, (), (), NOW, None, salt), 1000).chunk for salt in range(8)}
    assert len(picks) == 8


def test_start_points_spread_nodes_over_the_chunks() -> None:
    points = {start_point(Identity.from_seed(bytes([i]) * 32).peer_id, 0, 1000) for i in range(16)}
    assert len(points) >= 14


def test_no_new_epoch_while_a_live_peer_is_an_epoch_behind() -> None:
    behind = rec(A, epoch=0, done={0: bits(*range(N))})
    seen = ClaimsSeen(ME, 1, bits(*range(N)), (), (behind,), NOW)
    assert pick_next(seen, N) == Pick(1, None)  # it still needs our done chunks of epoch 0
    lapsed = rec(A, epoch=0, until=NOW - 1, done={0: bits(*range(N))})
    assert pick_next(ClaimsSeen(ME, 1, bits(*range(N)), (), (lapsed,), NOW), N).epoch == 2


# our new claim on chunk 4 of epoch 0, dated NOW - 1, after the read that followed its store;
# `before`: None at its first read, else the rivals of the first read and their records' untils
AT = NOW - 1
FIRST_OF_A_TIE = min((ME, A), key=lambda p: p.to_bytes())
SETTLE = [
    ("first read, nobody else: ours", (), (), None, TAKE),
    ("first read, a peer marks it done (it trained it meanwhile)", (rec(A, done={0: bits(4)}),), (), None, YIELD),
    ("first read, done as far as we read before", (), (4,), None, YIELD),
    ("first read, a later claim: the tie-break names us, one more read", (rec(A, live=[(4, AT + 0.5)]),), (), None,
     HOLD),
    ("first read, an earlier claim wins", (rec(A, live=[(4, AT - 0.5)]),), (), None, YIELD),
    ("first read, the same time: the smaller PeerID", (rec(A, live=[(4, AT)]),), (), None,
     HOLD if FIRST_OF_A_TIE == ME else YIELD),
    ("first read, a lapsed claim is none", (rec(A, live=[(4, AT - 90)], until=NOW - 1),), (), None, TAKE),
    ("first read, a claim of another epoch is none", (rec(A, epoch=1, live=[(4, AT - 5)]),), (), None, TAKE),
    ("first read, several rivals, one earlier", (rec(A, live=[(4, AT + 1)]), rec(B, live=[(4, AT - 1)])), (),
     None, YIELD),
    ("second read, the rival still claims it", (rec(A, live=[(4, AT + 0.5)], until=NOW + 31),), (), {A: NOW + 30},
     YIELD),
    ("second read, the rival's newer record gave it up", (rec(A, until=NOW + 31),), (), {A: NOW + 30}, TAKE),
    ("second read, the rival's newer record marks it done", (rec(A, until=NOW + 31, done={0: bits(4)}),), (),
     {A: NOW + 30}, YIELD),
    ("second read, only the rival's older record (a stale replica)", (rec(A, until=NOW + 20),), (),
     {A: NOW + 30}, YIELD),
    ("second read, the rival's record not read at all", (), (), {A: NOW + 30}, YIELD),
    ("second read, one of two rivals not read again", (rec(A, until=NOW + 31), rec(B, until=NOW + 30)), (),
     {A: NOW + 30, B: NOW + 30}, YIELD),
    ("second read, the rival gave it up and moved to the next epoch", (rec(A, epoch=1, until=NOW + 31,
     done={0: bits(), 1: bits()}),), (), {A: NOW + 30}, TAKE),
]  # fmt: skip


@pytest.mark.parametrize("case", SETTLE, ids=[c[0] for c in SETTLE])
def test_settle_a_new_claim(case: tuple) -> None:
    _, records, done, before, want = case
    seen = ClaimsSeen(ME, 0, bits(*done), ((4, AT),), records, NOW)
    assert settle(seen, 0, 4, AT, before) == want


def test_settle_a_new_epochs_first_claim_against_that_epochs_records() -> None:
    all_done = bits(*range(N))
    ahead = rec(A, epoch=1, live=[(4, AT - 1)], done={0: all_done, 1: bits()})
    assert settle(ClaimsSeen(ME, 0, all_done, (), (ahead,), NOW), 1, 4, AT, None) == YIELD
    done_there = rec(A, epoch=1, done={0: all_done, 1: bits(4)})
    assert settle(ClaimsSeen(ME, 0, all_done, (), (done_there,), NOW), 1, 4, AT, None) == YIELD
    assert settle(ClaimsSeen(ME, 0, all_done, (), (rec(A, epoch=1, done={0: all_done, 1: bits()}),), NOW),
                  1, 4, AT, None) == TAKE  # fmt: skip
