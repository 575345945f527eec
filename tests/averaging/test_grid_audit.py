"""The owner audit of a grid round (audit/grid.py) over real sockets on 127.0.0.1: honest rounds
pass bit-identically; a column owner that broadcasts a lie fails the round for everyone; a row
owner whose partial is not what its receipt describes is caught by its row; an owner that
misstates one input is caught by the one who sent it."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from swarm.averaging.errors import AuditError
from swarm.averaging.messages import GroupInfo
from swarm.averaging.rounds import grid_reduction, reduction
from swarm.averaging.rounds.grid import GridRound
from swarm_kernels import as_memoryview
from tests.averaging.rounds import MakeGroup, Member

N = 12  # with a cap of 4: 3 rows x 4 columns, owner (r, c) = member 4r + c
GRID = {"max_group_size": 4, "block_size": 64, "chunk_elements": 4096, "part_timeout": 5.0, "request_timeout": 10.0}
NUMEL = 50_003


def deltas(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=gen)
    return [common + 0.5 * torch.randn(NUMEL, generator=gen) for _ in range(n)]


async def run_grid(group: GroupInfo, members: list[Member], vectors: list[torch.Tensor]) -> list[Any]:
    rounds = [GridRound(m.host, m.registry, group, v, m.config) for m, v in zip(members, vectors, strict=True)]
    assert rounds[0].grid.rows == 3 and rounds[0].grid.cols == (4 if all(m.bandwidth for m in group.members) else 3)
    return await asyncio.gather(*(r.run() for r in rounds), return_exceptions=True)


def lying(monkeypatch: pytest.MonkeyPatch, liar: int, stage: str, how: str) -> None:
    """Member `liar` misbehaves in its reductions of one stage ("row": its row partial; "col":
    the final sub-part it reduces). how: "broadcast" -100 x what it computed; "flip" sends its
    row partial negated (keeping the true one for itself); "substitute" negates the input of
    one sender (row: member 4r + (c+1) % 4 of its row; column: the row after its own) before
    reducing, its receipt then describing the substituted input."""
    kind = grid_reduction.RowReduction if stage == "row" else grid_reduction.ColReduction
    encode, robust = kind._encode, reduction.PartReduction._robust

    def mine(self: reduction.PartReduction) -> bool:
        return isinstance(self, kind) and getattr(self, "liar", None) == liar

    def lying_encode(self: Any, average: torch.Tensor) -> memoryview:
        if not mine(self):
            return encode(self, average)
        if how == "flip":  # sends -partial, keeps the true one (its own column stays honest)
            payload = encode(self, -average)
            self.average = average
            return payload
        return encode(self, -100 * average)

    def substituting(self: reduction.PartReduction, complete: list[int]) -> Any:
        if mine(self):
            victim = sorted(complete)[0] if complete else None
            if victim is not None:
                buffer = self.senders[victim].buffer
                for a, b, where in self.layout:
                    buffer[where] = as_memoryview(self.codec.encode(-self.codec.decode(buffer[where], b - a)))
        return robust(self, complete)

    if how == "substitute":
        monkeypatch.setattr(reduction.PartReduction, "_robust", substituting)
    else:
        monkeypatch.setattr(kind, "_encode", lying_encode)
    # the liar's reductions are tagged as its round makes them
    make_row, make_col = GridRound.__init__, GridRound._col_reduction

    def row_init(self: GridRound, *args: Any, **kwargs: Any) -> None:
        make_row(self, *args, **kwargs)
        if self.me == liar and self.row_reduction is not None:
            self.row_reduction.liar = liar  # type: ignore[attr-defined]

    def col_made(self: GridRound, s: int) -> grid_reduction.ColReduction:
        made = make_col(self, s)
        if self.me == liar:
            made.liar = liar  # type: ignore[attr-defined]
        return made

    monkeypatch.setattr(GridRound, "__init__", row_init)
    monkeypatch.setattr(GridRound, "_col_reduction", col_made)


@pytest.mark.parametrize("codec", ["int8", "int4"])
async def test_an_honest_grid_round_passes_the_audit_bit_identically(make_group: MakeGroup, codec: str) -> None:
    group, members = await make_group(N, clients=2, weights=[1.0 + 0.1 * i for i in range(N)], codec=codec, **GRID)
    outcomes = await run_grid(group, members, deltas(N))
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    assert all(torch.equal(o[0], outcomes[0][0]) for o in outcomes)
    assert all(o[1].audit_excluded == [] for o in outcomes)


async def test_a_column_owner_that_broadcasts_a_lie_fails_the_round_for_everyone(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    group, members = await make_group(N, weights=[1.0] * N, **GRID)
    liar = 6  # owner (1, 2)
    lying(monkeypatch, liar, "col", "broadcast")
    outcomes = await run_grid(group, members, deltas(N))
    liar_id = group.members[liar].peer_id
    for i, outcome in enumerate(outcomes):
        if i != liar:
            assert isinstance(outcome, AuditError), (i, outcome)
            assert outcome.owners == [liar_id]


@pytest.mark.parametrize("how", ["broadcast", "flip"])
async def test_a_row_owner_whose_partial_is_not_its_receipts_is_excluded_by_its_row(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    group, members = await make_group(N, weights=[1.0] * N, **GRID)
    liar = 5  # owner (1, 1): row 1 is members 4..7
    lying(monkeypatch, liar, "row", how)
    outcomes = await run_grid(group, members, deltas(N, seed=2))
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome  # nobody fails the round: one state
    assert all(torch.equal(o[0], outcomes[0][0]) for o in outcomes)
    liar_id = group.members[liar].peer_id
    for i, (_, report) in enumerate(outcomes):
        if i in (4, 6, 7):  # its row saw it
            assert report.audit_excluded == [liar_id], i
        elif i != liar:
            assert report.audit_excluded == [], i


@pytest.mark.parametrize("stage", ["row", "col"])
async def test_an_owner_that_substitutes_one_input_is_caught_by_its_sender_alone(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    group, members = await make_group(N, weights=[1.0] * N, **GRID)
    liar = 5  # owner (1, 1)
    lying(monkeypatch, liar, stage, "substitute")
    outcomes = await run_grid(group, members, deltas(N, seed=3))
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    assert all(torch.equal(o[0], outcomes[0][0]) for o in outcomes)
    liar_id = group.members[liar].peer_id
    # the victim: the first sender of its reduction; row stage: member 4 (row 1, column 0);
    # column stage: the row partial of row 0, sent by owner (0, 1) = member 1
    victim = 4 if stage == "row" else 1
    for i, (_, report) in enumerate(outcomes):
        if i == victim:
            assert report.audit_excluded == [liar_id]
        elif i != liar:
            assert report.audit_excluded == [], i


async def test_a_row_owner_that_states_its_partial_as_nan_is_excluded_by_its_row(
    make_group: MakeGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN compares false with every bound: a receipt whose partial is NaN must not pass as one
    that holds (here the partial itself is honest; only what the receipt says of it is not)."""
    from swarm.averaging.audit import grid as grid_audit

    group, members = await make_group(N, weights=[1.0] * N, **GRID)
    liar = 5  # owner (1, 1): row 1 is members 4..7
    sketches = grid_audit.GridAudit._partial_sketches

    def nan_sketches(self: grid_audit.GridAudit, c: int, plan: Any) -> dict[int, tuple[torch.Tensor, float]]:
        stated = sketches(self, c, plan)
        if self.round.me != liar:
            return stated
        return {s: (torch.full_like(t, math.nan), math.nan) for s, (t, _) in stated.items()}

    monkeypatch.setattr(grid_audit.GridAudit, "_partial_sketches", nan_sketches)
    outcomes = await run_grid(group, members, deltas(N, seed=4))
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException), outcome
    liar_id = group.members[liar].peer_id
    for i, (_, report) in enumerate(outcomes):
        if i in (4, 6, 7):
            assert report.audit_excluded == [liar_id], i
        elif i != liar:
            assert report.audit_excluded == [], i
