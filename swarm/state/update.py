"""The update of one outer step, in bytes: what a node one step behind catches up with.

After a round every member holds the same averaged pseudo-gradient Δ̄_t (DESIGN invariant 4),
and θ_outer(t) with its momentum and Δ̄_t make the state of step t+1 (DiLoCo.stepped_state). A
node that holds the state of step t can therefore take Δ̄_t instead of the whole state of t+1:
in int8 about 1/8 of the bytes (Δ̄_t in int8 against θ_outer and momentum in fp32). The state
keeper checks what it computes against the manifest of step t+1 that trust.py chose
(swarm/state/update_fetch.py), so a peer's update is never believed, only used.

The encoding is exact. Δ̄_t came out of the round's codec (every member decoded the same bytes),
and encoding those values again with the same codec and block size gives them back bit for bit
(the int8 spec's absmax grid maps onto itself). Every block is checked; one that does not come
back (another codec's values, blocks that do not line up with the round's) travels as raw fp32.

    body   = header | codec payload of the flat Δ̄_t | mask: 1 byte a block (1: raw) | raw blocks
    header = b"SWU1" | codec name, 8 bytes NUL-padded | block size u32 | numel u64 | raw blocks u64
    raw blocks: each block's block_size fp32 values (the last one zero-padded), little-endian

Bounds: a reader checks the header against the numel it expects before it allocates anything
(`body_length`), and every length exactly; a malformed body is an UpdateError.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from swarm.utils.tensor_layout import flatten, split
from swarm_kernels import Codec, MalformedPayload, as_uint8, get_codec

MAGIC = b"SWU1"
HEADER = struct.Struct("<4s8sIQQ")
CODECS = ("int8", "int4", "int2", "fp16", "none")  # decodable on any machine (bnb8 needs CUDA)
RAW_BLOCK = 64  # the mask's block for codecs without one of their own (fp16, none)
MAX_BLOCK = 1 << 20


class UpdateError(ValueError):
    """A step update's bytes are malformed or do not fit the tensors they are for."""


def _codec_of(name: str, block_size: int) -> Codec:
    return get_codec(name, block_size=block_size) if name in ("int8", "int4", "int2") else get_codec(name)


def encode_update(tensors: Sequence[torch.Tensor], codec: str, block_size: int) -> bytes:
    """The body of the update `tensors` (the averaged Δ̄ of a step, in its tensors' order), with
    `codec` (the round's; another than CODECS travels as "none") at `block_size`. Tensor work:
    run it in a thread."""
    if codec not in CODECS:
        codec = "none"
    block = block_size if codec in ("int8", "int4", "int2") else RAW_BLOCK
    flat = flatten(tensors)
    n = flat.numel()
    coder = _codec_of(codec, block)
    payload = coder.encode(flat)
    blocks = -(-n // block)
    differs = torch.zeros(blocks * block, dtype=torch.bool)  # bit for bit, so -0.0 is not +0.0
    differs[:n] = coder.decode(payload, n).view(torch.int32) != flat.view(torch.int32)
    raw = differs.view(blocks, block).any(dim=1)
    del differs
    count = int(raw.sum())
    if codec != "none" and body_length(codec, block, n, count) > body_length("none", RAW_BLOCK, n, 0):
        return encode_update([flat], "none", RAW_BLOCK)  # mostly raw blocks: plain fp32 is smaller
    raw_values = torch.zeros(count, block, dtype=torch.float32)  # usually none: the round's own grid
    whole = n // block
    index = raw.nonzero().flatten()
    inside = index[index < whole]
    raw_values[: inside.numel()] = flat[: whole * block].view(whole, block)[inside]
    if inside.numel() < count:  # the short last block is raw too: zero-padded
        raw_values[-1, : n - whole * block] = flat[whole * block :]
    header = HEADER.pack(MAGIC, codec.encode().ljust(8, b"\0"), block, n, count)
    return b"".join((header, as_uint8(payload).numpy().tobytes(), raw.to(torch.uint8).numpy().tobytes(),
                     raw_values.numpy().tobytes()))  # fmt: skip


def parse_header(head: bytes | bytearray | memoryview, numel: int) -> tuple[str, int, int]:
    """(codec, block size, raw blocks) of a body's header, checked against the `numel` the
    reader expects; UpdateError otherwise."""
    if len(head) < HEADER.size:
        raise UpdateError(f"{len(head)} bytes: shorter than the update's header")
    magic, name, block, n, raw = HEADER.unpack_from(head)
    codec = bytes(name).rstrip(b"\0").decode("ascii", "replace")
    if magic != MAGIC:
        raise UpdateError("not a step update (bad magic)")
    if codec not in CODECS:
        raise UpdateError(f"unknown codec {codec!r}")
    if n != numel:
        raise UpdateError(f"it is for {n} elements, this step's tensors have {numel}")
    if not 1 <= block <= MAX_BLOCK or (codec in ("fp16", "none") and block != RAW_BLOCK):
        raise UpdateError(f"bad block size {block} for {codec}")
    try:
        _codec_of(codec, block)
    except ValueError as e:  # a block size the codec cannot use
        raise UpdateError(str(e)) from None
    if raw > -(-n // block):
        raise UpdateError(f"{raw} raw blocks of {-(-n // block)}")
    return codec, block, raw


def body_length(codec: str, block: int, numel: int, raw: int) -> int:
    return HEADER.size + _codec_of(codec, block).encoded_nbytes(numel) + -(-numel // block) + 4 * block * raw


def max_body_length(numel: int) -> int:
    """The longest body an update of `numel` elements can have (fp32 payload, every block raw)."""
    return body_length("none", RAW_BLOCK, numel, -(-numel // RAW_BLOCK))


def decode_update(body: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
    """The flat fp32 Δ̄ of `numel` elements a body carries; UpdateError when it is malformed.
    Tensor work: run it in a thread."""
    codec, block, raw = parse_header(body, numel)
    if len(body) != (expected := body_length(codec, block, numel, raw)):
        raise UpdateError(f"{len(body)} bytes, its header says {expected}")
    coder, blocks = _codec_of(codec, block), -(-numel // block)
    start = HEADER.size
    end = start + coder.encoded_nbytes(numel)
    data = torch.frombuffer(bytearray(body), dtype=torch.uint8)  # one copy: writable, aligned
    try:
        flat = coder.decode(data[start:end], numel)
    except (MalformedPayload, ValueError) as e:
        raise UpdateError(f"its {codec} payload is malformed: {e}") from None
    mask = data[end : end + blocks]
    if bool((mask > 1).any()) or int(mask.sum()) != raw:
        raise UpdateError("its mask of raw blocks does not match its header")
    if raw:
        values = torch.frombuffer(bytearray(body[end + blocks :]), dtype=torch.float32).view(raw, block)
        padded = torch.zeros(blocks * block, dtype=torch.float32)
        padded[:numel] = flat
        padded.view(blocks, block)[mask.bool()] = values
        flat = padded[:numel].clone()
    return flat


def split_update(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """The flat Δ̄ cut back into tensors of `shapes` (their numels must sum to its length)."""
    try:
        return split(flat, shapes)
    except ValueError as e:  # a peer's update: its own typed error
        raise UpdateError(str(e)) from None
