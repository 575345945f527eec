"""The owner audit of a flat round (audit/flat.py) over real sockets on 127.0.0.1: a lying owner
fails the round for everyone and is excluded; an owner that misstates one member's input is
caught by that member alone; honest rounds pass and stay bit-identical."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

import pytest
import torch

from swarm.averaging.audit.flat import RECEIPT, RoundAudit
from swarm.averaging.audit.verdicts import NOT_FINAL
from swarm.averaging.averager import Averager
from swarm.averaging.config import AveragingConfig
from swarm.averaging.errors import AllReduceError, AuditError
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds import reduction
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.flat_serving import FlatServing
from swarm.averaging.rounds.partition import payload_layout
from swarm.dht import DHTNode
from swarm.p2p import P2PHost
from swarm.p2p.errors import RemoteError, RPCError
from swarm_kernels import as_memoryview
from tests.averaging.rounds import LOCAL, MakeGroup, Member

SMALL = {"block_size": 64, "chunk_elements": 4096, "part_timeout": 5.0}
NUMEL = 40_003


def deltas(n: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    """Pseudo-gradients of one swarm: a shared direction plus per-member noise (no outliers)."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=gen)
    return [common + 0.5 * torch.randn(numel, generator=gen) for _ in range(n)]


def rounds_of(group: GroupInfo, members: list[Member], vectors: list[torch.Tensor]) -> list[AllReduceRound]:
    return [AllReduceRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]


async def run_all(rounds: list[AllReduceRound]) -> list[Any]:
    return await asyncio.gather(*(r.run() for r in rounds), return_exceptions=True)


