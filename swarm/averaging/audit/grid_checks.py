"""The checks of a grid round's receipts (audit/grid.py), in a worker thread: a column receipt
against the final sub-part and the rows it says it reduced, a row receipt against our own slice
and the row partial the column receipts say they got. Each returns the problems it found;
an AuditFailure is a receipt too malformed to check."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swarm.averaging.audit.arithmetic import (
    SENT_TOL,
    AuditFailure,
    Prepared,
    Receipt,
    check_receipt,
    quantization_tol,
)
from swarm.averaging.audit.flat import unpack_receipt
from swarm.averaging.audit.verdicts import OURS, JudgedRound
from swarm.averaging.robust import robust_coefficients
from swarm_kernels.sketch import SketchPlan

if TYPE_CHECKING:
    from swarm.averaging.config import AveragingConfig
    from swarm.averaging.rounds.grid_reduction import RowReduction
    from swarm.averaging.rounds.grid_shape import Grid
    from swarm.averaging.rounds.streams import Final

logger = logging.getLogger(__name__)

ROW_RECEIPT = -1  # "k" of a row receipt
RowEntry = tuple[list[int], torch.Tensor, float]  # a row partial in a column receipt: members, sketch, |.|^2


class CheckedGrid(JudgedRound, Protocol):
    """What the checks read of their round (rounds/grid.py's GridRound): the grid and our place
    in it, the agreed weights, the finals and the result, and our row partial (None: a passenger)."""

    me: int
    row: int
    col: int
    grid: Grid
    weights: list[float]
    config: AveragingConfig
    final: dict[tuple[int, int], Final]
    result: torch.Tensor
    row_reduction: RowReduction | None


@dataclass
class ColumnSide:
    """Our side of column c's checks: its seed and plan, the sketches (and squared norms) of
    each final sub-part, and of what we sent: our row partial's sub-parts (an owner of c) or
    our slice of part c (anyone else)."""

    seed: bytes
    plan: SketchPlan
    observed: dict[int, tuple[torch.Tensor, float]] = field(default_factory=dict)
    sent: dict[int, tuple[torch.Tensor, float]] = field(default_factory=dict)  # sub-part, or ROW_RECEIPT
    receipts: dict[int, Any] = field(default_factory=dict)  # k -> the raw receipt, once fetched


def live_subparts(grid: Grid, c: int) -> list[int]:
    """The sub-parts of column c that hold elements."""
    return [s for s, (lo, hi) in enumerate(grid.subs[c]) if hi > lo]


def check_column_receipt(r: CheckedGrid, c: int, s: int, side: ColumnSide) -> tuple[list[str], RowEntry | None]:
    """Column receipt (c, s); also returns the entry of the row we sit in, as the receipt
    states it (its members, sketch, squared norm), for our row receipt's check."""
    grid = r.grid
    msg = unpack_receipt(side.receipts[s])
    receipt = Receipt.decode(msg, grid.rows)
    listed = msg.get("rm")
    if not isinstance(listed, list) or len(listed) != len(receipt.included):
        raise AuditFailure("receipt: one member list per row")
    for row, members in zip(receipt.included, listed, strict=True):
        if not isinstance(members, list) or not set(members) <= set(grid.row_members[row]) or not all(
            isinstance(i, int) for i in members) or members != sorted(set(members)):  # fmt: skip
            raise AuditFailure(f"receipt: a bad member list for row {row}")
    weights = [0.0] * grid.rows
    for row, members in zip(receipt.included, listed, strict=True):
        weights[row] = sum(r.weights[i] for i in members)
    final_members = set(r.final[(c, s)][0])
    rows = dict(zip(receipt.included, listed, strict=True))
    kept = [row for row, members in rows.items() if members and set(members) <= final_members]
    problems = []
    if {i for row in kept for i in rows[row]} != final_members:
        problems.append("the result's members are not those of the rows the receipt keeps")
    lo, hi = grid.subs[c][s]
    observed, result_sq = side.observed[s]
    # an owner of c whose partial went out (side.sent) checks the receipt's entry of its row
    owner_here = c == r.col and r.row in receipt.included and s in side.sent
    own, own_sq = side.sent.get(s, (torch.zeros_like(observed), 0.0))
    problems += check_receipt(
        receipt, weights=weights, result=r.result[lo:hi], seed=side.seed, part=c,
        me=r.row if owner_here else None, mine=r.result[lo:hi] if owner_here else None, included=kept,
        prepared=Prepared(observed, own, own_sq, result_sq, own_sent=True),
        tolerance=quantization_tol(r.config.codec), buckets=side.plan.buckets,
    )  # fmt: skip
    sent_members = sorted(r.row_reduction.result.result()[0]) if owner_here and r.row_reduction else None
    if sent_members is not None and listed[receipt.included.index(r.row)] != sent_members:
        problems.append(f"{OURS} row's members")
    entry = None
    if r.row in receipt.included:
        k = receipt.included.index(r.row)
        entry = (listed[k], receipt.sketches[k].double(), receipt.gram[k][k])
    return problems, entry


def check_row_receipt(r: CheckedGrid, c: int, side: ColumnSide, rows_seen: dict[int, RowEntry]) -> list[str]:
    """The row receipt of our row's owner of column c: what it says of our slice; that the
    partial it says it sent ("ps", "pn") is the reduction it describes; and that the owners
    of column c say they got that partial. One owner that disagrees cannot say who lies (it,
    or our row's owner): logged. Two or more: our row's owner sent other bytes than it says."""
    grid = r.grid
    msg = unpack_receipt(side.receipts[ROW_RECEIPT])
    receipt = Receipt.decode(msg, len(r.group.members))
    if not set(receipt.included) <= set(grid.row_members[r.row]):
        raise AuditFailure("receipt: members of another row")
    width = side.plan.buckets
    raw, norms = msg.get("ps"), msg.get("pn")
    if not isinstance(raw, bytes) or len(raw) != grid.rows * width * 4:
        raise AuditFailure("receipt: the partial's sketches must be rows x buckets float32")
    if not isinstance(norms, list) or len(norms) != grid.rows or not all(isinstance(v, float | int) for v in norms):
        raise AuditFailure("receipt: one squared norm per sub-part")
    sent = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(grid.rows, width).double()
    # NaN compares false with every bound: a partial stated as NaN would pass every check below
    if not torch.isfinite(sent).all() or not all(math.isfinite(v) and v >= 0 for v in norms):
        raise AuditFailure("receipt: the partial's sketches and norms must be finite")
    live = live_subparts(grid, c)
    own, own_sq = side.sent[ROW_RECEIPT]
    lo, hi = grid.parts[c]
    problems = check_receipt(
        receipt, weights=r.weights, result=r.result[lo:hi], seed=side.seed, part=c, me=r.me, mine=r.result[lo:hi],
        prepared=Prepared(sent[live].sum(0), own, own_sq, float(sum(norms[s] for s in live)), own_sent=True),
        tolerance=quantization_tol(r.config.codec), buckets=width,
    )  # fmt: skip
    kept = sorted(i for i, fate in zip(receipt.included, robust_fates(receipt, r.weights), strict=True) if fate)
    disagree = []
    for s, (members, sketch, sq) in sorted(rows_seen.items()):
        scale = max(float(sketch.norm()), float(sent[s].norm()))
        if members != kept or abs(sq - norms[s]) > 2 * SENT_TOL * max(sq, norms[s]) + 1e-30 or float(
            (sketch - sent[s]).norm()) > SENT_TOL * scale + 1e-30:  # fmt: skip
            disagree.append(grid.owners[s][c])
    if len(disagree) >= 2:
        problems.append(f"its partial is not what it says it sent: owners {disagree} of column {c} got another")
    elif disagree:
        owners = (r.group.members[grid.owners[r.row][c]].peer_id, r.group.members[disagree[0]].peer_id)
        logger.warning("round %s: audit: %s and %s disagree on the row partial of column %d: one of them lies",
                       r._tag(), *owners, c)  # fmt: skip
    return problems


def robust_fates(receipt: Receipt, weights: list[float]) -> list[bool]:
    """Which of a receipt's contributions its rule keeps."""
    _, fates = robust_coefficients(receipt.gram, [weights[i] for i in receipt.included])
    return [fate.dropped is None for fate in fates]
