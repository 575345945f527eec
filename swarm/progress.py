"""Training progress in the DHT: what each node of a run publishes under `<run>/nodes`, and
when the peers of an outer step will finish their inner steps.

    {"maddrs": [...], "client": bool, "step": outer step, "inner": inner steps done, "H": inner
     steps per outer step, "sec_per_step": float, "time": unix time of the figures, ...}

plus display fields (`train_loss`, `eval_loss`, `tokens_per_s`, `group_size`) that
`swarm-dht inspect --run-id` shows. Nodes use the timing fields to enter matchmaking together:
each node aims to announce `matchmaking_time` before the slowest peer of its step finishes
(hivemind's progress tracker does the same job with sample counts).

Peer records are untrusted: each field is type- and range-checked, a bad record is ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from swarm.dht.run_keys import owned_map
from swarm.p2p.peer_id import PeerID

MAX_STEP = 1 << 40
MAX_SEC_PER_STEP = 3600.0


@dataclass(frozen=True, slots=True)
class PeerProgress:
    peer_id: PeerID
    step: int  # outer step it is working on
    inner: int  # inner steps done in it
    inner_steps: int  # H
    sec_per_step: float
    time: float  # unix time of these figures
    client: bool

    def finish_time(self) -> float:
        """Unix time at which it should reach H inner steps (in the past when already there)."""
        return self.time + max(0, self.inner_steps - self.inner) * self.sec_per_step


def decode_progress(subkey: Any, value: Any) -> PeerProgress | None:
    """A peer's progress record, or None when it is malformed (never raises)."""
    owned = owned_map(subkey, value)
    if owned is None:
        return None
    peer, value = owned
    step, inner, h = value.get("step"), value.get("inner"), value.get("H")
    sec, when = value.get("sec_per_step"), value.get("time")
    if not all(_int_in(x, 0, MAX_STEP) for x in (step, inner)) or not _int_in(h, 1, MAX_STEP):
        return None
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in (sec, when)):
        return None
    if not 0 <= sec <= MAX_SEC_PER_STEP:
        return None
    return PeerProgress(peer, step, inner, h, float(sec), float(when), value.get("client") is True)


def _int_in(x: Any, low: int, high: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and low <= x <= high


def latest_finish(peers: list[PeerProgress], step: int, now: float, fresh_for: float, own_finish: float,
                  max_wait: float) -> float:  # fmt: skip
    """When the slowest live peer of `step` should finish (unix time), but never later than
    own_finish + max_wait (a stalled or very slow peer does not hold the group) and never
    earlier than own_finish. Records older than fresh_for seconds are of dead or stuck peers."""
    end = own_finish
    for p in peers:
        if p.step != step or now - p.time > fresh_for:
            continue
        end = max(end, min(p.finish_time(), own_finish + max_wait))
    return end


def median_pace(peers: list[PeerProgress]) -> float:
    """The median seconds per inner step of the peers that have timed one (0.0: none has)."""
    positive = sorted(p.sec_per_step for p in peers if p.sec_per_step > 0)
    return positive[len(positive) // 2] if positive else 0.0


def plan_late_round(peers: list[PeerProgress], step: int, now: float, fresh_for: float, h: int,
                    own_sec: float, margin: float) -> int | None:  # fmt: skip
    """Inner steps for a node that joined or fetched while the peers of `step` were training:
    H, or fewer, just enough to finish with them (its contribution is weighted by the tokens it
    trained on; hivemind lets late peers join with the samples they have in the same way), and
    announce `margin` seconds before they read who is ready. None when a group is already
    forming: too late for this step. Only a server can lead a group and serve its result, so a
    node never waits on peers that are all clients: they wait for it."""
    same = [p for p in peers if p.step == step and now - p.time <= fresh_for]
    if any(p.inner >= p.inner_steps and not p.client for p in same):
        return None
    started = [p for p in same if 0 < p.inner < p.inner_steps]
    sec = own_sec if own_sec > 0 else median_pace(started)
    if not started or sec <= 0:
        return h
    peers_end = max(p.finish_time() for p in started)
    if peers_end - now < margin:
        return None
    return max(0, min(h, int((peers_end - now - margin) / sec)))  # 0: announce at once


def servers_behind(peers: list[PeerProgress], own_step: int, now: float, fresh_for: float) -> bool:
    """Every live server works on an earlier outer step than `own_step`, and none has finished
    the inner steps that would bring its next state to ours (a server in matchmaking at
    own_step - 1 is about to publish own_step). False when no server is live."""
    servers = [p for p in peers if not p.client and now - p.time <= fresh_for]
    return bool(servers) and all(p.step + (p.inner >= p.inner_steps) < own_step for p in servers)
