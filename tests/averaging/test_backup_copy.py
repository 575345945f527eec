"""A backup taking over a dead owner's part takes a copy of the owner's result only when two
members hold it (rounds/confirm.py, `vouched`): one lying member cannot put a part of its
choosing in the round by offering the backup a copy nobody else holds."""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any

import msgpack
import pytest
import torch

from swarm.averaging.errors import AllReduceError
from swarm.averaging.rounds import flat
from swarm.averaging.rounds.confirm import Decision, vouched
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.grid import GridRound
from swarm.averaging.rounds.partition import payload_layout
from swarm.p2p.handlers import CallContext
from swarm.p2p.stream import Stream
from tests.averaging.rounds import EXACT, MakeGroup, exact_mean, int8_bound
from tests.averaging.test_hierarchical import two_stage_int8_bound

A, B = ("a", (0, 1)), ("b", (0, 1))


@pytest.mark.parametrize(
    ("counts", "pending", "asked", "kind", "why"),
    [
        ({}, 4, 4, "open", "nobody answered yet"),
        ({A: 1}, 3, 4, "open", "one copy: a second member may still hold it"),
        ({A: 1}, 0, 4, "none", "one copy and nobody left to vouch for it: one liar is enough to send it"),
        ({A: 1, B: 1}, 0, 4, "none", "two members disagree: neither is believed"),
        ({A: 2}, 2, 4, "adopt", "two members hold the same copy"),
        ({A: 2, B: 1}, 0, 4, "adopt", "a liar beside two honest holders"),
        ({}, 0, 4, "none", "nobody holds one: reduce it again"),
        ({A: 1}, 0, 1, "adopt", "the only member it can ask (a group of three)"),
        ({}, 0, 0, "none", "nobody to ask"),
    ],
)
def test_vouched(counts: dict[object, int], pending: int, asked: int, kind: str, why: str) -> None:
    assert vouched(counts, pending, asked) == Decision(kind), why


