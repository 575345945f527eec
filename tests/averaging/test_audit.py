"""The owner audit's arithmetic (swarm/averaging/audit/arithmetic.py): an honest receipt passes, every lie
of the issue's threat model is caught, and the sketch is what the docstring says."""

from __future__ import annotations

import msgpack
import pytest
import torch

from swarm.averaging.audit.arithmetic import (
    AuditFailure,
    Receipt,
    check_receipt,
    make_receipt,
    part_seed,
    result_digest,
    sketch,
    sketch_plan,
)
from swarm.averaging.robust import gram_matrix, robust_aggregate
from swarm_kernels import _cpu, get_codec
from swarm_kernels._cpu import available as cpu_available
from swarm_kernels.sketch import sketch_accumulate, sketch_payload_accumulate

SEED = part_seed(b"g" * 32, 1, result_digest(b"result-1"))
PART = 1


def contributions(n: int = 5, numel: int = 40_000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g)
    return [common + torch.randn(numel, generator=g) for _ in range(n)]


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    codec = get_codec("int8", block_size=64)
    return codec.decode(codec.encode(x), x.numel())


def honest(xs: list[torch.Tensor], weights: list[float]) -> tuple[Receipt, torch.Tensor]:
    """What an honest owner (member 0, its own slice exact, the others decoded) broadcasts."""
    received = [xs[0]] + [int8_round_trip(x) for x in xs[1:]]
    result, _ = robust_aggregate(received, weights)
    receipt = make_receipt(list(range(len(xs))), gram_matrix(received), received, SEED, PART)
    return receipt, int8_round_trip(result)


def test_sketch_is_linear_and_estimates_inner_products() -> None:
    x, y = contributions(2, 200_000)
    sx, sy = sketch(x, SEED, PART), sketch(y, SEED, PART)
    assert torch.allclose(sketch(2 * x - y, SEED, PART), 2 * sx - sy, rtol=1e-4, atol=1e-3)
    true = float(x.double() @ y.double())
    scale = float(x.double().norm() * y.double().norm())
    assert abs(float(sx @ sy) - true) < 0.1 * scale
    assert abs(float(sx @ sx) / float(x.double().norm() ** 2) - 1) < 0.1
    other = sketch(x, part_seed(b"h" * 32, PART, result_digest(b"")), PART)  # another seed, another sketch
    assert not torch.allclose(sx, other)


def test_a_small_part_is_sketched_exactly() -> None:
    x = torch.randn(100)
    assert sketch(x, SEED, PART).numel() == 100
    assert float(sketch(x, SEED, PART).norm()) == pytest.approx(float(x.double().norm()), rel=1e-9)


def test_an_honest_receipt_passes_for_every_member() -> None:
    xs, weights = contributions(), [1.0, 1.0, 2.0, 1.0, 1.0]
    receipt, result = honest(xs, weights)
    wire = Receipt.decode(msgpack.unpackb(msgpack.packb(receipt.encode())), members=5)
    for me in range(5):
        assert check_receipt(wire, weights=weights, result=result, seed=SEED, part=PART, me=me, mine=xs[me]) == []


def test_an_honest_receipt_passes_with_an_attacker_clipped() -> None:
    xs, weights = contributions(), [1.0] * 5
    xs[4] = xs[4] * 1e4
    receipt, result = honest(xs, weights)
    assert check_receipt(receipt, weights=weights, result=result, seed=SEED, part=PART, me=1, mine=xs[1]) == []


@pytest.mark.parametrize("lie", ["negated", "scaled", "own_vector", "shifted_5pct"])
def test_a_result_that_is_not_the_reduction_is_caught(lie: str) -> None:
    xs, weights = contributions(), [1.0] * 5
    receipt, result = honest(xs, weights)
    bad = {
        "negated": -100 * result,
        "scaled": 3 * result,
        "own_vector": xs[0],
        "shifted_5pct": result + 0.05 * float(result.norm()) / result.numel() ** 0.5 * torch.randn(result.numel()),
    }[lie]
    problems = check_receipt(receipt, weights=weights, result=bad, seed=SEED, part=PART, me=2, mine=xs[2])
    assert "the result is not the robust reduction the receipt describes" in problems


