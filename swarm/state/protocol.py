"""The state-exchange wire, in one place.

`state.manifest` (unary)
    args   {"run": run id, "sha256": hex or absent}
    reply  {"manifest": bytes (the canonical JSON), "sha256": hex}
    errors bad_request (wrong run, malformed), not_found (no state yet, or not that sha256 any more)

`state.shard` (stream; the caller ends its side at once, the server streams the bytes and ends)
    args   {"run": run id, "manifest": sha256 hex, "shard": "shard-00000.safetensors"}
    body   exactly the shard's bytes, in chunks (the manifest gives their length and SHA-256)
    errors bad_request, not_found (the server moved on to a newer state), busy (at its upload
           limit: ask another peer)

`state.update` (stream; as state.shard)
    args   {"run": run id, "step": outer step t, "base": state_sha256 hex of the state of step t}
    body   exactly the update of step t from that state (update.py's body: the group's averaged Δ̄_t)
    errors bad_request, not_found (no update of step t from that state kept), busy

A server answers from one immutable snapshot per call: a state that changes at the next outer
step never mixes into a shard being sent.
"""

from __future__ import annotations

import re
from typing import Any

from swarm.p2p.errors import BadRequest

MANIFEST = "state.manifest"
SHARD = "state.shard"
UPDATE = "state.update"
MAX_STEP = 1 << 62
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_SHARD_NAME = re.compile(r"^shard-\d{5}\.safetensors$")


def manifest_args(run_id: str, sha256: str | None = None) -> dict[str, Any]:
    return {"run": run_id} if sha256 is None else {"run": run_id, "sha256": sha256}


def shard_args(run_id: str, manifest_sha256: str, shard: str) -> dict[str, Any]:
    return {"run": run_id, "manifest": manifest_sha256, "shard": shard}


def parse_manifest_args(args: Any, run_id: str) -> str | None:
    if not isinstance(args, dict) or args.get("run") != run_id:
        raise BadRequest(f"{MANIFEST}: wrong or missing run id")
    sha = args.get("sha256")
    if sha is not None and not (isinstance(sha, str) and _HEX64.match(sha)):
        raise BadRequest(f"{MANIFEST}: sha256 must be 64 lowercase hex digits")
    return sha


def parse_shard_args(args: Any, run_id: str) -> tuple[str, str]:
    if not isinstance(args, dict) or args.get("run") != run_id:
        raise BadRequest(f"{SHARD}: wrong or missing run id")
    sha, shard = args.get("manifest"), args.get("shard")
    if not (isinstance(sha, str) and _HEX64.match(sha)):
        raise BadRequest(f"{SHARD}: manifest must be 64 lowercase hex digits")
    if not (isinstance(shard, str) and _SHARD_NAME.match(shard)):
        raise BadRequest(f"{SHARD}: bad shard name")
    return sha, shard


def update_args(run_id: str, step: int, base: str) -> dict[str, Any]:
    return {"run": run_id, "step": step, "base": base}


def parse_update_args(args: Any, run_id: str) -> tuple[int, str]:
    if not isinstance(args, dict) or args.get("run") != run_id:
        raise BadRequest(f"{UPDATE}: wrong or missing run id")
    step, base = args.get("step"), args.get("base")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < MAX_STEP:
        raise BadRequest(f"{UPDATE}: step must be an int >= 0")
    if not (isinstance(base, str) and _HEX64.match(base)):
        raise BadRequest(f"{UPDATE}: base must be 64 lowercase hex digits")
    return step, base
