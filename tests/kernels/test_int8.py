"""The int8 kernels: the error bound, the spec's corner cases, and every implementation equal to
the reference bit for bit (torch.equal), on any thread count."""

from __future__ import annotations

import pytest
import torch

from swarm_kernels import (
    KernelUnavailable,
    MalformedPayload,
    NonFiniteError,
    _cpu,
    dequantize,
    dequantize_accumulate,
    quantize,
    reference,
    resolve_impl,
)
from swarm_kernels.reference import MAX_ABS, MAX_SCALE, TINY, num_blocks

BLOCKS = [4096, 1024, 1000, 33, 1]
LENGTHS = [0, 1, 7, 31, 32, 33, 1023, 4095, 4096, 4097, 3 * 4096 + 5, 100_003]


def sample(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values over many magnitudes, with zeros, -0.0 and exact ties mixed in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    x[torch.rand(n, generator=g) < 0.02] = -0.0
    return x.to(dtype)


def special_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    outlier = torch.randn(5000, generator=g) * 1e-3
    outlier[1234] = 1e4
    return {
        "random": torch.randn(10_007, generator=g),
        "zeros": torch.zeros(9000),
        "tiny": torch.randn(9000, generator=g) * 1e-30,
        "huge": torch.randn(9000, generator=g) * 1e30,
        "outlier": outlier,
        "max_abs": torch.tensor([MAX_ABS, -MAX_ABS, 1.0, 0.0]),
        "under_tiny": torch.tensor([TINY * 0.99, -TINY * 0.5, 1e-45, 0.0]),
        "at_tiny": torch.tensor([TINY, TINY / 3, 1e-45, -0.0]),
        "subnormal_in_block": torch.tensor([1.0, 1e-40, -1e-45, 3e-39]),
    }


def check_bound(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """|x - v| <= scale/2 + absmax * 2**-21 per element (reference.py); v = 0 under TINY."""
    n = x.numel()
    xd = x.double()
    v = dequantize(codes, scales, block, impl="reference").double()
    scale = scales.double().repeat_interleave(block)[:n]
    absmax = reference._padded_blocks(x.float().abs(), block).amax(dim=1).double().repeat_interleave(block)[:n]
    err = (xd - v).abs()
    normal = absmax >= TINY
    assert bool((err[normal] <= scale[normal] / 2 + absmax[normal] * 2.0**-21).all())
    assert bool((v[~normal] == 0).all()) and bool((xd[~normal].abs() < TINY).all())


@pytest.mark.parametrize("name", list(special_cases()))
@pytest.mark.parametrize("block", [4096, 1024, 1000])
def test_round_trip_error_bound(impl: str, name: str, block: int) -> None:
    x = special_cases()[name]
    codes, scales = quantize(x, block, impl=impl)
    assert codes.shape == (x.numel(),) and scales.shape == (num_blocks(x.numel(), block),)
    check_bound(x, codes, scales, block)
    assert int(codes.min()) >= -127 and int(codes.max()) <= 127


def test_special_values(impl: str) -> None:
    codes, scales = quantize(torch.zeros(5000), 4096, impl=impl)
    assert torch.equal(codes, torch.zeros(5000, dtype=torch.int8))
    assert torch.equal(scales.view(torch.int32), torch.zeros(2, dtype=torch.int32))  # +0.0, not -0.0
    # absmax 127 -> inv 1: x * inv is x itself, so the ties show round-half-even.
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, -0.0])
    codes, scales = quantize(x, 4096, impl=impl)
    assert codes.tolist() == [127, 0, 2, 2, 0, -2, -2, 126, -126, 0]
    assert scales.tolist() == [1.0]
    codes, scales = quantize(torch.tensor([MAX_ABS, -MAX_ABS]), impl=impl)
    assert codes.tolist() == [127, -127] and scales.item() == MAX_SCALE
    assert bool(torch.isfinite(dequantize(codes, scales, impl=impl)).all())


