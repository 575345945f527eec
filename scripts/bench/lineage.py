"""Benchmark of round receipts (swarm/state/receipts.py, lineage.py): what one round's receipt
costs on the wire and in a verifier's thread, by group size.

    python -m scripts.bench.lineage                    # a table: 2, 8, 16, 64 members
    python -m scripts.bench.lineage --members 64 --steps 1000 --json

Per group size, for a receipt signed by every member:
- ``receipt_bytes``: its msgpack size (what `state.lineage` carries per step, and what a
  checkpoint keeps); ``record_bytes``: one member's signature record in the DHT (its value);
- ``sign_us``: one member's signature; ``verify_ms``: checking every signature of one receipt
  (what a fetcher does per step of a lineage, in a thread), the median of ``--repeat`` runs;
- ``chain_s``: checking a lineage of ``--steps`` such rounds end to end (signatures, then
  `judge`), what a newcomer from genesis pays once; ``chain_MB``: its receipts' bytes.

No ``--compare hivemind``: hivemind has no receipts (a state is whatever a peer serves).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from typing import Any

import msgpack

from swarm.p2p.identity import Identity
from swarm.state.lineage import Lineage, Link, judge
from swarm.state.receipts import Receipt, RoundBody, sign, valid_signers


def receipt(keys: list[Identity], step: int, parent: bytes) -> Receipt:
    result = hashlib.sha256(parent + step.to_bytes(8, "big")).digest()
    members = tuple(k.peer_id for k in keys)
    body = RoundBody("bench-run", hashlib.sha256(b"settings").digest(), step, hashlib.sha256(b"g%d" % step).digest(),
                     members, tuple(40960.0 for _ in keys), parent, result)  # fmt: skip
    return Receipt(body, {k.peer_id: sign(body, k) for k in keys})


def measure(members: int, steps: int, repeat: int) -> dict[str, Any]:
    keys = [Identity.from_seed(hashlib.sha256(b"%d" % i).digest()) for i in range(members)]
    genesis = hashlib.sha256(b"genesis").digest()
    one = receipt(keys, 0, genesis)
    started = time.perf_counter()
    for _ in range(repeat):
        sign(one.body, keys[0])
    sign_us = (time.perf_counter() - started) / repeat * 1e6
    verify = []
    for _ in range(repeat):
        started = time.perf_counter()
        assert len(valid_signers(one)) == members
        verify.append(time.perf_counter() - started)
    record = {"g": one.body.group_id, "r": one.body.result, "s": one.signatures[keys[0].peer_id]}
    chain, parent = [], genesis
    for step in range(steps):
        chain.append(receipt(keys, step, parent))
        parent = chain[-1].body.result
    started = time.perf_counter()
    links = tuple(Link.of(r, valid_signers(r)) for r in chain)
    verdict = judge(Lineage(0, genesis), Lineage(0, genesis, links))
    chain_s = time.perf_counter() - started
    assert verdict.adopt, verdict.why
    return {
        "members": members,
        "receipt_bytes": len(msgpack.packb(one.encode())),
        "record_bytes": len(msgpack.packb(record)),
        "sign_us": round(sign_us, 1),
        "verify_ms": round(statistics.median(verify) * 1e3, 3),
        "steps": steps,
        "chain_s": round(chain_s, 3),
        "chain_MB": round(sum(len(msgpack.packb(r.encode())) for r in chain) / 1e6, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="2,8,16,64", help="group sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=100, help="rounds in the lineage checked end to end")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    rows = [measure(int(m), args.steps, args.repeat) for m in args.members.split(",")]
    if args.json:
        print(json.dumps({"bench": "lineage", "rows": rows}))
        return
    print(f"{'members':>8} {'receipt B':>10} {'record B':>9} {'sign µs':>8} {'verify ms':>10} "
          f"{'chain of':>9} {'check s':>8} {'MB':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['members']:>8} {r['receipt_bytes']:>10} {r['record_bytes']:>9} {r['sign_us']:>8} "
              f"{r['verify_ms']:>10} {r['steps']:>9} {r['chain_s']:>8} {r['chain_MB']:>7}")  # fmt: skip


if __name__ == "__main__":
    main()
