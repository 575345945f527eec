"""The int4 and int2 codecs (lowbit_reference.py): the wire layout, the spec's corner cases, the
error bound, payload validation, and the C++ path equal to the reference bit for bit on any
thread count."""

from __future__ import annotations

import itertools
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm_kernels import MalformedPayload, NonFiniteError, _cpu, as_memoryview, codecs, get_codec, lowbit
from swarm_kernels import lowbit_reference as spec
from swarm_kernels.reference import MAX_ABS, TINY, num_blocks

BLOCKS = [64, 4096, 1000, 36, 4]  # multiples of 4: valid for both formats
LENGTHS = [0, 1, 2, 3, 5, 7, 31, 33, 63, 64, 65, 1023, 4097, 3 * 4096 + 5, 100_003]


@pytest.fixture(params=["int4", "int2"])
def fmt(request: pytest.FixtureRequest) -> spec.Format:
    return spec.FORMATS[request.param]


def sample(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values over many magnitudes, with zeros, -0.0 and values on the thresholds mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    x[torch.rand(n, generator=g) < 0.02] = -0.0
    if n >= 8:  # exact ties: with absmax 1 in a block, t is |x| itself
        x[0] = 1.0
        x[1 : 1 + len(spec.INT4.thresholds)] = torch.tensor(spec.INT4.thresholds)
        x[-1] = -spec.INT2.thresholds[0]
    return x.to(dtype)


def payload_parts(payload: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = num_blocks(n, block)
    return payload[4 * nb :], payload[: 4 * nb].clone().view(torch.float32)


# --- the spec -------------------------------------------------------------------------------------


def test_the_formats() -> None:
    assert spec.INT4.grid == pytest.approx([0, 0.0751, 0.1663, 0.2738, 0.4003, 0.5516, 0.7405, 1], abs=1e-7)
    assert spec.INT2.grid == pytest.approx([0, 0.4], abs=1e-7)
    for f in (spec.INT4, spec.INT2):
        g = f.grid
        assert g[0] == 0 and g == sorted(g) and g[-1] <= 1
        assert all(a < t < b for a, t, b in zip(g, f.thresholds, g[1:], strict=False))
        assert len(g) - 1 < f.sign and f.codes_per_byte * f.bits == 8
    assert spec.INT4.nbytes(101, 64) == 4 * 2 + 51 and spec.INT2.nbytes(101, 64) == 4 * 2 + 26


def test_the_wire_layout_by_hand(impl: str) -> None:
    """With absmax 1, t = |x|: grid points give their codes; ties go to the smaller magnitude."""
    g4 = spec.INT4.grid
    x = torch.tensor([1.0, -1.0, 0.0, g4[5], -g4[1]])  # codes 7, -7, 0, 5, -1
    payload = get_codec("int4", block_size=64, impl=impl).encode(x)
    assert bytes(as_memoryview(payload)) == struct.pack("<f", 1.0) + bytes([0xF7, 0x50, 0x09])
    tie = spec.INT2.thresholds[0]
    x = torch.tensor([1.0, -0.3, 0.1, 0.25, -1.0, 0.0, tie, 0.2000001])  # 1, -1, 0, 1 | -1, 0, 0, 1
    payload = get_codec("int2", block_size=64, impl=impl).encode(x)
    assert bytes(as_memoryview(payload)) == struct.pack("<f", 1.0) + bytes([0b01_00_11_01, 0b01_00_00_11])
    decoded = get_codec("int2", block_size=64, impl=impl).decode(payload, 8)
    a = spec.INT2.grid[1]
    assert decoded.tolist() == [a, -a, 0.0, a, -a, 0.0, 0.0, a]


def test_special_values(impl: str, fmt: spec.Format) -> None:
    packed, scales = lowbit.quantize(torch.zeros(5000), fmt, 4096, impl=impl)
    assert not bool(packed.any()) and scales.view(torch.int32).tolist() == [0, 0]  # +0.0, not -0.0
    x = torch.tensor([TINY * 0.99, -TINY * 0.5, 1e-45, -0.0])  # a block under TINY
    packed, scales = lowbit.quantize(x, fmt, 4, impl=impl)
    assert not bool(packed.any()) and scales.view(torch.int32).tolist() == [0]
    x = torch.tensor([MAX_ABS, -MAX_ABS, 1.0, 1e-40])  # the largest magnitude; a subnormal codes to 0
    packed, scales = lowbit.quantize(x, fmt, 4, impl=impl)
    assert scales.tolist() == [MAX_ABS]
    v = lowbit.dequantize(packed, scales, 4, fmt, 4, impl=impl)
    top = fmt.grid[-1] * MAX_ABS
    assert v.tolist() == [top, -top, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_refused(impl: str, fmt: spec.Format, dtype: torch.dtype) -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in (0, 63, 64, 9999):
            x = torch.randn(10_000).to(dtype)
            x[pos] = bad
            with pytest.raises(NonFiniteError, match=f"{fmt.name} quantize: element {pos} of 10000"):
                lowbit.quantize(x, fmt, 64, impl=impl)
    x = torch.ones(100)
    x[50] = MAX_ABS * 1.5  # finite, but outside the codec's range
    with pytest.raises(NonFiniteError, match="element 50"):
        get_codec(fmt.name, block_size=64, impl=impl).encode(x)


@pytest.mark.parametrize("block", [64, 4096])
def test_round_trip_error_is_the_nearest_grid_point(impl: str, fmt: spec.Format, block: int) -> None:
    """Each value is the grid point nearest to x (within rounding): so |x - v| <= |x| too."""
    x = sample(50_001, 3)
    packed, scales = lowbit.quantize(x, fmt, block, impl=impl)
    v = lowbit.dequantize(packed, scales, x.numel(), fmt, block, impl=impl).double()
    absmax = scales.double().repeat_interleave(block)[: x.numel()]
    points = torch.tensor(fmt.grid, dtype=torch.float64)[None, :] * absmax[:, None]
    best = (x.double().abs()[:, None] - points).abs().amin(dim=1)
    err = (x.double() - v).abs()
    assert bool((err <= best + absmax * 2.0**-20).all())
    assert bool((err <= x.double().abs() + absmax * 2.0**-20).all())
    gap = max(b - a for a, b in itertools.pairwise(fmt.grid))
    if fmt is spec.INT4:
        assert bool((err <= absmax * (gap / 2 + 2.0**-20)).all())


@pytest.mark.parametrize("weight", [1.0, 0.25, 1 / 3, 0.0, -0.7, 5.0])
def test_decode_accumulate_is_acc_plus_weight_times_decode(impl: str, fmt: spec.Format, weight: float) -> None:
    codec = get_codec(fmt.name, block_size=64, impl=impl)
    x, acc = sample(50_001, 11), sample(50_001, 12)
    payload = codec.encode(x)
    expected = acc + weight * codec.decode(payload, x.numel())  # fp32 * (python float) is fp32
    codec.decode_accumulate(acc, payload, weight)
    assert torch.equal(acc, expected)


def test_chunks_encode_to_the_whole_vectors_bytes(impl: str, fmt: spec.Format) -> None:
    """A slice starting and ending on block boundaries (or at the end) encodes to the whole
    payload's scales [a/B, ceil(b/B)) and code bytes [a/k, ceil(b/k))."""
    block, n = 36, 10_001
    codec = get_codec(fmt.name, block_size=block, impl=impl)
    x = sample(n, 5)
    whole = codec.encode(x)
    nb, k = num_blocks(n, block), fmt.codes_per_byte
    bounds = [0, block, 7 * block, 100 * block, n]
    for a, b in itertools.pairwise(bounds):
        expected = torch.cat(
            [whole[4 * (a // block) : 4 * num_blocks(b, block)], whole[4 * nb + a // k : 4 * nb + -(-b // k)]]
        )
        assert torch.equal(codec.encode(x[a:b]), expected), (a, b)


def test_block_size_must_fit_the_bytes() -> None:
    get_codec("int4", block_size=2)
    get_codec("int2", block_size=4)
    for name, bad in (("int4", 3), ("int4", 33), ("int2", 2), ("int2", 6), ("int2", 1)):
        with pytest.raises(ValueError, match="multiple of"):
            get_codec(name, block_size=bad)
    for bad in (0, -4, 2**25, 4.0, True):
        with pytest.raises(ValueError, match="block_size"):
            get_codec("int4", block_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="impl"):
        get_codec("int2", impl="fast")


# --- C++ against the reference --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_cpu_equals_reference(cpu_ext: str, threads, fmt: spec.Format, dtype: torch.dtype, block: int) -> None:
    for seed, n in enumerate(LENGTHS):
        # the reference's results, once: they do not depend on the thread count, and computing
        # them is most of this test's time
        x, acc = sample(n, seed, dtype), sample(n, seed + 100)
        rp, rs = lowbit.quantize(x, fmt, block, impl="reference")
        rv = lowbit.dequantize(rp, rs, n, fmt, block, impl="reference")
        ra = acc.clone()
        lowbit.dequantize_accumulate(ra, rp, rs, 0.3, fmt, block, impl="reference")
        for nthreads in (1, 2, 4):
            threads(nthreads)
            cp, cs = lowbit.quantize(x, fmt, block, impl="cpu")
            assert torch.equal(rp, cp) and torch.equal(rs.view(torch.int32), cs.view(torch.int32)), (n, nthreads)
            cv = lowbit.dequantize(rp, rs, n, fmt, block, impl="cpu")
            assert torch.equal(rv.view(torch.int32), cv.view(torch.int32)), (n, nthreads)
            ca = acc.clone()
            lowbit.dequantize_accumulate(ca, rp, rs, 0.3, fmt, block, impl="cpu")
            assert torch.equal(ra.view(torch.int32), ca.view(torch.int32)), (n, nthreads)


def ties(n: int, seed: int) -> torch.Tensor:
    """Every block (of any size in BLOCKS) has absmax 1, so t is |x|: grid points and the
    thresholds of both formats, with random signs; every 4th element is ±1."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor(sorted({0.0, *spec.INT4.grid, *spec.INT4.thresholds, *spec.INT2.grid, *spec.INT2.thresholds}))
    x = values[torch.randint(0, len(values), (n,), generator=g)]
    x[::4] = 1.0
    return torch.where(torch.rand(n, generator=g) < 0.5, -x, x)


@pytest.mark.parametrize("block", BLOCKS)
def test_ties_go_to_the_smaller_magnitude_on_every_path(cpu_ext: str, threads, fmt: spec.Format, block: int) -> None:
    x = ties(3 * 4096 + 4, block)
    magnitudes = [fmt.grid[sum(a > t for t in fmt.thresholds)] for a in x.abs().tolist()]  # rule 4, t = |x|
    expected = torch.tensor(magnitudes) * torch.where(x < 0, -1.0, 1.0)
    for impl, nthreads in (("reference", 1), ("cpu", 1), ("cpu", 2)):
        threads(nthreads)
        packed, scales = lowbit.quantize(x, fmt, block, impl=impl)
        assert scales.eq(1.0).all(), impl
        assert torch.equal(lowbit.dequantize(packed, scales, x.numel(), fmt, block, impl=impl), expected), impl


def test_scalar_loops_equal_avx2(cpu_ext: str, fmt: spec.Format) -> None:
    """The extension's portable loops (used without AVX2) give the bytes of its AVX2 loops."""
    first = _cpu.simd()
    x, acc = sample(100_003, 3), sample(100_003, 4)
    results = []
    try:
        for avx2 in (True, False):
            _cpu.set_simd(avx2)
            packed, scales = lowbit.quantize(x, fmt, 1000, impl="cpu")
            a = acc.clone()
            lowbit.dequantize_accumulate(a, packed, scales, -0.7, fmt, 1000, impl="cpu")
            results.append((packed, scales, lowbit.dequantize(packed, scales, x.numel(), fmt, 1000, impl="cpu"), a))
    finally:
        _cpu.set_simd(first == "avx2")
    for r0, r1 in zip(*results, strict=True):
        assert torch.equal(r0, r1)


# --- payload validation ---------------------------------------------------------------------------

N, BLOCK = 1001, 64  # odd: the last code byte has padding for both formats


def _with_scale(payload: bytes, k: int, bits: int) -> bytes:
    return payload[: 4 * k] + struct.pack("<I", bits) + payload[4 * k + 4 :]


def _with_code(payload: bytes, fmt: spec.Format, i: int, code: int) -> bytes:
    where = 4 * num_blocks(N, BLOCK) + i // fmt.codes_per_byte
    shift = fmt.bits * (i % fmt.codes_per_byte)
    byte = (payload[where] & ~(((1 << fmt.bits) - 1) << shift)) | (code << shift)
    return payload[:where] + bytes([byte]) + payload[where + 1 :]


def malformed_payloads(fmt: spec.Format) -> dict[str, bytes]:
    """Every way a payload can be malformed, from one well-formed payload."""
    good = bytes(as_memoryview(get_codec(fmt.name, block_size=BLOCK, impl="reference").encode(sample(N, 1))))
    cases = {
        "empty": b"",
        "one byte short": good[:-1],
        "one scale short": good[4:],
        "one byte too many": good + b"\0",
        "half": good[: len(good) // 2],
    }
    for label, bits in [
        ("nan", 0x7FC00000),
        ("inf", 0x7F800000),
        ("-inf", 0xFF800000),
        ("negative", struct.unpack("<I", struct.pack("<f", -0.5))[0]),
        ("-0.0", 0x80000000),
        ("subnormal", 0x00000001),
        ("under TINY", spec.TINY_BITS - 1),
        ("over MAX_ABS", spec.MAX_ABS_BITS + 1),
    ]:
        for k in (0, num_blocks(N, BLOCK) - 1):
            cases[f"scale {k} {label}"] = _with_scale(good, k, bits)
    for i in (0, 500, N - 1):
        cases[f"code {i} is -0"] = _with_code(good, fmt, i, fmt.sign)
    last = len(good) - 1
    cases["padding bits set"] = good[:last] + bytes([good[last] | (1 << (fmt.bits * (N % fmt.codes_per_byte)))])
    return cases


def refused(codec: codecs.Codec, payload: bytes) -> bool:
    """The decoder raised MalformedPayload and left the accumulator as it was (decode too)."""
    acc = sample(N, 99)
    before = acc.clone()
    try:
        codec.decode_accumulate(acc, payload, 0.5)
    except MalformedPayload:
        pass
    except Exception:
        return False
    else:
        return False
    try:
        codec.decode(payload, N)
    except MalformedPayload:
        return torch.equal(acc.view(torch.int32), before.view(torch.int32))
    except Exception:
        return False
    return False


@pytest.mark.parametrize("case", range(len(malformed_payloads(spec.INT4))))
def test_malformed_payloads_refused_and_acc_untouched(impl: str, fmt: spec.Format, case: int) -> None:
    label, payload = list(malformed_payloads(fmt).items())[case]
    assert refused(get_codec(fmt.name, block_size=BLOCK, impl=impl), payload), label


def test_a_decoder_that_skips_validation_fails_the_table(monkeypatch: pytest.MonkeyPatch, fmt: spec.Format) -> None:
    """The table above has teeth: without the checks, not one of its payloads is refused."""
    monkeypatch.setattr(spec, "check_payload", lambda *args: None)
    monkeypatch.setattr(codecs, "_check_length", lambda *args: None)
    monkeypatch.setattr(lowbit, "_payload", lambda packed, scales, *args: (packed, scales))
    codec = get_codec(fmt.name, block_size=BLOCK, impl="reference")
    assert [label for label, p in malformed_payloads(fmt).items() if refused(codec, p)] == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(["int4", "int2"]),
    n=st.integers(1, 300),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_corrupted_payloads_decode_alike_or_are_refused_alike(cpu_ext: str, name: str, n: int, edits: list) -> None:
    """Random byte edits: both implementations refuse (acc untouched) or give the same finite sums."""
    ref, cpu = (get_codec(name, block_size=8, impl=i) for i in ("reference", "cpu"))
    payload = bytearray(as_memoryview(ref.encode(sample(n, n))))
    for where, value in edits:
        payload[where % len(payload)] = value
    outcomes = []
    for codec in (ref, cpu):
        acc = sample(n, 7)
        before = acc.clone()
        try:
            codec.decode_accumulate(acc, bytes(payload), 0.5)
            outcomes.append(acc)
        except MalformedPayload:
            assert torch.equal(acc, before)
            outcomes.append(None)
    if outcomes[0] is None or outcomes[1] is None:
        assert outcomes[0] is None and outcomes[1] is None
    else:
        assert torch.equal(outcomes[0].view(torch.int32), outcomes[1].view(torch.int32))
        assert bool(torch.isfinite(outcomes[0]).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_run_the_reference_and_give_the_same_bytes(fmt: spec.Format) -> None:
    """No GPU kernel: on CUDA tensors the reference's torch ops run on the device, same bytes."""
    codec = get_codec(fmt.name, block_size=64)
    x = sample(100_003, 2)
    payload = codec.encode(x.cuda())
    assert torch.equal(payload.cpu(), get_codec(fmt.name, block_size=64, impl="reference").encode(x))
    acc = sample(100_003, 3)
    on_gpu = acc.cuda()
    codec.decode_accumulate(on_gpu, payload, 0.25)
    codec.decode_accumulate(acc, payload.cpu(), 0.25)
    assert torch.equal(on_gpu.cpu(), acc)
