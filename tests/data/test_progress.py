"""EpochProgress (swarm/data/progress.py): the swarm's way through its data from the run's claim
records, as inspect, the dashboard and the metrics show it; records are untrusted and bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest

from swarm.data.chunks import CHUNK_TOKENS
from swarm.data.claims import ClaimRecord, encode_claim
from swarm.data.progress import EpochProgress, credited_tokens, progress_of, read_progress
from swarm.dht.id_proof import solve
from swarm.dht.records import owner_subkey
from swarm.p2p.identity import Identity

pytestmark = pytest.mark.timeout(30)
N, NOW, BITS = 10, 1_000_000.0, 4
PEERS = [Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 8)]


def bits(*chunks: int, n: int = N) -> np.ndarray:
    done = np.zeros(n, dtype=bool)
    done[list(chunks)] = True
    return done


def rec(i: int, epoch: int, done: dict[int, np.ndarray], tokens: int = 0, live: int = 0) -> ClaimRecord:
    claims = tuple((c, NOW - 1) for c in range(live))
    return ClaimRecord(PEERS[i], epoch, claims, NOW + 30 if live else NOW - 1, done, tokens)


CASES = [
    # (records, expected (epoch, chunks_done, tokens, nodes, claiming))
    ([rec(0, 0, {0: bits(0, 1)}, 2000, live=1)], (0, 2, 2000, 1, 1)),
    # two nodes of one epoch: their done chunks add up, and their tokens
    ([rec(0, 1, {1: bits(0, 1, 2)}, 3000), rec(1, 1, {1: bits(5, 6)}, 2000, live=2)], (1, 5, 5000, 2, 1)),
    # one node moved on: the epoch stays while most are in the old one; its done marks of the old count
    (
        [
            rec(0, 0, {0: bits(0, 1)}, 10),
            rec(1, 0, {0: bits(2)}, 10),
            rec(2, 1, {1: bits(), 0: bits(*range(3, 10))}, 10),
        ],
        (0, 10, 20, 3, 0),
    ),
    # most moved on: the new epoch
    ([rec(0, 1, {1: bits(0)}, 10), rec(1, 1, {1: bits(1)}, 10), rec(2, 0, {0: bits(3)}, 10)], (1, 2, 20, 3, 0)),
    # a liar far ahead among honest nodes does not move the epoch
    ([rec(0, 2, {2: bits(0)}, 7), rec(1, 2, {2: bits(1)}, 7), rec(2, 999, {999: bits()}, 0)], (2, 2, 14, 3, 0)),
    # a record's tokens are at most a whole chunk for each chunk it trained or holds
    ([rec(0, 0, {0: bits(4)}, 1 << 60, live=1)], (0, 1, 2 * CHUNK_TOKENS, 1, 1)),
    ([rec(0, 0, {0: bits()}, 5)], (0, 0, 0, 1, 0)),  # a record that trained nothing trained no tokens
]


@pytest.mark.parametrize(("records", "expected"), CASES)
def test_progress_of_records(records: list[ClaimRecord], expected: tuple[int, int, int, int, int]) -> None:
    p = progress_of(records, N, NOW)
    assert p is not None
    assert (p.epoch, p.chunks_done, p.tokens, p.nodes, p.claiming) == expected
    assert p.chunks == N and p.share == pytest.approx(expected[1] / N)


def test_no_record_no_progress() -> None:
    assert progress_of([], N, NOW) is None
    assert read_progress([], id_bits=BITS, max_records=10, now=NOW) is None
    assert read_progress([("not-owned", {"n": N})], id_bits=BITS, max_records=10, now=NOW) is None


def test_credited_tokens_counts_live_claims_only_while_they_hold() -> None:
    held = rec(0, 0, {0: bits()}, 10 * CHUNK_TOKENS, live=2)
    assert credited_tokens(held, NOW) == 2 * CHUNK_TOKENS
    assert credited_tokens(held, NOW + 60) == 0  # lapsed: it holds nothing


def entry(i: int, record: ClaimRecord, n: int = N, proof_bits: int = BITS) -> tuple[object, object]:
    return owner_subkey(PEERS[i]), encode_claim(record, n, solve(PEERS[i], proof_bits))


def test_read_progress_counts_proven_records_of_the_runs_plan_up_to_the_key_limit() -> None:
    now = time.time()
    honest = [
        entry(0, ClaimRecord(PEERS[0], 1, ((4, now),), now + 30, {1: bits(0, 1, 2)}, 3000)),
        entry(1, ClaimRecord(PEERS[1], 1, (), now - 1, {1: bits(5, 6)}, 2000)),
        entry(2, ClaimRecord(PEERS[2], 1, (), now - 1, {1: bits(7)}, 1000)),
    ]
    liars = [
        entry(3, ClaimRecord(PEERS[3], 1, (), now - 1, {1: bits(8, 9)}, 2000), proof_bits=0),  # a free id
        entry(4, ClaimRecord(PEERS[4], 0, (), now - 1, {0: bits(0, n=12)}, 1), n=12),  # another plan
        ("not-owned", {"n": N, "epoch": 1}),
        (owner_subkey(PEERS[5]), {"n": N, "epoch": "x"}),  # malformed
    ]
    p = read_progress([*honest, *liars], id_bits=BITS, max_records=100, now=now)
    assert p == EpochProgress(epoch=1, chunks_done=6, chunks=N, tokens=6000, nodes=3, claiming=1)
    assert p.wire() == {"epoch": 1, "chunks_done": 6, "chunks": N, "share": 0.6, "tokens": 6000, "nodes": 3,
                        "claiming": 1}  # fmt: skip
    # a reply longer than the key's subkey limit is read only that far
    cut = read_progress([*honest, *liars], id_bits=BITS, max_records=1, now=now)
    assert cut is not None and (cut.nodes, cut.chunks_done, cut.tokens) == (1, 3, 3000)
    # more records of another plan than of ours: theirs is the plan shown, ours count for nothing
    others = [entry(i, ClaimRecord(PEERS[i], 0, (), now - 1, {0: bits(i, n=12)}, 1), n=12) for i in (4, 5, 6)]
    p = read_progress([*honest, *others], id_bits=BITS, max_records=100, now=now)
    assert p is not None and (p.chunks, p.nodes) == (12, 3)