def lie_when_owner_is(liar: AllReduceRound, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """The liar's reductions misbehave: "broadcast" -100 x the average it computed (attacks.py
    `owner`), or "substitute" member 1's payload with its negation ("shrink": 0.9 x it, within
    the low-bit codecs' rounding) before reducing (its receipt then describes the substituted
    input, consistently)."""
    # hooks on what both a streamed and a whole reduction call, chunk by chunk
    encode, decode_rows = reduction.PartReduction._encode_chunk, reduction.PartReduction._decode_rows

    def lying_encode(self: reduction.PartReduction, values: torch.Tensor) -> torch.Tensor:
        return encode(self, -100 * values if self.own_slice.data_ptr() in owned else values)

    def substituting(self: reduction.PartReduction, block: torch.Tensor, order: list[int], *chunk: Any) -> None:
        a, b, where = chunk
        if self.own_slice.data_ptr() in owned and 1 in order and (a, where.start) not in substituted[id(self)]:
            substituted[id(self)].add((a, where.start))  # once: a second pass decodes the same bytes
            buffer = self.senders[1].buffer
            other = factor * self.codec.decode(buffer[where], b - a)
            buffer[where] = as_memoryview(self.codec.encode(other))
        decode_rows(self, block, order, *chunk)

    substituted: collections.defaultdict[int, set[tuple[int, int]]] = collections.defaultdict(set)

    owned = {liar.vector[lo:hi].data_ptr() for lo, hi in liar.parts}
    factor = 0.9 if how == "shrink" else -1.0
    if how == "broadcast":
        monkeypatch.setattr(reduction.PartReduction, "_encode_chunk", lying_encode)
    else:
        monkeypatch.setattr(reduction.PartReduction, "_decode_rows", substituting)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
async def test_an_honest_round_passes_the_audit_bit_identically(make_group: MakeGroup, codec: str) -> None:
    group, members = await make_group(5, clients=1, weights=[1.0, 2.0, 1.0, 1.5, 1.0], codec=codec, **SMALL)
    outcomes = await run_all(rounds_of(group, members, deltas(5)))
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    results = [o[0] for o in outcomes]
    assert all(torch.equal(r, results[0]) for r in results)
    assert all(o[1].audit_excluded == [] for o in outcomes)
    # the receipts travelled: every member received more than the results alone
    assert all(o[1].bytes_received > 0 for o in outcomes)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
async def test_an_owner_that_broadcasts_a_lie_fails_the_round_and_is_excluded(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    group, members = await make_group(5, weights=[1.0] * 5, codec=codec, **SMALL)
    vectors = deltas(5)
    rounds = rounds_of(group, members, vectors)
    liar = 2
    lie_when_owner_is(rounds[liar], monkeypatch, "broadcast")
    outcomes = await run_all(rounds)
    liar_id = group.members[liar].peer_id
    for i, outcome in enumerate(outcomes):
        if i == liar:
            continue
        assert isinstance(outcome, AuditError), outcome
        assert isinstance(outcome, AllReduceError)
        assert outcome.owners == [liar_id] and str(liar_id) in str(outcome)
    monkeypatch.undo()

    # the same round again without the liar: it completes, bit-identical, nobody excluded
    honest = [m for i, m in enumerate(members) if i != liar]
    infos = tuple(m for i, m in enumerate(group.members) if i != liar)
    again = GroupInfo.create("run", 1, infos)
    outcomes = await run_all(rounds_of(again, honest, [v for i, v in enumerate(vectors) if i != liar]))
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    assert all(torch.equal(o[0], outcomes[0][0]) for o in outcomes)
    assert all(o[1].audit_excluded == [] for o in outcomes)


@pytest.mark.parametrize("how", ["substitute", "shrink"])
@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
async def test_an_owner_that_substitutes_our_input_is_caught_by_us_alone(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch, codec: str, how: str
) -> None:
    # we check the receipt against the payload we sent, so even a 10% change within the low-bit
    # codecs' rounding is caught
    group, members = await make_group(4, weights=[1.0] * 4, codec=codec, **SMALL)
    rounds = rounds_of(group, members, deltas(4, seed=1))
    liar = 3
    lie_when_owner_is(rounds[liar], monkeypatch, how)
    outcomes = await run_all(rounds)
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome  # nobody fails the round
    assert all(torch.equal(o[0], outcomes[0][0]) for o in outcomes)
    assert outcomes[1][1].audit_excluded == [group.members[liar].peer_id]  # member 1 was misstated
    assert [o[1].audit_excluded for i, o in enumerate(outcomes) if i not in (1, liar)] == [[], []]


async def test_a_receipt_asked_with_a_wrong_seed_or_part_gets_a_clean_error(make_group: MakeGroup) -> None:
    group, members = await make_group(3, weights=[1.0] * 3, **{**SMALL, "part_timeout": 3.0})
    outcomes = await run_all(rounds_of(group, members, deltas(3)))
    assert not any(isinstance(o, BaseException) for o in outcomes)
    asker, owner = members[0], group.members[1]  # the round lingers: its receipts are still served

    async def ask(args: dict[str, Any]) -> bytes:
        async with await asker.host.open_stream(owner.address(), RECEIPT, args, timeout=2.0) as stream:
            await stream.end()
            return bytes(await stream.read_all(max_bytes=1 << 22, timeout=5.0))  # > request_timeout

    with pytest.raises(RemoteError, match="wrong seed"):
        await ask({"g": group.group_id, "p": 1, "s": b"\0" * 32})
    with pytest.raises(RemoteError, match="no such part"):
        await ask({"g": group.group_id, "p": 7, "s": b"\0" * 32})
    with pytest.raises(RemoteError, match="32 bytes"):
        await ask({"g": group.group_id, "p": 1, "s": "x"})
    with pytest.raises(RemoteError, match="no such group"):
        await ask({"g": b"x" * 32, "p": 1, "s": b"\0" * 32})


async def test_a_part_is_audited_while_the_other_parts_are_still_on_the_wire(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Member 0 gets part 2's average only once member 1 served it part 1's receipt: the audit of
    a part starts when its result is in, not when the round's last part is (the tail a slow
    link leaves after it)."""
    group, members = await make_group(3, weights=[1.0] * 3, **SMALL)
    rounds = rounds_of(group, members, deltas(3))
    served = asyncio.Event()
    serve = RoundAudit.serve

    async def noting(self: RoundAudit, ctx: Any, args: Any, stream: Any) -> None:
        await serve(self, ctx, args, stream)
        if self.round is rounds[1] and args.get("p") == 1 and ctx.peer_id == group.members[0].peer_id:
            served.set()

    exchange = rounds[0]._exchange
    early: list[bool] = []

    async def last_part_late(reducer: int, j: int) -> Any:
        if j == 2:
            with contextlib.suppress(asyncio.TimeoutError):  # not the builtin one before Python 3.11
                await asyncio.wait_for(served.wait(), 3.0)
            early.append(served.is_set())
        return await exchange(reducer, j)

    monkeypatch.setattr(RoundAudit, "serve", noting)
    monkeypatch.setattr(rounds[0], "_exchange", last_part_late)
    outcomes = await run_all(rounds)
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    assert early == [True]
    assert all(torch.equal(o[0], outcomes[0][0]) for o in outcomes)


async def test_averagers_exclude_a_caught_owner_and_average_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through matchmaking: the honest Averagers' step fails naming the liar, which they exclude;
    at the next step they group without it (its announcement ignored, its joins refused)."""
    liar_weight = 1.2345  # how the patched reductions know they run on the liar
    encode = reduction.PartReduction._encode_chunk

    def lying_encode(self: reduction.PartReduction, values: torch.Tensor) -> torch.Tensor:
        return encode(self, -100 * values if self.weights[self.own_index] == liar_weight else values)

    monkeypatch.setattr(reduction.PartReduction, "_encode_chunk", lying_encode)
    hosts, dhts, averagers = [], [], []
    try:
        for _ in range(4):
            host = await P2PHost(config=LOCAL).start()
            dht = await DHTNode(initial_peers=hosts[0].visible_maddrs[:1] if hosts else [], host=host).start()
            config = AveragingConfig(matchmaking_time=1.0, request_timeout=1.0, **SMALL)
            hosts.append(host)
            dhts.append(dht)
            averagers.append(Averager(dht, host, "run", config))
        vectors = deltas(4)
        weights = [1.0, 1.0, 1.0, liar_weight]
        liar = hosts[3].peer_id
        outcomes = await asyncio.gather(
            *(a.step([v], w, step=0) for a, v, w in zip(averagers, vectors, weights, strict=True)),
            return_exceptions=True,
        )
        for averager, outcome in zip(averagers[:3], outcomes[:3], strict=True):
            assert isinstance(outcome, AuditError) and outcome.owners == [liar], outcome
            assert averager.excluded == {liar}
            averager.round_failed(0)
        # as a node does: the same step again, at once. The liar applied its own result and left
        # its "formed" marker: the honest ones must not wait for that result, they regroup
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(a.step([v], w, step=0) for a, v, w in zip(averagers[:3], vectors, weights, strict=False))),
            30,
        )
        assert all(len(o[1].members) == 3 and str(liar) not in o[1].members for o in outcomes)
        outcomes = await asyncio.gather(
            *(a.step([v], w, step=1) for a, v, w in zip(averagers, vectors, weights, strict=True)),
            return_exceptions=True,
        )
        for outcome in outcomes[:3]:
            assert not isinstance(outcome, BaseException), outcome
        reports = [o[1] for o in outcomes[:3]]
        assert all(r.group_id == reports[0].group_id is not None for r in reports)
        assert str(liar) not in reports[0].members and len(reports[0].members) == 3
        assert all(torch.equal(o[0][0], outcomes[0][0][0]) for o in outcomes[:3])
    finally:
        for averager in averagers:
            averager.close()
        for dht in dhts:
            await dht.close()
        for host in hosts:
            await host.close()


