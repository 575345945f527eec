"""The codecs the averaging layer uses: wire layout, lengths, chunking, validation."""

from __future__ import annotations

import itertools
import struct

import pytest
import torch

from swarm_kernels import (
    CODECS,
    Codec,
    KernelUnavailable,
    MalformedPayload,
    NonFiniteError,
    as_memoryview,
    as_uint8,
    dequantize,
    get_codec,
    quantize,
)
from swarm_kernels.reference import num_blocks

N = 3 * 1024 + 5


def sample(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


@pytest.fixture(params=CODECS)
def codec_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def codec(codec_name: str, impl: str) -> Codec:
    return get_codec(codec_name, block_size=1024, impl=impl)


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, N])
def test_encoded_length_and_type(codec, n: int) -> None:
    payload = codec.encode(sample(n, n))
    assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.is_contiguous()
    assert payload.numel() == codec.encoded_nbytes(n)
    expected = {
        "int8": n + 4 * num_blocks(n, 1024),
        "int4": (n + 1) // 2 + 4 * num_blocks(n, 1024),
        "int2": (n + 3) // 4 + 4 * num_blocks(n, 1024),
        "fp16": 2 * n,
        "none": 4 * n,
    }[codec.name]
    assert codec.encoded_nbytes(n) == expected


def test_int8_layout_is_scales_then_codes(impl: str) -> None:
    x = sample(N, 1)
    payload = get_codec("int8", block_size=1024, impl=impl).encode(x)
    codes, scales = quantize(x, 1024, impl="reference")
    nb = num_blocks(N, 1024)
    assert bytes(as_memoryview(payload[: 4 * nb])) == struct.pack(f"<{nb}f", *scales.tolist())
    assert torch.equal(payload[4 * nb :].view(torch.int8), codes)


def test_payload_forms_decode_alike(codec) -> None:
    x = sample(N, 2)
    payload = codec.encode(x)
    expected = codec.decode(payload, N)
    raw = as_memoryview(payload)  # how the caller sends it: zero-copy
    misaligned = bytearray(1) + bytes(raw)
    for form in (bytes(raw), bytearray(raw), raw, memoryview(misaligned)[1:], payload):
        assert torch.equal(codec.decode(form, N), expected)
        acc = torch.ones(N)
        codec.decode_accumulate(acc, form, 0.5)
        assert torch.equal(acc, torch.ones(N) + 0.5 * expected)
    if codec.name == "none":
        assert torch.equal(expected, x)
    if codec.name == "fp16":
        assert torch.equal(expected, x.half().float())
    if codec.name == "int8":
        assert torch.equal(expected, dequantize(*quantize(x, 1024, impl="reference"), 1024, impl="reference"))


def test_decode_into_out(codec) -> None:
    x = sample(N, 3)
    payload = codec.encode(x)
    out = torch.full((N,), 7.0)
    assert codec.decode(payload, N, out=out) is out
    assert torch.equal(out, codec.decode(payload, N))


@pytest.mark.parametrize("weight", [0.25, 1 / 3, -2.0])
def test_decode_accumulate_is_acc_plus_weight_times_decode(codec, weight: float) -> None:
    x, acc = sample(N, 4), sample(N, 5)
    payload = codec.encode(x)
    expected = acc + weight * codec.decode(payload, N)
    codec.decode_accumulate(acc, payload, weight)
    assert torch.equal(acc, expected)


