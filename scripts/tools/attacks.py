"""Attacks on training, as a malicious `swarm-node` would run them: the real node with a method or
two changed (the threat model of the docs' security page).
`python -m scripts.tools.attacker ATTACK -- <swarm-node options>` runs one; bench_robust.py and the
attack tests start it next to honest nodes.

Each attack patches classes of this process only, before the node starts:

    scale       its pseudo-gradient x 1e4
    huge        a finite pseudo-gradient of 1e30 everywhere
    nan         a pseudo-gradient of NaN
    weight      announces 1e6 x its tokens as its weight, with a sign-flipped pseudo-gradient
    owner       announces a bandwidth of 1e12 (to own the whole vector) and broadcasts -100 x the
                true average of every part it reduces
    far_state   after its first outer step, jumps to outer step 1,000,000 with all-zero θ and
                advertises that (correctly hashed) state
    big_manifest  advertises its state one step ahead, with a manifest of 2 x 1 GiB shards
    records     publishes progress records that say it is always about to finish, an hour per
                inner step
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

FAR_STEP = 1_000_000


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def _scaled_pseudo_gradients(factor: float | None, fill: float | None = None) -> None:
    from swarm.model.diloco import DiLoCo

    def make(original: Any) -> Any:
        def pseudo_gradients(self: Any) -> list[torch.Tensor]:
            deltas = original(self)
            if fill is not None:
                return [torch.full_like(d, fill) for d in deltas]
            return [d * factor for d in deltas]

        return pseudo_gradients

    _patch(DiLoCo, "pseudo_gradients", make)


def _announce(weight_factor: float = 1.0, bandwidth: float | None = None) -> None:
    from swarm.averaging.averager import Averager

    def make(original: Any) -> Any:
        def member_info(self: Any, weight: float, *args: Any, **kwargs: Any) -> Any:
            info = original(self, weight, *args, **kwargs)
            changed = replace(info, weight=info.weight * weight_factor)
            return replace(changed, bandwidth=bandwidth) if bandwidth is not None and not info.client else changed

        return member_info

    _patch(Averager, "member_info", make)


def scale() -> None:
    _scaled_pseudo_gradients(1e4)


def huge() -> None:
    _scaled_pseudo_gradients(None, fill=1e30)


def nan() -> None:
    _scaled_pseudo_gradients(None, fill=float("nan"))


def weight() -> None:
    _scaled_pseudo_gradients(-1.0)
    _announce(weight_factor=1e6)


def owner() -> None:
    from swarm.averaging.rounds.reduction import PartReduction

    _announce(bandwidth=1e12)

    def make(original: Any) -> Any:
        def encode(self: Any, average: torch.Tensor) -> Any:
            return original(self, average * -100.0)

        return encode

    _patch(PartReduction, "_encode", make)


def far_state() -> None:
    from swarm.model.diloco import DiLoCo

    def make(original: Any) -> Any:
        def finish(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if self.outer_step < FAR_STEP:
                with torch.no_grad():
                    for p in self.outer_params:
                        p.zero_()
                    for p in self.model.parameters():
                        p.zero_()
                self.outer_step = FAR_STEP

        return finish

    _patch(DiLoCo, "_finish_outer_step", make)


def big_manifest() -> None:
    from swarm.model import checkpoint
    from swarm.state import keeper

    def make(original: Any) -> Any:
        def make_snapshot(state: Any, run: Any, *args: Any, **kwargs: Any) -> Any:
            snapshot = original(state, run, *args, **kwargs)
            shards = tuple(replace(s, nbytes=2**30) for s in snapshot.manifest.shards[:2])
            manifest = replace(snapshot.manifest, step=snapshot.manifest.step + 1, shards=shards)
            return replace(snapshot, manifest=manifest)

        return make_snapshot

    _patch(checkpoint, "make_snapshot", make)
    keeper.make_snapshot = checkpoint.make_snapshot  # imported by name there


def records() -> None:
    from swarm.node.progress import OwnProgress

    def make(original: Any) -> Any:
        def encode(self: Any, now: float) -> dict[str, Any]:
            value = original(self, now)
            value.update(inner=0, sec_per_step=3600.0, time=now + 3600.0)
            return value

        return encode

    _patch(OwnProgress, "encode", make)


ATTACKS: dict[str, Callable[[], None]] = {
    "scale": scale,
    "huge": huge,
    "nan": nan,
    "weight": weight,
    "owner": owner,
    "far_state": far_state,
    "big_manifest": big_manifest,
    "records": records,
}