def test_a_gram_matrix_made_up_to_justify_a_lie_is_suspect() -> None:
    """The owner claims member 1 sits far from everyone (so the rule clips it away): reported as
    suspect (logged), not failed: the sketch's estimate has a false-positive mode (audit.SUSPECT)."""
    xs, weights = contributions(), [1.0] * 5
    receipt, result = honest(xs, weights)
    gram = [row[:] for row in receipt.gram]
    gram[1][1] *= 50
    forged = Receipt(receipt.included, gram, receipt.buckets, receipt.sketches)
    problems = check_receipt(forged, weights=weights, result=result, seed=SEED, part=PART, me=3, mine=xs[3])
    assert any(p.startswith("suspect:") and "disagrees with the sketches" in p for p in problems)


def test_an_owner_that_misstates_our_input_is_caught_by_us() -> None:
    """Consistent receipt, built on a replaced contribution of member 2: only member 2 can tell."""
    xs, weights = contributions(), [1.0] * 5
    replaced = list(xs)
    replaced[2] = -xs[2]
    receipt, result = honest(replaced, weights)
    assert check_receipt(receipt, weights=weights, result=result, seed=SEED, part=PART, me=3, mine=xs[3]) == []
    problems = check_receipt(receipt, weights=weights, result=result, seed=SEED, part=PART, me=2, mine=xs[2])
    assert "the receipt misstates our contribution" in problems


@pytest.mark.parametrize(
    "msg",
    [
        None,
        {"inc": [0, 0], "g": [1.0] * 4, "b": 4, "sk": b"\0" * 32},
        {"inc": [1, 0], "g": [1.0] * 4, "b": 4, "sk": b"\0" * 32},
        {"inc": [0, 9], "g": [1.0] * 4, "b": 4, "sk": b"\0" * 32},
        {"inc": [0, 1], "g": [1.0] * 3, "b": 4, "sk": b"\0" * 32},
        {"inc": [0, 1], "g": [1.0] * 4, "b": 4, "sk": b"\0" * 31},
        {"inc": [0, 1], "g": [1.0] * 4, "b": 1 << 20, "sk": b""},
        {"inc": [0, 1], "g": ["x"] * 4, "b": 4, "sk": b"\0" * 32},
    ],
)
def test_malformed_receipts_are_refused(msg: object) -> None:
    with pytest.raises(AuditFailure):
        Receipt.decode(msg, members=5)


def test_a_non_finite_receipt_is_a_problem_not_a_crash() -> None:
    xs, weights = contributions(), [1.0] * 5
    receipt, result = honest(xs, weights)
    gram = [row[:] for row in receipt.gram]
    gram[0][1] = float("nan")
    forged = Receipt(receipt.included, gram, receipt.buckets, receipt.sketches)
    assert check_receipt(forged, weights=weights, result=result, seed=SEED, part=PART) != []


@pytest.mark.parametrize("numel", [1, 100, 4096, 4097, 300_001])
def test_the_cpp_sketch_equals_the_reference_chunk_by_chunk(numel: int) -> None:
    """swarm_sketch_f32 gives the reference's sums bit for bit, with and without AVX2, and a part
    sketched in chunks at their offsets (as the owner decodes wire chunks) gives the whole part's
    sketch; the sum of squares from the same pass is x's squared norm."""
    if not cpu_available():
        pytest.skip("the C++ extension is not built here")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    plan = sketch_plan(SEED, PART, numel)
    whole = torch.zeros(plan.buckets, dtype=torch.float64)
    exact_sq = sketch_accumulate(whole, x, 0, plan, impl="reference")
    assert exact_sq == pytest.approx(float(x.double() @ x.double()), rel=1e-12)
    simd = _cpu.simd()
    try:
        for impl, avx2 in (("cpu", True), ("cpu", False), ("reference", False)):
            _cpu.set_simd(avx2)
            chunked, squares = torch.zeros(plan.buckets, dtype=torch.float64), 0.0
            for lo in range(0, numel, 1000):
                squares += sketch_accumulate(chunked, x[lo : lo + 1000], lo, plan, impl=impl)
            assert torch.equal(chunked, whole), (impl, avx2)
            assert squares == pytest.approx(exact_sq, rel=1e-12), (impl, avx2)
    finally:
        _cpu.set_simd(simd == "avx2")
    assert torch.equal(sketch(x, SEED, PART), whole)


