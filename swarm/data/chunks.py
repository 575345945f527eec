"""Chunks: the unit of data a node claims, a fixed token range of one train shard.

    plan = ChunkPlan.of([len(s) for s in shards])      # the same on every node of the run
    plan.n, plan.range(i)                              # how many; chunk i's [start, end) in the stream

A chunk never crosses a shard (a node that downloads shards as it claims chunks fetches one
shard per chunk), and holds CHUNK_TOKENS tokens or the shard's rest. Since the manifest's digest
is a run setting and the plan is a function of the shards' lengths, every node of a run cuts
the same chunks. Done sets travel as bitmaps (bit i: chunk i), zlib-compressed: a node trains
runs of neighbouring chunks, so its bitmap is mostly zeros and ones in long runs.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CHUNK_TOKENS = 1 << 22  # 4 Mi tokens: about 12 s of the 150m preset on an H100, minutes on a CPU
MAX_CHUNKS = 1 << 17  # a done bitmap of 16 KiB: two of them fit a DHT value (64 KiB) compressed or not


class ChunkError(ValueError):
    """Data that cannot be cut into chunks (too many), or a done set of another plan."""


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    starts: tuple[int, ...]  # stream offset of each chunk
    ends: tuple[int, ...]
    shards: tuple[int, ...]  # the shard each chunk lies in

    @classmethod
    def of(cls, shard_lengths: Sequence[int], chunk_tokens: int = CHUNK_TOKENS) -> ChunkPlan:
        if chunk_tokens <= 0 or not shard_lengths or any(n <= 0 for n in shard_lengths):
            raise ChunkError("chunks need positive shard lengths and a positive chunk size")
        starts, ends, shards, offset = [], [], [], 0
        for shard, length in enumerate(shard_lengths):
            for begin in range(0, length, chunk_tokens):
                starts.append(offset + begin)
                ends.append(offset + min(begin + chunk_tokens, length))
                shards.append(shard)
                if len(starts) > MAX_CHUNKS:
                    raise ChunkError(f"the data makes more than {MAX_CHUNKS} chunks of {chunk_tokens} tokens")
            offset += length
        return cls(tuple(starts), tuple(ends), tuple(shards))

    @property
    def n(self) -> int:
        return len(self.starts)

    @property
    def tokens(self) -> int:
        return self.ends[-1]

    def range(self, chunk: int) -> tuple[int, int]:
        return self.starts[chunk], self.ends[chunk]

    def rows(self, chunk: int, seq_len: int) -> int:
        """Training rows of seq_len + 1 tokens in the chunk, taken seq_len apart (the last token
        of a row is the first of the next, as a target)."""
        start, end = self.range(chunk)
        return max(0, (end - start - 1) // seq_len)


def empty(n: int) -> np.ndarray:
    return np.zeros(n, dtype=bool)


def pack_done(done: np.ndarray) -> bytes:
    return zlib.compress(np.packbits(done).tobytes(), 6)


def unpack_done(raw: object, n: int) -> np.ndarray | None:
    """A done set of n chunks from its wire form; None when malformed (never raises): the
    decompression stops at the bitmap's size, so a small value cannot expand into a large one."""
    if not isinstance(raw, bytes) or not 0 < n <= MAX_CHUNKS or len(raw) > MAX_CHUNKS:
        return None
    size = (n + 7) // 8
    try:
        inflater = zlib.decompressobj()
        bits = inflater.decompress(raw, size + 1)
    except zlib.error:
        return None
    if len(bits) != size or inflater.unconsumed_tail:
        return None
    done = np.unpackbits(np.frombuffer(bits, dtype=np.uint8))
    if done[n:].any():  # bits past the last chunk: not our plan
        return None
    return done[:n].astype(bool)