def test_chunk_encode_equals_slice_of_whole(codec) -> None:
    """Chunks starting at multiples of the block size encode to the whole vector's pieces."""
    x = sample(10 * 1024 + 77, 6)
    whole = codec.encode(x)
    bounds = [0, 1024, 4096, 7 * 1024, x.numel()]
    decoded = []
    for a, b in itertools.pairwise(bounds):
        chunk = codec.encode(x[a:b])
        if codec.name in ("int8", "int4", "int2"):
            k = {"int8": 1, "int4": 2, "int2": 4}[codec.name]  # codes a byte
            nb_all, ka, kb = num_blocks(x.numel(), 1024), a // 1024, num_blocks(b, 1024)
            scales = whole[4 * ka : 4 * kb]
            codes = whole[4 * nb_all + a // k : 4 * nb_all + -(-b // k)]
            assert torch.equal(chunk, torch.cat([scales, codes]))
        else:
            size = codec.encoded_nbytes(1)
            assert torch.equal(chunk, whole[a * size : b * size])
        decoded.append(codec.decode(chunk, b - a))
    assert torch.equal(torch.cat(decoded), codec.decode(whole, x.numel()))


def test_wrong_length_refused(codec) -> None:
    payload = bytes(as_memoryview(codec.encode(sample(N, 7))))
    for bad in (payload[:-1], payload + b"\0", b"", payload[: len(payload) // 2]):
        acc = torch.ones(N)
        with pytest.raises(MalformedPayload, match="bytes"):
            codec.decode_accumulate(acc, bad, 1.0)
        assert torch.equal(acc, torch.ones(N))
        with pytest.raises(MalformedPayload):
            codec.decode(bad, N)


def test_bad_values_refused_and_acc_untouched(codec) -> None:
    payload = codec.encode(sample(N, 8)).clone()
    if codec.name in ("int8", "int4", "int2"):
        payload[4 * num_blocks(N, 1024) + 5] = {"int8": 0x80, "int4": 0x08, "int2": 0x02}[codec.name]  # code "-0"
        bad_payloads = [payload]
        scales_bad = codec.encode(sample(N, 8)).clone()
        scales_bad[:4].view(torch.float32)[0] = float("nan")
        bad_payloads.append(scales_bad)
    else:
        dtype = torch.float16 if codec.name == "fp16" else torch.float32
        bad_payloads = []
        for value in (float("nan"), float("inf"), float("-inf")):
            p = payload.clone()
            p.view(dtype)[N - 1] = value
            bad_payloads.append(p)
    for bad in bad_payloads:
        acc = torch.ones(N)
        with pytest.raises(MalformedPayload):
            codec.decode_accumulate(acc, bytes(as_memoryview(bad)), 0.5)
        assert torch.equal(acc, torch.ones(N))
        with pytest.raises(MalformedPayload):
            codec.decode(bad, N)


def test_nonfinite_input_refused(codec) -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = sample(N, 9)
        x[17] = bad
        with pytest.raises(NonFiniteError, match="element 17"):
            codec.encode(x)
    if codec.name == "fp16":
        x = sample(N, 9)
        x[3] = 70000.0  # beyond fp16
        with pytest.raises(NonFiniteError, match="element 3"):
            codec.encode(x)


def test_int8_round_trip_bound_through_the_codec(impl: str) -> None:
    codec = get_codec("int8", block_size=1024, impl=impl)
    x = sample(N, 10)
    v = codec.decode(codec.encode(x), N)
    absmax = torch.nn.functional.pad(x.abs(), (0, num_blocks(N, 1024) * 1024 - N)).view(-1, 1024).amax(dim=1)
    bound = (absmax / 127 / 2 + absmax * 2.0**-21).repeat_interleave(1024)[:N]
    assert bool(((x - v).abs() <= bound).all())


def test_get_codec_and_arguments() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("int3")
    with pytest.raises(ValueError, match="block_size"):
        get_codec("int8", block_size=0)
    with pytest.raises(ValueError, match="impl"):
        get_codec("int8", impl="fast")
    if not torch.cuda.is_available():
        with pytest.raises(KernelUnavailable):
            get_codec("bnb8")
    with pytest.raises(TypeError):
        as_uint8("not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        as_uint8(torch.zeros(4))
    codec = get_codec("int8")
    with pytest.raises(TypeError):
        codec.encode(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError):
        codec.decode_accumulate(torch.zeros(4, dtype=torch.float64), codec.encode(torch.zeros(4)), 1.0)


def test_as_memoryview_is_zero_copy_and_keeps_the_tensor_alive() -> None:
    t = torch.arange(6, dtype=torch.float32)
    view = as_memoryview(t)
    assert view.format == "B" and view.nbytes == 24 and not view.readonly
    t[0] = 2.5
    assert bytes(view[:4]) == struct.pack("<f", 2.5)  # the tensor's own memory
    del t
    import gc

    gc.collect()
    assert bytes(view[4:8]) == struct.pack("<f", 1.0)
    assert as_memoryview(torch.empty(0)).nbytes == 0
    with pytest.raises(ValueError):
        as_memoryview(torch.zeros(4, 4).t())
