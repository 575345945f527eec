"""The int4 and int2 codecs' specification, written as a plain-torch reference implementation.

As for int8 (reference.py), every implementation (this one, the C++ CPU path) performs exactly
these IEEE-754 fp32 operations with no fused multiply-add, so they write the same bytes on any
run and any number of threads; tests compare them with ``torch.equal``.

Blockwise absmax on a lookup grid, b bits a code (int4: b = 4, int2: b = 2), k = 8 / b codes a
byte, block size B a multiple of k (so every block starts on a byte), for x of n elements (fp32,
or bf16 widened exactly to fp32), blocks ``x[j*B : (j+1)*B]`` (the last one may be short):

1. Input range. Every |x_i| must be <= MAX_ABS = 2**127 (this refuses NaN and ±inf); otherwise
   ``NonFiniteError`` and nothing is encoded.
2. ``absmax = max_i |x_i|`` over the block (exact).
3. If ``absmax < TINY = 2**-110`` (all-zero blocks included): ``scale = +0.0``, every code 0.
4. Otherwise ``scale = absmax`` (stored as it is) and ``inv = fp32(1 / absmax)`` (one correctly
   rounded division), ``t_i = fp32(|x_i| * inv)``, and the magnitude index
   ``m_i = #{j >= 1 : t_i > T[j]}``, with ``T[j]`` the fp32 midpoint of the grid magnitudes
   ``G[j-1]`` and ``G[j]`` (below; a tie ``t_i == T[j]`` goes to the smaller magnitude). The code
   is ``m_i``, plus the sign bit ``S = 2**(b-1)`` when x_i < 0 and m_i > 0: codes are the
   integers -M..M (M = len(G) - 1) in sign-magnitude form, and ``S`` alone ("-0") never occurs.
5. Value: ``v_i = fp32(G[m_i] * scale)``, negated when the sign bit is set.
6. Fused accumulate with weight w (rounded once to fp32 ``w32``, finite):
   ``acc_i = fp32(acc_i + fp32(w32 * v_i))``.

The grids G (magnitudes of |x| / absmax; INT4 and INT2 below hold their fp32 bits):

- int4: ``0, 0.0751, 0.1663, 0.2738, 0.4003, 0.5516, 0.7405, 1``: codes -7..7;
- int2: ``0, 0.4``: ternary, values ``{-0.4, 0, +0.4} * absmax``.

Why these grids (relative RMS error ``|x - v| / |x|`` of one encoding, at equal bytes: the same
block size B; "pseudo-gradients": 50 AdamW steps of a tiny Llama, theta_before - theta_after, not
used in any fit). int4's grid was fitted by Lloyd-Max (1-D k-means) to |x| / absmax of blocks of
64 of gaussian, Laplace, Student-t(3) and gaussian x lognormal samples, with 0 and 1 pinned.
Against the plain absmax grid k/7 (codes -7..7 on a uniform grid):

    int4, B = 64      gaussian 0.108 -> 0.098   t(3) 0.181 -> 0.123   pseudo-gradients 0.113 -> 0.099
    int4, B = 4096    gaussian 0.159 -> 0.121   t(3) 0.530 -> 0.351   pseudo-gradients 0.230 -> 0.153

int2 keeps 0 on its grid: grids without 0 (``{±1/3, ±1}``, or a Lloyd fit) erred above 1 on
heavy-tailed data (worse than sending nothing); with 0 on the grid and nearest rounding,
|x_i - v_i| <= |x_i| (up to rounding) always. Against the plain absmax ternary {-1, 0, 1}:

    int2, B = 64      gaussian 0.718 -> 0.454   t(3) 0.681 -> 0.584   pseudo-gradients 0.705 -> 0.468

The level 0.4 is within 0.015 of the best level tried (0.25-0.5) on pseudo-gradients at blocks
of 64 and 256 (the averaging's default block is 64); at blocks of 1024-4096 a level of 0.25-0.3
would err 0.02-0.08 less: int2 wants small blocks. For scale: int8 errs 0.006 (gaussian), 0.011
(t(3)), 0.006 (pseudo-gradients) at B = 64, for 1.0625 bytes a parameter; int4 sends 0.5625 and
int2 0.3125 (0.501 and 0.251 at B = 4096).

Wire layout (little-endian): ``scales fp32[ceil(n/B)]`` then ``ceil(n/k)`` bytes of codes; the
code of element i sits in byte ``i // k`` at bits ``[b*(i % k), b*(i % k) + b)`` (the first
element in the low bits), and the bits after the last code are 0.

A payload is well formed (else ``MalformedPayload``, checked before ``acc`` is written) when its
length is right, every scale is +0.0 or in [TINY, MAX_ABS] (bits 0 or TINY_BITS..MAX_ABS_BITS:
what step 3-4 can write; this refuses negative, -0.0, NaN and inf), no code is ``S`` alone, and
the padding bits are 0. Its values are then finite (|v_i| <= 2**127).

Round-trip error: ``|x_i - v_i| <= absmax * (gap_i / 2 + 2**-21)``, with gap_i the distance
between the grid magnitudes around |x_i| / absmax (int4: at most 0.26; int2: |x_i| is clipped to
0.4 * absmax above it). Denormals: inv <= 2**110 and a subnormal |x_i| < 2**-126 gives
t_i < 2**-16 < T[1] either way, so flush-to-zero modes change no code.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass

import torch

from .errors import MalformedPayload, NonFiniteError
from .reference import MAX_ABS, MAX_ABS_BITS, TINY, TINY_BITS, _padded_blocks, num_blocks


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


@dataclass(frozen=True, slots=True)
class Format:
    """One low-bit format: its code width and its grid (fp32 bits, magnitude 0 first)."""

    name: str
    bits: int
    grid_bits: tuple[int, ...]  # G[0] = 0 < G[1] < ... <= 1
    threshold_bits: tuple[int, ...]  # T[1..M]: fp32(fp32(G[j-1] + G[j]) * 0.5)

    @property
    def codes_per_byte(self) -> int:
        return 8 // self.bits

    @property
    def sign(self) -> int:
        """The sign bit of a code; the code holding it alone ("-0") is malformed."""
        return 1 << (self.bits - 1)

    @property
    def grid(self) -> list[float]:
        return [_f32(b) for b in self.grid_bits]

    @property
    def thresholds(self) -> list[float]:
        return [_f32(b) for b in self.threshold_bits]

    def packed_nbytes(self, numel: int) -> int:
        return -(-numel // self.codes_per_byte)

    def nbytes(self, numel: int, block_size: int) -> int:
        """The payload's length: scales, then the packed codes."""
        return 4 * num_blocks(numel, block_size) + self.packed_nbytes(numel)


