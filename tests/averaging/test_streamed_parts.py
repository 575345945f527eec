"""Streamed parts (AveragingConfig.stream_parts; rounds/reduction.py, rounds/flat.py): an owner answers
each chunk of its part as soon as every sender's bytes of it are in. The same bits as a whole
reduction; a sender that fails mid-way or a robust rule that clips replaces the streamed bytes
with the whole part's average; an owner that garbles its streamed answer loses the part to its
backup."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
import torch

from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds import flat
from swarm.averaging.rounds.flat import AllReduceRound
from swarm.averaging.rounds.flat_serving import FlatServing
from swarm.p2p.errors import P2PError
from tests.averaging.rounds import MakeGroup, Member
from tests.averaging.test_audit_round import deltas, run_all

pytestmark = pytest.mark.timeout(60)

SMALL = {"block_size": 64, "chunk_elements": 4096, "part_timeout": 5.0}
NUMEL = 40_003  # 3 chunks a part among 4 members


def rounds(group: GroupInfo, members: list[Member], vectors: list[torch.Tensor], **config: Any) -> list[AllReduceRound]:
    return [
        AllReduceRound(m.host, m.registry, group, v, dataclasses.replace(m.config, **config))
        for m, v in zip(members, vectors, strict=True)
    ]


def agreed(outcomes: list[Any], members: list[int]) -> tuple[torch.Tensor, Any]:
    """The result every listed member holds (asserting they hold the same bits) and one report."""
    for i in members:
        assert not isinstance(outcomes[i], BaseException), (i, outcomes[i])
    result = outcomes[members[0]][0]
    assert all(torch.equal(outcomes[i][0], result) for i in members)
    return result, outcomes[members[0]][1]


@pytest.mark.parametrize("aggregator", ["mean", "robust"])
async def test_streamed_parts_are_the_bits_of_whole_ones(make_group: MakeGroup, aggregator: str) -> None:
    group, members = await make_group(5, clients=1, aggregator=aggregator, **SMALL)
    vectors = deltas(5, NUMEL)
    streamed, report = agreed(await run_all(rounds(group, members, vectors)), list(range(5)))
    again = GroupInfo.create("run", 1, group.members)
    whole, whole_report = agreed(await run_all(rounds(again, members, vectors, stream_parts=False)), list(range(5)))
    assert torch.equal(streamed, whole)
    assert sorted(report.streamed) == [1, 2, 3] and not whole_report.streamed  # every part but ours (0)
    assert all(included == [0, 1, 2, 3, 4] for included in report.contributions.values())


async def test_a_clipped_contribution_replaces_the_streamed_bytes(make_group: MakeGroup) -> None:
    # member 2 sends 1e4 x its delta: the robust rule drops it only once the whole part is in
    group, members = await make_group(4, weights=[1.0] * 4, **SMALL)
    vectors = deltas(4, NUMEL, seed=3)
    vectors[2] = vectors[2] * 1e4
    honest = [0, 1, 3]
    streamed, report = agreed(await run_all(rounds(group, members, vectors)), honest)
    again = GroupInfo.create("run", 1, group.members)
    whole, _ = agreed(await run_all(rounds(again, members, vectors, stream_parts=False)), honest)
    assert torch.equal(streamed, whole)
    assert report.streamed == []  # every part was answered again, whole
    assert all(2 not in included for included in report.contributions.values())


async def test_a_sender_that_fails_mid_upload_is_left_out_of_streamed_parts(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the test's last wait is member 3's own round running out of part_timeout after its upload
    # failed: 2 s, not 5 (the other members' parts are done within a second of the start)
    group, members = await make_group(4, weights=[1.0] * 4, aggregator="mean", **{**SMALL, "part_timeout": 2.0})
    vectors = deltas(4, NUMEL, seed=4)
    write_encoded = flat.write_encoded
    chunk = SMALL["chunk_elements"]

    async def fails_before_its_last_chunk(
        stream: Any, codec: Any, vector: torch.Tensor, lo: int, hi: int, c: int
    ) -> int:
        if vector.data_ptr() != vectors[3].data_ptr():
            return await write_encoded(stream, codec, vector, lo, hi, c)
        await write_encoded(stream, codec, vector, lo, hi - chunk, c)  # the owners stream what they have
        raise P2PError("member 3 went away mid-upload")

    monkeypatch.setattr(flat, "write_encoded", fails_before_its_last_chunk)
    _, report = agreed(await run_all(rounds(group, members, vectors)), [0, 1, 2])
    # an owner that had begun streaming when member 3 went away stops; one that read member 3's
    # cancel before the others' first chunks were in never begins: either way the part follows whole
    for part in (0, 1, 2):
        assert report.contributions[part] == [0, 1, 2], report.contributions
    assert all(part not in report.streamed for part in (0, 1, 2))


@pytest.mark.parametrize("garble", ["out of order", "no end", "bytes after the end"])
async def test_a_garbled_streamed_answer_loses_the_part_to_its_backup(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch, garble: str
) -> None:
    group, members = await make_group(4, weights=[1.0] * 4, aggregator="mean", **SMALL)
    vectors = deltas(4, NUMEL, seed=5)
    all_rounds = rounds(group, members, vectors)
    liar = all_rounds[1]
    stream_answer = FlatServing._stream_answer

    async def garbled(self: FlatServing, stream: Any, reduction: Any, incoming: Any, uploaded: Any) -> bool:
        if self.round is not liar:
            return await stream_answer(self, stream, reduction, incoming, uploaded)
        await reduction.result
        layout = reduction.layout
        await stream.write(msgpack.packb({"inc": reduction.streamed_included, "st": 1}))
        order = [1, 0, 2] if garble == "out of order" else [0, 1, 2]
        for c in order[: len(layout)]:
            await stream.write(msgpack.packb({"c": c}))
            await stream.write(reduction.streamed_payload[layout[c][2]])
        if garble != "no end":
            await stream.write(msgpack.packb({"fin": 1}))
        if garble == "bytes after the end":
            await stream.write(b"\x00" * 16)
        await stream.end()
        return True

    monkeypatch.setattr(FlatServing, "_stream_answer", garbled)
    _, report = agreed(await run_all(all_rounds), [0, 2, 3])
    assert report.contributions[1] == [0, 2, 3]  # member 2 took the part over, without the liar's slice
    assert 1 not in report.streamed