async def test_an_owner_that_does_not_answer_is_only_logged(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No receipt within request_timeout (the owner may have crashed after its broadcast): the
    round completes and nobody is excluded."""
    group, members = await make_group(3, weights=[1.0] * 3, **{**SMALL, "request_timeout": 0.5})
    rounds = rounds_of(group, members, deltas(3))
    serve = RoundAudit.serve

    async def silent(self: RoundAudit, ctx: Any, args: Any, stream: Any) -> None:
        if self.round is rounds[2]:
            await asyncio.sleep(3.0)
        await serve(self, ctx, args, stream)

    monkeypatch.setattr(RoundAudit, "serve", silent)
    outcomes = await run_all(rounds)
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    assert all(torch.equal(o[0], outcomes[0][0]) for o in outcomes)
    assert all(o[1].audit_excluded == [] for o in outcomes)


async def test_an_owner_whose_results_are_final_only_after_the_part_timeout_is_slow_not_a_liar(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its own part's result becomes final after the part timeout (a burst of load while the round
    confirmed a dead owner's part, in a 60-minute soak): asked for its receipt, it answers that
    its results are not final. Before, every member convicted it of lying and excluded it for
    the run (20 exclusions of honest nodes in one round, and the swarm split). Now that is
    "silent", as an owner that does not answer: the round completes and nobody is excluded."""
    group, members = await make_group(3, weights=[1.0] * 3, **{**SMALL, "part_timeout": 1.0, "request_timeout": 5.0})
    rounds = rounds_of(group, members, deltas(3))
    prepare, serve = RoundAudit._prepare, RoundAudit.serve
    not_final: list[str] = []

    async def late_own_part(self: RoundAudit, j: int, payload: Any, reducer: int) -> Any:
        if self.round is rounds[2] and reducer == self.round.me:
            await asyncio.sleep(4.0)  # well past the part timeout that serve waits for our own result
        return await prepare(self, j, payload, reducer)

    async def noting(self: RoundAudit, ctx: Any, args: Any, stream: Any) -> None:
        try:
            await serve(self, ctx, args, stream)
        except RPCError as e:
            not_final.append(e.message)
            raise

    monkeypatch.setattr(RoundAudit, "_prepare", late_own_part)
    monkeypatch.setattr(RoundAudit, "serve", noting)
    outcomes = await run_all(rounds)
    assert any(NOT_FINAL in m for m in not_final), f"the owner always answered in time: {not_final}"
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    assert all(torch.equal(o[0], outcomes[0][0]) for o in outcomes)
    assert all(o[1].audit_excluded == [] for o in outcomes)


async def test_an_owner_that_sends_one_member_other_bytes_is_caught_by_that_member(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Equivocation: the liar sends member 1 -100 x its part's average and everyone else the
    true one. Member 1's bytes are not the ones the liar holds (another seed): it fails the round
    and excludes the liar; the others' audit passes."""
    group, members = await make_group(4, weights=[1.0] * 4, **SMALL)
    rounds = rounds_of(group, members, deltas(4, seed=2))
    liar = rounds[3]
    reply = FlatServing._reply

    async def equivocating(self: FlatServing, stream: Any, final: Any, index: int | None, rate: Any = None) -> None:
        r = self.round
        if r is liar and index == 1:
            lo, hi = r.parts[3]
            lie = []
            for a, b, where in payload_layout(lo, hi, r.config.chunk_elements, r.codec.encoded_nbytes):
                true = r.codec.decode(final[1][where], b - a)
                lie.append(as_memoryview(r.codec.encode(-100 * true)).tobytes())
            final = (final[0], memoryview(b"".join(lie)))
        await reply(self, stream, final, index, rate)

    stream_answer = FlatServing._stream_answer

    async def whole_answers(self: FlatServing, *args: Any) -> bool:
        return False if self.round is liar else await stream_answer(self, *args)  # the liar answers through _reply

    monkeypatch.setattr(FlatServing, "_reply", equivocating)
    monkeypatch.setattr(FlatServing, "_stream_answer", whole_answers)
    outcomes = await run_all(rounds)
    assert isinstance(outcomes[1], AuditError) and outcomes[1].owners == [group.members[3].peer_id]
    for i in (0, 2):
        assert not isinstance(outcomes[i], BaseException), outcomes[i]
        assert outcomes[i][1].audit_excluded == []
