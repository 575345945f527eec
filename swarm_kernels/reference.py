"""The int8 codec's specification, written as a plain-torch reference implementation.

Every implementation (this one, the C++ CPU path, the Triton GPU path) performs exactly these
IEEE-754 fp32 operations, in this order, with no fused multiply-add, so they produce the same
bytes on the same input, on any run and any number of threads. Tests compare them with
``torch.equal``.

Blockwise absmax int8, block size B (default 4096), for x of n elements (fp32, or bf16 widened
exactly to fp32 per element), blocks ``x[k*B : (k+1)*B]`` (the last one may be short):

1. Input range. Every |x_i| must be <= MAX_ABS = 2**127 (this refuses NaN and ±inf, and keeps
   ``127 * scale`` finite); otherwise ``NonFiniteError`` and nothing is encoded.
2. ``absmax = max_i |x_i|`` over the block (exact: no rounding).
3. If ``absmax < TINY = 2**-110`` (all-zero blocks included): ``scale = +0.0`` and every code is 0.
   (Below that, ``127 / absmax`` nears fp32 overflow and subnormal arithmetic differs between
   CPUs and GPUs; such a block is >30 orders of magnitude below any gradient.)
4. Otherwise ``scale = fp32(absmax / 127)`` and ``inv = fp32(127 / absmax)`` (each one
   correctly rounded fp32 division), and ``code_i = round_half_even(fp32(x_i * inv))`` as int8.
   ``|x_i * inv| <= 127 * (1 + 2**-24)**2 < 127.5``, so codes lie in [-127, 127] without a clamp;
   -128 never occurs.
5. Dequantized value: ``v_i = fp32(fp32(code_i) * scale)``.
6. Fused accumulate with weight w (a Python float, rounded once to fp32 ``w32``, must be
   finite): ``acc_i = fp32(acc_i + fp32(w32 * v_i))``: exactly ``acc + w * dequantize(...)``.

Round-trip error: ``|x_i - v_i| <= scale/2 + absmax * 2**-21`` (half a step, plus a few fp32
ulps of the block's absmax from rounding inv, the product and v); for blocks under TINY it is
``|x_i| < 2**-110``.

A payload is well formed (else ``MalformedPayload``, checked before ``acc`` is written) when
every scale is +0.0 or a normal fp32 in [2**-126, MAX_SCALE = fp32(2**127 / 127)] (as bits:
0, or 0x00800000..bits(MAX_SCALE); this refuses negative, -0.0, subnormal, NaN, inf and scales
whose ``127 * scale`` would overflow), no code is -128, and the lengths match (codes: n, scales:
ceil(n / B)). A well-formed payload's dequantized values are finite. ``acc + w * v`` can still
overflow if |w| or |acc| is huge: weights are expected to be normalised (sum 1).

Denormals: none of the codec's own intermediate values are subnormal (scale >= 2**-117), so
flush-to-zero modes change nothing except ``w32 * v_i`` when w32 itself is tiny.
"""

from __future__ import annotations

import struct

import torch

from .errors import MalformedPayload, NonFiniteError

DEFAULT_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 1 << 24
QMAX = 127
MAX_ABS = 2.0**127
MAX_ABS_BITS = 0x7F000000  # fp32 bits of 2**127
TINY = 2.0**-110
TINY_BITS = 0x08800000  # fp32 bits of 2**-110
MIN_SCALE_BITS = 0x00800000  # 2**-126, the smallest normal fp32
MAX_SCALE_BITS = struct.unpack("<I", struct.pack("<f", MAX_ABS / QMAX))[0]
MAX_SCALE = struct.unpack("<f", struct.pack("<I", MAX_SCALE_BITS))[0]
assert MAX_SCALE_BITS == 0x7B810204, "fp32(2**127 / 127)"


