"""The bytes a round moves on its streams: an encoded slice out, a result's header and payload in.

Both kinds of round (rounds/flat.py, rounds/grid.py) answer a stream with a msgpack header naming
the members a result includes, then the encoded result; `Final` is such a result, held.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import torch

from swarm.averaging.errors import AllReduceError
from swarm.averaging.rounds.partition import chunk_bounds
from swarm.averaging.rounds.reduction import byte_buffer
from swarm.p2p.stream import Stream
from swarm_kernels import as_memoryview

MAX_HEADER_BYTES = 64 * 1024

Final = tuple[list[int], memoryview]  # (member indices included, encoded average)


async def read_exactly(stream: Stream, size: int, timeout: float) -> memoryview:
    """The rest of a stream, which must be `size` bytes, copied once into one buffer."""
    buffer, got = byte_buffer(size), 0
    while (chunk := await stream.read(timeout=timeout)) is not None:
        if got + len(chunk) > size:
            raise AllReduceError(f"more than the {size} bytes expected")
        buffer[got : got + len(chunk)] = chunk
        got += len(chunk)
    if got != size:
        raise AllReduceError(f"got {got} bytes, expected {size}")
    return buffer


async def read_into(stream: Stream, out: memoryview, timeout: float) -> None:
    """Fill `out` from the stream's next chunks, which must end exactly at its end (more follows
    on the stream, in chunks of its own: the writer wrote `out`'s bytes as one piece)."""
    got = 0
    while got < len(out):
        chunk = await stream.read(timeout=timeout)
        if chunk is None or got + len(chunk) > len(out):
            ended = got if chunk is None else got + len(chunk)
            raise AllReduceError(f"a chunk of {len(out)} bytes ended after {ended}")
        out[got : got + len(chunk)] = chunk
        got += len(chunk)


async def write_encoded(stream: Stream, codec: Any, vector: torch.Tensor, lo: int, hi: int, chunk_elements: int) -> int:
    """Stream vector[lo:hi] encoded chunk by chunk (chunk i+1 is encoded in a worker thread
    while chunk i is on the wire), as payload_layout(lo, hi) lays it out; the bytes written."""
    chunks = chunk_bounds(lo, hi, chunk_elements)
    sent = 0
    encoding = asyncio.ensure_future(asyncio.to_thread(codec.encode, vector[lo : chunks[0][1]]))
    try:
        for c in range(len(chunks)):
            payload = await encoding
            if c + 1 < len(chunks):
                a, b = chunks[c + 1]
                encoding = asyncio.ensure_future(asyncio.to_thread(codec.encode, vector[a:b]))
            data = as_memoryview(payload)
            await stream.write(data)
            sent += len(data)
    finally:
        encoding.cancel()
    return sent


async def read_header(stream: Stream, timeout: float) -> tuple[dict[str, Any], int]:
    """The msgpack map that heads a result (and its size); AllReduceError on anything else,
    including {"none": true} (the peer holds no result)."""
    header_raw = await stream.read(timeout=timeout)
    if header_raw is None or len(header_raw) > MAX_HEADER_BYTES:
        raise AllReduceError("no result header")
    try:
        header = msgpack.unpackb(header_raw, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise AllReduceError(f"unreadable result header: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise AllReduceError("malformed result header")
    if header.get("none"):
        raise AllReduceError("the peer holds no result for this part")
    return header, len(header_raw)