INT4 = Format(
    "int4",
    4,
    (0x0, 0x3D99CE07, 0x3E2A4A8C, 0x3E8C2F83, 0x3ECCF41F, 0x3F0D35A8, 0x3F3D9168, 0x3F800000),
    (0x3D19CE07, 0x3DF73190, 0x3E6154C9, 0x3EAC91D1, 0x3EF3AFB8, 0x3F256388, 0x3F5EC8B4),
)
INT2 = Format("int2", 2, (0x0, 0x3ECCCCCD), (0x3E4CCCCD,))
FORMATS = {f.name: f for f in (INT4, INT2)}

for _fmt, _decimals in ((INT4, (0.0, 0.0751, 0.1663, 0.2738, 0.4003, 0.5516, 0.7405, 1.0)), (INT2, (0.0, 0.4))):
    assert _fmt.grid_bits == tuple(_bits(d) for d in _decimals), _fmt.name
    _g = _fmt.grid
    assert _fmt.threshold_bits == tuple(_bits(_f32(_bits(a + b)) * 0.5) for a, b in itertools.pairwise(_g)), _fmt.name
    assert len(_g) - 1 < _fmt.sign
del _fmt, _decimals, _g


def check_block_size(block_size: int, fmt: Format, max_block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= max_block_size:
        raise ValueError(f"block_size must be an int in [1, {max_block_size}], got {block_size!r}")
    if block_size % fmt.codes_per_byte:
        raise ValueError(
            f"{fmt.name}: block_size must be a multiple of {fmt.codes_per_byte} (codes a byte), got {block_size}"
        )
    return block_size


def nonfinite_error(fmt: Format, x: torch.Tensor) -> NonFiniteError:
    """The error for a flat input that breaks rule 1, naming its first bad element."""
    bad = (~(x.float().abs() <= MAX_ABS)).nonzero()
    i = int(bad[0, 0]) if bad.numel() else -1
    value = float(x[i]) if bad.numel() else float("nan")
    return NonFiniteError(
        f"{fmt.name} quantize: element {i} of {x.numel()} is {value!r}; NaN, inf and |x| > 2**127 are refused"
    )


def pack(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """codes (flat ints in [0, 2**b)) -> uint8[ceil(n/k)], first code in the low bits."""
    k = fmt.codes_per_byte
    padded = torch.zeros(fmt.packed_nbytes(codes.numel()) * k, dtype=torch.int32, device=codes.device)
    padded[: codes.numel()] = codes
    shifts = torch.arange(k, dtype=torch.int32, device=codes.device) * fmt.bits
    return (padded.view(-1, k) << shifts).sum(dim=1).to(torch.uint8)


def unpack(packed: torch.Tensor, fmt: Format) -> torch.Tensor:
    """uint8[m] -> int32[m*k], the codes padding included."""
    shifts = torch.arange(fmt.codes_per_byte, dtype=torch.int32, device=packed.device) * fmt.bits
    return ((packed.to(torch.int32)[:, None] >> shifts) & ((1 << fmt.bits) - 1)).reshape(-1)


def quantize_into(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, block_size: int, fmt: Format) -> None:
    """Rules 1-4. x: flat fp32 or bf16; packed: uint8[ceil(n/k)]; scales: fp32[ceil(n/B)]."""
    xf = x.reshape(-1).to(torch.float32)
    if not bool((xf.abs() <= MAX_ABS).all()):
        raise nonfinite_error(fmt, xf)
    n = xf.numel()
    if n == 0:
        return
    xb = _padded_blocks(xf, block_size)
    ax = xb.abs()
    absmax = ax.amax(dim=1)
    normal = absmax >= TINY
    ones, zero = torch.ones_like(absmax), torch.zeros_like(absmax)
    inv = torch.where(normal, ones / torch.where(normal, absmax, ones), zero)  # tensor / tensor: correctly rounded
    t = ax * inv[:, None]
    m = torch.zeros(t.shape, dtype=torch.int32, device=t.device)
    for threshold in fmt.thresholds:
        m += (t > threshold).to(torch.int32)
    codes = m | ((torch.signbit(xb) & (m > 0)).to(torch.int32) << (fmt.bits - 1))
    packed.copy_(pack(codes.reshape(-1)[:n], fmt))
    scales.copy_(torch.where(normal, absmax, zero))


def check_payload(packed: torch.Tensor, scales: torch.Tensor, numel: int, fmt: Format) -> None:
    """The well-formedness rule on scales and codes (lengths are checked by the caller)."""
    bits = scales.view(torch.int32)
    ok = (bits == 0) | ((bits >= TINY_BITS) & (bits <= MAX_ABS_BITS))
    if not bool(ok.all()):
        k = int((~ok).nonzero()[0, 0])
        raise MalformedPayload(
            f"{fmt.name} payload: scale {k} is {float(scales[k])!r} (bits {int(bits[k]) & 0xFFFFFFFF:#x})"
        )
    codes = unpack(packed, fmt)
    minus_zero = codes[:numel] == fmt.sign
    if bool(minus_zero.any()):
        raise MalformedPayload(f"{fmt.name} payload: code {int(minus_zero.nonzero()[0, 0])} is -0 (the sign bit alone)")
    if bool((codes[numel:] != 0).any()):
        raise MalformedPayload(f"{fmt.name} payload: the padding bits after code {numel - 1} are not 0")


def _values(packed: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int, fmt: Format) -> torch.Tensor:
    codes = unpack(packed, fmt)[:numel]
    grid = torch.tensor(fmt.grid, dtype=torch.float32, device=packed.device)
    v = grid[codes & (fmt.sign - 1)] * scales.repeat_interleave(block_size)[:numel]  # rule 5
    return torch.where((codes & fmt.sign) != 0, -v, v)


def dequantize_into(
    packed: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor, fmt: Format
) -> None:
    """Rule 5 after the payload check. out: fp32[n] (written)."""
    check_payload(packed, scales, out.numel(), fmt)
    out.copy_(_values(packed, scales, out.numel(), block_size, fmt))


def dequantize_accumulate(
    acc: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, w32: float, block_size: int, fmt: Format
) -> None:
    """Rule 6 after the payload check: acc += w32 * dequantized, acc untouched on error."""
    check_payload(packed, scales, acc.numel(), fmt)
    v = _values(packed, scales, acc.numel(), block_size, fmt)
    v.mul_(w32)  # fp32 * fp32 scalar
    acc.add_(v)