def test_a_sketch_outside_its_part_is_refused() -> None:
    plan = sketch_plan(SEED, PART, 1000)
    out = torch.zeros(plan.buckets, dtype=torch.float64)
    with pytest.raises(ValueError):
        sketch_accumulate(out, torch.ones(10), 995, plan)
    with pytest.raises(ValueError):
        sketch_accumulate(out, torch.ones(10, dtype=torch.float64), 0, plan)


def test_an_absurd_contribution_may_overflow_the_gram_matrix_an_honest_one_may_not() -> None:
    """A 1e30 contribution overflows fp32 products (inf in G): legitimate, the rule drops it. An
    owner that claims an honest contribution overflows (to have it dropped) is caught by that
    member."""
    xs, weights = contributions(), [1.0] * 5
    xs[4] = torch.full_like(xs[4], 1e30)
    receipt, result = honest(xs, weights)
    assert any(v == float("inf") for row in receipt.gram for v in row)
    assert check_receipt(receipt, weights=weights, result=result, seed=SEED, part=PART, me=1, mine=xs[1]) == []
    # the attacker's own audit: the rule dropped its input, so nothing of it can be checked (its
    # norm is finite in float64: judged as the rule's fp32 saw it, or it would blame the owner)
    assert check_receipt(receipt, weights=weights, result=result, seed=SEED, part=PART, me=4, mine=xs[4]) == []
    gram = [row[:] for row in receipt.gram]
    gram[2][2] = float("inf")
    forged = Receipt(receipt.included, gram, receipt.buckets, receipt.sketches)
    problems = check_receipt(forged, weights=weights, result=result, seed=SEED, part=PART, me=2, mine=xs[2])
    assert "the receipt misstates our contribution's norm" in problems


@pytest.mark.parametrize("codec_name", ["int8", "int4", "int2", "fp16"])
def test_a_payload_is_sketched_as_its_decoded_values(codec_name: str) -> None:
    """sketch_payload_accumulate (straight from the int8 codes) equals decode-then-sketch, with
    and without AVX2, and returns the decoded values' squared norm."""
    codec = get_codec(codec_name, block_size=64)
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(4))
    payload, decoded_x = codec.encode(x), codec.decode(codec.encode(x), 10_001)
    plan = sketch_plan(SEED, PART, 30_000)
    decoded = torch.zeros(plan.buckets, dtype=torch.float64)
    sketch_accumulate(decoded, decoded_x, 12_345, plan, impl="reference")
    simd = _cpu.simd() if cpu_available() else "scalar"
    try:
        for avx2 in (True, False) if cpu_available() else (False,):
            if cpu_available():
                _cpu.set_simd(avx2)
            direct = torch.zeros(plan.buckets, dtype=torch.float64)
            squares = sketch_payload_accumulate(direct, codec, payload, 10_001, 12_345, plan)
            assert torch.equal(direct, decoded), avx2
            assert squares == pytest.approx(float(decoded_x.double() @ decoded_x.double()), rel=1e-12)
    finally:
        if cpu_available():
            _cpu.set_simd(simd == "avx2")


def test_a_few_huge_coordinates_the_sketch_might_miss_are_caught_by_the_norm() -> None:
    """An owner that adds +d and -d to two coordinates of one bucket column could re-roll its
    result until both land in one bucket with cancelling signs: the result's norm still tells."""
    xs, weights = contributions(), [1.0] * 5
    receipt, result = honest(xs, weights)
    bad = result.clone()
    bad[7] += 1e6
    bad[7 + 4096] -= 1e6
    problems = check_receipt(receipt, weights=weights, result=bad, seed=SEED, part=PART)
    assert "the result's norm is not the norm of the reduction the receipt describes" in problems