def lie(round_: Any, method: str, dead: int, asked: dict[str, int], lo: int, hi: int) -> None:
    """Answer a plain request of `method` whose args include `asked` with a copy of the dead
    owner's result that nobody received: a part of the liar's choosing (all 100s), said to
    include every live member."""
    honest = getattr(round_, method)
    codec, chunk = round_.codec, round_.config.chunk_elements
    fake = torch.full((hi - lo,), 100.0)
    layout = payload_layout(0, hi - lo, chunk, codec.encoded_nbytes)
    payload = torch.cat([torch.as_tensor(codec.encode(fake[a:b])).view(-1) for a, b, _ in layout])
    included = [i for i in range(len(round_.group.members)) if i != dead]

    async def serve(ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        if any(args.get(k) != v for k, v in asked.items()) or args.get("d"):
            await honest(ctx, args, stream)
            return
        await stream.write(msgpack.packb({"inc": included}))
        await stream.write(memoryview(payload.numpy()))
        await stream.end()

    setattr(round_, method, serve)


@pytest.mark.timeout(60)
async def test_a_lying_member_cannot_hand_the_backup_a_dead_owners_part(make_group: MakeGroup) -> None:
    n, dead, liar = 5, 2, 4  # member 3 is the dead owner's backup
    group, members = await make_group(n, block_size=1024, chunk_elements=4096, part_timeout=3.0, **EXACT)
    gen = torch.Generator().manual_seed(7)
    vectors = [torch.randn(20_000, generator=gen) for _ in range(n)]
    rounds = [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    lo, hi = rounds[0].parts[dead]
    lie(rounds[liar], "serve_fetch", dead, {"p": dead}, lo, hi)
    await members[dead].host.close()
    outcomes = await asyncio.gather(*(r.run() for i, r in enumerate(rounds) if i != dead))
    results = [o[0] for o in outcomes]
    assert all(torch.equal(r, results[0]) for r in results), "the members disagree"
    live = [i for i in range(n) if i != dead]
    mean = exact_mean([v[lo:hi] for v in vectors], group, live)
    error = (results[0][lo:hi].double() - mean).abs().max().item()
    assert error <= int8_bound([v[lo:hi] for v in vectors], mean), "the round took the liar's copy of the part"


@pytest.mark.timeout(60)
async def test_a_lying_member_cannot_hand_a_grid_backup_a_dead_owners_sub_part(make_group: MakeGroup) -> None:
    n, dead, liar = 12, 5, 1  # (1, 1) dies; (2, 1) takes its sub-part over; (0, 1) lies
    group, members = await make_group(n, max_group_size=4, block_size=1024, chunk_elements=4096, part_timeout=2.0,
                                      bandwidths=[100.0] * n, **EXACT)  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    vectors = [torch.randn(50_003, generator=gen) for _ in range(n)]
    rounds = [GridRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    grid = rounds[0].grid
    assert grid.owners[1][1] == dead
    lo, hi = grid.subs[1][1]
    key = 1 * grid.rows + 1
    lie(rounds[liar], "serve_fetch", dead, {"p": key}, lo, hi)
    lie(rounds[liar], "serve_down", dead, {"p": 1, "s": 1}, lo, hi)  # as an owner of the column
    await members[dead].host.close()
    outcomes = await asyncio.gather(*(r.run() for i, r in enumerate(rounds) if i != dead))
    results = [o[0] for o in outcomes]
    assert all(torch.equal(r, results[0]) for r in results), "the members disagree"
    included = outcomes[0][1].contributions[key]
    assert dead not in included
    mean = exact_mean([v[lo:hi] for v in vectors], group, included)
    error = (results[0][lo:hi].double() - mean).abs().max().item()
    bound = two_stage_int8_bound([vectors[i][lo:hi] for i in included], mean)
    assert error <= bound, "the round took the liar's copy of the sub-part"


async def owner_dies_while_two_decode(
    make_group: MakeGroup, decode_s: float, part_timeout: float, request_timeout: float
) -> tuple[list[AllReduceRound], list[Any]]:
    """A group of 5: the owner of part 2 answers members 0 and 1, then dies before 3 and 4 reach
    it; 0 and 1 take `decode_s` to decode its answer (a busy machine). 3 is the part's backup, and
    4's. The rounds and their outcomes (the dead owner's an exception)."""
    n, dead = 5, 2
    group, members = await make_group(n, block_size=1024, chunk_elements=4096, part_timeout=part_timeout,
                                      request_timeout=request_timeout, **EXACT)  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    vectors = [torch.randn(20_000, generator=gen) for _ in range(n)]
    rounds = [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    lo = rounds[0].parts[dead][0]
    answered, holders = asyncio.Event(), {0, 1}
    owner_closed: list[asyncio.Task[None]] = []

    def slow_decode(r: AllReduceRound) -> None:
        honest = r._decode_into

        def decode(payload: memoryview, a: int, b: int) -> None:
            if a == lo:  # the dead owner's part
                time.sleep(decode_s)
            honest(payload, a, b)

        r._decode_into = decode  # type: ignore[method-assign]

    def exchange(r: AllReduceRound, me: int) -> None:
        honest = r._exchange

        async def patched(reducer: int, j: int) -> Any:
            if j == dead and me in holders:
                final = await honest(reducer, j)
                holders.discard(me)
                if not holders:
                    answered.set()  # both have the owner's answer and are decoding it
                return final
            if j == dead and reducer == dead:  # 3 and 4 reach the owner only once it has died
                await answered.wait()
                if not owner_closed:
                    owner_closed.append(asyncio.ensure_future(members[dead].host.close()))
                await owner_closed[0]
            return await honest(reducer, j)

        r._exchange = patched  # type: ignore[method-assign]

    for i, r in enumerate(rounds):
        if i in (0, 1):
            slow_decode(r)
        if i != dead:
            exchange(r, i)
    outcomes = await asyncio.gather(*(r.run() for r in rounds), return_exceptions=True)
    return rounds, [o for i, o in enumerate(outcomes) if i != dead]


@pytest.mark.timeout(60)
async def test_a_backup_waits_for_the_copies_its_dead_owners_answer_is_still_bringing(make_group: MakeGroup) -> None:
    """When the backup (3) asks for copies, 0 and 1 are still decoding the dead owner's answer:
    they answer with their copy once they hold it, not "none" at once, so the backup takes the
    owner's result and the five end with one result (answered at once, the backup reduced the
    part again without 0 and 1, and the round ended with two results, as a 60-minute soak split
    7 + 20)."""
    rounds, live = await owner_dies_while_two_decode(make_group, decode_s=1.0, part_timeout=2.0, request_timeout=3.0)
    assert not [o for o in live if isinstance(o, BaseException)], live
    results = [o[0] for o in live]
    lo, hi = rounds[0].parts[2]
    assert all(torch.equal(r[lo:hi], results[0][lo:hi]) for r in results), "two results of the dead owner's part"
    assert all(torch.equal(r, results[0]) for r in results), "the members disagree"
    assert sorted(live[3][1].contributions[2]) == [0, 1, 2]  # the owner's own result


@pytest.mark.timeout(60)
async def test_a_sender_waits_for_its_backup_while_the_backup_waits_for_copies(make_group: MakeGroup) -> None:
    """The copies take longer to come (2.5 s of decoding) than a sender waits for an owner's
    answer (2 part timeouts: 2 s). Member 4, whose part went to the backup (3), waits for 3's
    answer through 3's ask for copies, and takes the part from 3: it does not go on to the next
    backup (itself), which would ask again and could reduce the part from other contributions."""
    rounds, live = await owner_dies_while_two_decode(make_group, decode_s=2.5, part_timeout=1.0, request_timeout=4.0)
    assert not [o for o in live if isinstance(o, BaseException)], live
    assert rounds[4].reducer_of[2] == 3, "member 4 gave up on the backup and took the part over itself"
    results = [o[0] for o in live]
    assert all(torch.equal(r, results[0]) for r in results), "the members disagree"
    assert sorted(live[3][1].contributions[2]) == [0, 1, 2]  # the owner's own result, vouched for by 0 and 1


@pytest.mark.timeout(60)
async def test_a_member_still_waiting_for_a_stalled_owner_says_none_at_once(make_group: MakeGroup) -> None:
    """The owner of part 2 is stalled (a paused process: its streams open, no answer comes). A
    member whose own exchange with it is still waiting holds no copy: asked by a backup, it says
    so at once, not after request_timeout. (Waiting there, a backup in a soak outlasted its
    senders' patience; they went to the next backup, and the part got two results.)"""
    n, stalled = 4, 2
    group, members = await make_group(n, block_size=1024, chunk_elements=4096, part_timeout=10.0,
                                      request_timeout=20.0, **EXACT)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    rounds = [AllReduceRound(m.host, m.registry, group, torch.randn(20_000, generator=gen), m.config)
              for m in members]  # fmt: skip
    hang, waiting = asyncio.Event(), asyncio.Event()

    async def stall(ctx: CallContext, args: dict[str, Any], stream: Stream) -> None:
        waiting.set()
        await hang.wait()

    rounds[stalled].serve_part = stall  # type: ignore[method-assign]
    runs = [asyncio.ensure_future(r.run()) for r in rounds]
    try:
        await asyncio.wait_for(waiting.wait(), 10)
        began = time.monotonic()
        with pytest.raises(AllReduceError):
            await rounds[3].fetch_result(0, stalled)  # member 0's exchange with the owner is waiting
        assert time.monotonic() - began < 5.0, "a member waiting on a stalled owner held a backup's ask"
    finally:
        hang.set()
        for run in runs:
            run.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


READING_OWNER = contextvars.ContextVar[int | None]("reading_owner", default=None)
WRITING_OWNER = contextvars.ContextVar[int | None]("writing_owner", default=None)


@pytest.mark.timeout(60)
async def test_a_backup_waits_for_copies_of_a_live_owners_answer_still_streaming(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner of part 2 is alive and streams its answer; member 4's slice comes to it a second
    late (a busy machine), so the answer 0 and 1 are reading waits mid-way for it. Members 3 and
    4 give up on that answer meanwhile (their reads stalled), and 3, the part's backup, takes it
    over. Asked for copies, 0 and 1 answer once they hold the owner's result, not "none" at once:
    the backup takes that result, and the five end with one. (Answered at once, the backup
    reduced the part again from 3's and 4's slices, and the round ended with two results, as a
    60-minute soak's round of 12 split 7 + 4.)"""
    n, owner, backup, late = 5, 2, 3, 4
    group, members = await make_group(n, block_size=1024, chunk_elements=1024, part_timeout=2.0,
                                      request_timeout=4.0, **EXACT)  # fmt: skip
    gen = torch.Generator().manual_seed(13)
    vectors = [torch.randn(20_000, generator=gen) for _ in range(n)]
    rounds = [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    answering: set[int] = set()  # the members whose read of the owner's answer has its header
    both_answering = asyncio.Event()
    read_header, write_encoded = flat.read_header, flat.write_encoded

    async def noting_header(stream: Stream, timeout: float) -> Any:
        found = await read_header(stream, timeout)
        if (me := READING_OWNER.get()) is not None:
            answering.add(me)
            if answering >= {0, 1}:
                both_answering.set()
        return found

    async def writing_late(stream: Stream, *args: Any) -> int:
        if WRITING_OWNER.get() == late:
            await asyncio.sleep(1.0)
        return await write_encoded(stream, *args)

    monkeypatch.setattr(flat, "read_header", noting_header)
    monkeypatch.setattr(flat, "write_encoded", writing_late)

    def note_reads(r: AllReduceRound, me: int) -> None:
        honest = r._read_final

        async def read_final(stream: Stream, lo: int, hi: int, *args: Any) -> Any:
            if lo == r.parts[owner][0]:  # this task reads the owner's answer
                READING_OWNER.set(me)
            return await honest(stream, lo, hi, *args)

        r._read_final = read_final  # type: ignore[method-assign]

    def give_up(r: AllReduceRound, me: int) -> None:
        honest_exchange, honest_read = r._exchange, r._read_final

        async def exchange(reducer: int, j: int) -> Any:
            token = WRITING_OWNER.set(me if j == owner and reducer == owner else None)
            try:
                return await honest_exchange(reducer, j)
            finally:
                WRITING_OWNER.reset(token)

        async def read_final(stream: Stream, lo: int, hi: int, *args: Any) -> Any:
            if lo == r.parts[owner][0] and WRITING_OWNER.get() == me:  # a read of the owner's answer that stalled
                await asyncio.wait_for(both_answering.wait(), 10)
                raise AllReduceError("stream avg.part: no next chunk in time")
            return await honest_read(stream, lo, hi, *args)

        r._exchange, r._read_final = exchange, read_final  # type: ignore[method-assign]

    for i in (0, 1):
        note_reads(rounds[i], i)
    for i in (backup, late):
        give_up(rounds[i], i)
    outcomes = await asyncio.gather(*(r.run() for r in rounds), return_exceptions=True)
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    results = [o[0] for o in outcomes]
    lo, hi = rounds[0].parts[owner]
    assert all(torch.equal(r[lo:hi], results[0][lo:hi]) for r in results), "two results of the owner's part"
    assert all(torch.equal(r, results[0]) for r in results), "the members disagree"
    included = outcomes[owner][1].contributions[owner]
    assert {0, 1, 2} <= set(included) and all(o[1].contributions[owner] == included for o in outcomes)  # the owner's
    assert rounds[backup].reducer_of[owner] == backup and rounds[late].reducer_of[owner] == backup