def test_nonfinite_refused(impl: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for bad in (float("nan"), float("inf"), float("-inf")):
            for pos in (0, 4095, 4096, 9999):
                x = torch.randn(10_000).to(dtype)
                x[pos] = bad
                with pytest.raises(NonFiniteError, match=f"element {pos} of 10000"):
                    quantize(x, 4096, impl=impl)
    x = torch.ones(100)
    x[50] = MAX_ABS * 1.5  # finite, but outside the codec's range
    with pytest.raises(NonFiniteError, match="element 50"):
        quantize(x, impl=impl)
    assert issubclass(NonFiniteError, ValueError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [*BLOCKS, 65536])
def test_cpu_equals_reference(cpu_ext: str, threads, dtype: torch.dtype, block: int) -> None:
    for seed, n in enumerate(LENGTHS):
        # the reference's results, once: they do not depend on the thread count, and computing
        # them is most of this test's time
        x, acc = sample(n, seed, dtype), sample(n, seed + 100)
        rc, rs = quantize(x, block, impl="reference")
        rv = dequantize(rc, rs, block, impl="reference")
        ra = acc.clone()
        dequantize_accumulate(ra, rc, rs, 0.3, block, impl="reference")
        for nthreads in (1, 2, 3):
            threads(nthreads)
            cc, cs = quantize(x, block, impl="cpu")
            assert torch.equal(rc, cc) and torch.equal(rs.view(torch.int32), cs.view(torch.int32)), (n, nthreads)
            assert torch.equal(rv, dequantize(rc, rs, block, impl="cpu")), (n, nthreads)
            ca = acc.clone()
            dequantize_accumulate(ca, rc, rs, 0.3, block, impl="cpu")
            assert torch.equal(ra.view(torch.int32), ca.view(torch.int32)), (n, nthreads)


def test_cpu_special_cases_equal_reference(cpu_ext: str) -> None:
    for x in special_cases().values():
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            for block in (4096, 3, 1):
                rc, rs = quantize(xd, block, impl="reference")
                cc, cs = quantize(xd, block, impl="cpu")
                assert torch.equal(rc, cc) and torch.equal(rs.view(torch.int32), cs.view(torch.int32))


def test_scalar_loops_equal_avx2(cpu_ext: str) -> None:
    """The extension's portable loops (used without AVX2) give the same bytes as its AVX2 loops."""
    first = _cpu.simd()
    x = sample(100_003, 3)
    acc = sample(100_003, 4)
    results = []
    try:
        for avx2 in (True, False):
            _cpu.set_simd(avx2)
            codes, scales = quantize(x, 1024, impl="cpu")
            a = acc.clone()
            dequantize_accumulate(a, codes, scales, -0.7, 1024, impl="cpu")
            results.append((codes, scales, dequantize(codes, scales, 1024, impl="cpu"), a))
    finally:
        _cpu.set_simd(first == "avx2")
    for r0, r1 in zip(*results, strict=True):
        assert torch.equal(r0, r1)


@pytest.mark.parametrize("weight", [1.0, 0.25, 1 / 3, 0.0, -0.7, 1e-3, 5.0])
def test_dequantize_accumulate_is_acc_plus_weight_times_dequantize(impl: str, weight: float) -> None:
    x, acc = sample(50_001, 11), sample(50_001, 12)
    codes, scales = quantize(x, 1024, impl=impl)
    expected = acc + weight * dequantize(codes, scales, 1024, impl=impl)  # fp32 * (python float) is fp32
    dequantize_accumulate(acc, codes, scales, weight, 1024, impl=impl)
    assert torch.equal(acc, expected)


def test_weight_must_be_finite(impl: str) -> None:
    codes, scales = quantize(torch.ones(10), impl=impl)
    acc = torch.zeros(10)
    for w in (float("nan"), float("inf"), 1e39):  # 1e39 overflows fp32
        with pytest.raises(ValueError, match="weight"):
            dequantize_accumulate(acc, codes, scales, w, impl=impl)
    assert torch.equal(acc, torch.zeros(10))


def _malformed_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, str]]:
    codes, scales = quantize(sample(3 * 1024 + 7, 5), 1024, impl="reference")
    cases = []
    for label, value in [
        ("nan", float("nan")),
        ("inf", float("inf")),
        ("-inf", float("-inf")),
        ("negative", -0.5),
        ("-0.0", -0.0),
        ("subnormal", 1e-40),
        ("too large", MAX_SCALE * 1.0001),
    ]:
        for k in (0, 3):
            bad = scales.clone()
            bad[k] = value
            cases.append((f"scale {label} @{k}", codes, bad, f"scale {k}"))
    for i in (0, 1500, 3 * 1024 + 6):
        bad = codes.clone()
        bad[i] = -128
        cases.append((f"code -128 @{i}", bad, scales, f"code {i}"))
    cases.append(("one scale short", codes, scales[:-1], "scales"))
    cases.append(("one scale too many", codes, torch.cat([scales, scales[:1]]), "scales"))
    return cases


