"""Benchmark of the data path: prepare throughput, the chunk loader against a plain memmap
loop and what one inner step consumes, and the latency of a chunk claim in a DHT swarm.

    python -m scripts.bench.data                 # a table
    python -m scripts.bench.data --json          # one JSON object (docs/benchmarks/data/bench_data.jsonl)

- prepare: `swarm-data prepare`'s code (prepare.prepare) on --text-mb of generated text with a
  byte-level BPE trained here, against the tokenizer's own `encode_batch_fast` over the same
  documents in the same run (the target: >= 0.8x);
- loader: ChunkCursor.next_batch (rows of --seq-len + 1 tokens from a memmapped uint16 shard,
  int64 out) against a plain numpy memmap slice loop building the same batches, one core
  (torch.set_num_threads(1)); tokens/s is batch x seq_len per call, and the last column says how
  many times faster than a step of the 150m preset on an H100 (335k tokens/s compiled) it is;
- claims: --nodes DHT nodes on 127.0.0.1 in one event loop; every node runs one claim cycle at
  once (read, pick, one store, read), then the cycles go on until every node holds its chunks:
  the median and max seconds of a cycle, DHT stores per claimed chunk, and how many chunks two
  nodes hold (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

H100_150M_TOKENS_PER_S = 335_000


def bench_prepare(text_mb: float, folder: Path) -> dict[str, Any]:
    import tokenizers

    from swarm.model.prepare import LoadedTokenizer, PrepareConfig, load_tokenizer, prepare

    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    docs, size = [], 0
    while size < text_mb * 1e6:
        doc = " ".join(rng.choice(words) for _ in range(rng.randint(50, 400)))
        docs.append(doc)
        size += len(doc)
    (folder / "text.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=alphabet)  # fmt: skip
    tok.train_from_iterator(docs[:2000], trainer)
    tok.save(str(folder / "tok.json"))
    loaded: LoadedTokenizer = load_tokenizer(str(folder / "tok.json"))
    t0 = time.perf_counter()
    encoded = sum(len(e.ids) for e in loaded.tokenizer.encode_batch_fast(docs, add_special_tokens=False))
    encode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = prepare([folder / "text.jsonl"], loaded, folder / "prepared", PrepareConfig(shard_tokens=1 << 22))
    prepare_s = time.perf_counter() - t0
    return {"text_MB": round(size / 1e6, 1), "tokens": result.tokens, "encode_tokens_per_s": round(encoded / encode_s),
            "prepare_tokens_per_s": round(result.tokens / prepare_s),
            "prepare_over_encode": round((result.tokens / prepare_s) / (encoded / encode_s), 3)}  # fmt: skip


def bench_loader(folder: Path, seq_len: int, batch: int, seconds: float) -> dict[str, Any]:
    from swarm.data.chunks import ChunkPlan
    from swarm.data.cursor import ChunkCursor
    from swarm.model.data import ShardedTokens

    torch.set_num_threads(1)
    n = 1 << 26
    path = folder / "shard.bin"
    np.random.default_rng(0).integers(0, 1 << 16, n, dtype=np.uint16).tofile(path)
    shard = np.memmap(path, dtype="<u2", mode="r", shape=(n,))
    plan, tokens = ChunkPlan.of([n]), ShardedTokens([shard])

    def fresh() -> ChunkCursor:  # every chunk offered, as a claimer would over an epoch
        cursor = ChunkCursor(plan, tokens, seq_len=seq_len)
        for chunk in range(plan.n):
            cursor.offer(0, chunk, 0.0)
        return cursor

    cursors = [fresh()]

    def ours() -> None:
        if not cursors[0].held():
            cursors[0] = fresh()
        cursors[0].next_batch(batch, timeout=1)

    offset = [0]

    def plain() -> None:
        start = offset[0]
        rows = [shard[start + r * seq_len : start + r * seq_len + seq_len + 1] for r in range(batch)]
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        inputs, targets = windows[:, :-1], windows[:, 1:]  # the same views as ours
        del inputs, targets
        offset[0] = (start + batch * seq_len) % (n - batch * seq_len - 1)

    rates = {}
    for name, fn in (("loader", ours), ("memmap_loop", plain), ("loader2", ours), ("memmap_loop2", plain)):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 4:
            fn()
            calls += 1
        rates[name] = calls * batch * seq_len / (time.perf_counter() - t0)
    loader = max(rates["loader"], rates["loader2"])
    plain_rate = max(rates["memmap_loop"], rates["memmap_loop2"])
    return {"seq_len": seq_len, "batch": batch, "step_tokens": batch * seq_len, "loader_tokens_per_s": round(loader),
            "memmap_loop_tokens_per_s": round(plain_rate), "loader_over_memmap": round(loader / plain_rate, 3),
            "loader_over_150m_h100": round(loader / H100_150M_TOKENS_PER_S, 1)}  # fmt: skip


async def bench_claims(nodes: int, chunks: int) -> dict[str, Any]:
    from swarm.data.chunks import ChunkPlan
    from swarm.data.claimer import ChunkClaimer, ClaimerConfig
    from swarm.data.claims import MAX_LIVE
    from swarm.data.cursor import ChunkCursor
    from swarm.dht import DHTNode
    from swarm.model.data import ShardedTokens
    from swarm.p2p import P2PConfig

    local = P2PConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    first = await DHTNode(p2p_config=local).start()
    dhts = [first]
    for _ in range(nodes - 1):
        dhts.append(await DHTNode(p2p_config=local, initial_peers=first.visible_maddrs).start())
    try:
        plan = ChunkPlan.of([1025] * chunks, chunk_tokens=1025)
        tokens = ShardedTokens([np.zeros(1025, dtype=np.uint16)] * chunks)  # claimed, never read here
        claimers = [ChunkClaimer(d, "bench", ChunkCursor(plan, tokens, seq_len=64), ClaimerConfig()) for d in dhts]
        seconds: list[float] = []

        async def timed(c: ChunkClaimer) -> None:
            t0 = time.perf_counter()
            await c.cycle()
            seconds.append(time.perf_counter() - t0)

        for _ in range(6):  # contested claims settle over a few cycles (a second read a second later)
            await asyncio.gather(*(timed(c) for c in claimers if c.cursor.wants(MAX_LIVE)))
            if not any(c.cursor.wants(MAX_LIVE) for c in claimers):
                break
            await asyncio.sleep(1.0)
        held = [chunk for c in claimers for chunk, _ in c.cursor.held()]
        stores = sum(c.stores for c in claimers)
    finally:
        await asyncio.gather(*(d.close() for d in dhts))
    return {"nodes": nodes, "chunks": chunks, "claimed": len(held), "double": len(held) - len(set(held)),
            "cycle_s_median": round(statistics.median(seconds), 4), "cycle_s_max": round(max(seconds), 4),
            "stores_per_claim": round(stores / max(1, len(held)), 2),
            "yields": sum(c.yields for c in claimers)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text-mb", type=float, default=20.0)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0, help="loader timing, all four runs together")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("SWARM_DHT_ID_BITS", "8")  # ids cost 1 ms here, as in the tests
    with tempfile.TemporaryDirectory() as tmp:
        result = {"time": round(time.time()), "cpus": os.cpu_count(),
                  "prepare": bench_prepare(args.text_mb, Path(tmp)),
                  "loader": bench_loader(Path(tmp), args.seq_len, args.batch, args.seconds),
                  "claims": asyncio.run(bench_claims(args.nodes, args.chunks))}  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return
    for section in ("prepare", "loader", "claims"):
        print(f"{section}:")
        for key, value in result[section].items():
            print(f"  {key:<28} {value:>14,}" if isinstance(value, int) else f"  {key:<28} {value:>14}")


if __name__ == "__main__":
    main()
