"""The commands rank 0 sends the other ranks of its node: the protocol, in one place.

Every command is one broadcast from rank 0 of an int64 tensor of COMMAND_WORDS words:

    [VERSION, op, outer_step, inner_done]

  op STEP  run one inner step at the node's global step (outer_step, inner_done): every rank
           draws its rows of the node's batch for that step, DDP averages the gradients, and
           the loss is averaged over the ranks (one all_reduce of one float) so that every rank
           takes the same skip-or-step decision on a non-finite loss.
  op SYNC  rank 0's parameters changed outside an inner step (outer step applied, state fetched,
           checkpoint resumed): one broadcast per parameter follows, in DiLoCo.params order.
           (outer_step, inner_done) are rank 0's after the change.
  op PING  nothing to do: rank 0 is busy in the swarm (matchmaking, a round, a fetch). Sent every
           few seconds so that no rank waits in a collective longer than its timeout, and so that
           rank 0 learns early that a rank died.
  op STOP  the node is leaving: exit 0.

Every rank runs exactly this sequence of collectives, so the process group never deadlocks on
a mismatch; a rank that receives a malformed command exits (CommandError).

Before the first command, once: the hello (group.py): each rank's device kind (all_gather), then
rank 0's settings as JSON bytes (broadcast), then DDP's own broadcast of the module at wrap time.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = ["COMMAND_WORDS", "VERSION", "Command", "CommandError", "Op", "decode", "encode"]

VERSION = 1
COMMAND_WORDS = 4


class Op(IntEnum):
    STEP = 1
    SYNC = 2
    PING = 3
    STOP = 4


class CommandError(ValueError):
    """A command this rank cannot follow (another version, an unknown op, a bad step)."""


@dataclass(frozen=True, slots=True)
class Command:
    op: Op
    outer_step: int = 0  # the node's DiLoCo.outer_step
    inner_done: int = 0  # inner steps done in it; STEP runs inner step number inner_done

    def __post_init__(self) -> None:
        if self.outer_step < 0 or self.inner_done < 0:
            raise CommandError(f"negative step in {self}")


def encode(command: Command) -> list[int]:
    return [VERSION, int(command.op), command.outer_step, command.inner_done]


def decode(words: list[int]) -> Command:
    if len(words) != COMMAND_WORDS:
        raise CommandError(f"a command has {COMMAND_WORDS} words, got {len(words)}")
    version, op, outer_step, inner_done = words
    if version != VERSION:
        raise CommandError(f"command version {version}, this rank speaks {VERSION}: run one swarm version per node")
    try:
        kind = Op(op)
    except ValueError:
        raise CommandError(f"unknown command op {op}") from None
    return Command(kind, outer_step, inner_done)