def to_fp32_weight(weight: float) -> float:
    """The weight rounded once to fp32, as every implementation uses it; refuses non-finite."""
    try:
        w32 = struct.unpack("<f", struct.pack("<f", float(weight)))[0]
    except OverflowError:
        w32 = float("inf")
    if w32 != w32 or w32 in (float("inf"), float("-inf")):
        raise ValueError(f"weight must be finite in fp32, got {weight!r}")
    return w32


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def nonfinite_error(x: torch.Tensor) -> NonFiniteError:
    """The error for a flat input that breaks rule 1, naming its first bad element."""
    bad = (~(x.float().abs() <= MAX_ABS)).nonzero()
    if bad.numel() == 0:  # pragma: no cover - callers only build this for a bad input
        return NonFiniteError("int8 quantize: input out of range")
    i = int(bad[0, 0])
    return NonFiniteError(
        f"int8 quantize: element {i} of {x.numel()} is {float(x[i])!r}; NaN, inf and |x| > 2**127 are refused"
    )


def _padded_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x (flat fp32) as a (blocks, B) view, zero-padded at the end (zeros change no absmax)."""
    n = x.numel()
    nb = num_blocks(n, block_size)
    if n == nb * block_size:
        return x.view(nb, block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.float32, device=x.device)
    padded[:n] = x
    return padded.view(nb, block_size)


def quantize_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    """Rules 1-4. x: flat fp32 or bf16; codes: int8[n]; scales: fp32[ceil(n/B)] (written)."""
    xf = x.reshape(-1).to(torch.float32)
    if not bool((xf.abs() <= MAX_ABS).all()):
        raise nonfinite_error(xf)
    if xf.numel() == 0:
        return
    xb = _padded_blocks(xf, block_size)
    absmax = xb.abs().amax(dim=1)
    normal = absmax >= TINY
    safe = torch.where(normal, absmax, torch.ones_like(absmax))
    qmax = torch.full_like(absmax, float(QMAX))
    zero = torch.zeros_like(absmax)
    scale = torch.where(normal, safe / qmax, zero)  # tensor / tensor: one correctly rounded division
    inv = torch.where(normal, qmax / safe, zero)  # (not 127 / t, which torch computes as t.reciprocal() * 127)
    q = torch.round(xb * inv[:, None])  # torch.round: half to even
    codes.copy_(q.reshape(-1)[: xf.numel()].to(torch.int8))
    scales.copy_(scale)


def check_payload(codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The well-formedness rule on codes and scales (lengths are checked by the caller)."""
    check_scales(scales)
    check_codes(codes)


def check_scales(scales: torch.Tensor) -> None:
    """Each scale is 0 or a positive normal fp32 in range (MalformedPayload names the first not)."""
    bits = scales.view(torch.int32)
    ok = (bits == 0) | ((bits >= MIN_SCALE_BITS) & (bits <= MAX_SCALE_BITS))
    if not bool(ok.all()):
        k = int((~ok).nonzero()[0, 0])
        raise MalformedPayload(f"int8 payload: scale {k} is {float(scales[k])!r} (bits {int(bits[k]) & 0xFFFFFFFF:#x})")


def check_codes(codes: torch.Tensor) -> None:
    """No code is -128 (MalformedPayload names the first)."""
    if bool((codes == -128).any()):
        i = int((codes == -128).nonzero()[0, 0])
        raise MalformedPayload(f"int8 payload: code {i} is -128")


def _values(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    n = codes.numel()
    return codes.to(torch.float32) * scales.repeat_interleave(block_size)[:n]  # rule 5


def dequantize_into(codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor) -> None:
    """Rule 5 after the payload check. out: fp32[n] (written)."""
    check_payload(codes, scales)
    out.copy_(_values(codes, scales, block_size))


def dequantize_accumulate(
    acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, w32: float, block_size: int
) -> None:
    """Rule 6 after the payload check: acc += w32 * dequantized, acc untouched on error."""
    check_payload(codes, scales)
    v = _values(codes, scales, block_size)
    v.mul_(w32)  # fp32 * fp32 scalar
    acc.add_(v)