@pytest.mark.parametrize("case", range(len(_malformed_cases())))
def test_malformed_payload_refused_and_acc_untouched(impl: str, case: int) -> None:
    label, codes, scales, match = _malformed_cases()[case]
    acc = sample(codes.numel(), 99)
    before = acc.clone()
    with pytest.raises(MalformedPayload, match=match):
        dequantize_accumulate(acc, codes, scales, 0.5, 1024, impl=impl)
    assert torch.equal(acc, before), label
    with pytest.raises(MalformedPayload, match=match):
        dequantize(codes, scales, 1024, impl=impl)


def test_wrong_accumulator_length(impl: str) -> None:
    codes, scales = quantize(torch.ones(5000), 1024, impl=impl)
    with pytest.raises(MalformedPayload, match="accumulator"):
        dequantize_accumulate(torch.zeros(4999), codes, scales, 1.0, 1024, impl=impl)
    with pytest.raises(MalformedPayload, match="accumulator"):
        dequantize_accumulate(torch.zeros(5001), codes, scales, 1.0, 1024, impl=impl)


def test_largest_scale_accepted(impl: str) -> None:
    codes = torch.tensor([127, -127, 0], dtype=torch.int8)
    scales = torch.tensor([MAX_SCALE])
    v = dequantize(codes, scales, impl=impl)
    assert bool(torch.isfinite(v).all()) and v[0].item() == pytest.approx(MAX_ABS, rel=1e-6)


def test_shapes_and_outputs(impl: str) -> None:
    x = sample(6000, 2).reshape(60, 100)
    codes, scales = quantize(x, 1024, impl=impl)  # read flat
    assert torch.equal(codes, quantize(x.reshape(-1), 1024, impl=impl)[0])
    xt = x.t()  # non-contiguous: read in its flat (row-major) order
    assert torch.equal(quantize(xt, 1024, impl=impl)[0], quantize(xt.contiguous(), 1024, impl=impl)[0])
    out = (torch.empty(6000, dtype=torch.int8), torch.empty(6, dtype=torch.float32))
    c2, s2 = quantize(x, 1024, impl=impl, out=out)
    assert c2.data_ptr() == out[0].data_ptr() and torch.equal(c2, codes) and torch.equal(s2, scales)
    with pytest.raises(ValueError, match="out scales"):
        quantize(x, 1024, impl=impl, out=(out[0], torch.empty(5)))
    with pytest.raises(TypeError):
        quantize(x.double(), impl=impl)
    for bad in (0, -1, 1.5, True, 2**25):
        with pytest.raises(ValueError, match="block_size"):
            quantize(x, bad, impl=impl)


def test_impl_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("SWARM_KERNELS_IMPL", "reference")
    assert resolve_impl(None, cpu) == "reference"
    assert resolve_impl("cpu", cpu) in ("cpu", "reference")  # the argument wins over the env
    monkeypatch.setenv("SWARM_KERNELS_IMPL", "fast")
    with pytest.raises(ValueError, match="SWARM_KERNELS_IMPL"):
        resolve_impl(None, cpu)
    monkeypatch.delenv("SWARM_KERNELS_IMPL")
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("cuda", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(KernelUnavailable):
            quantize(torch.ones(4), impl="gpu")
