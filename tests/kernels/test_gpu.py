"""The Triton path and the bitsandbytes codec against the reference (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from swarm_kernels import MalformedPayload, NonFiniteError, dequantize, dequantize_accumulate, get_codec, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LENGTHS = [1, 31, 4095, 4096, 4097, 3 * 4096 + 5, 1_000_003]


def sample(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    return x


@pytest.fixture(scope="module")
def gpu() -> str:
    pytest.importorskip("triton")
    return "gpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [4096, 1024, 1000, 33])
def test_gpu_equals_reference(gpu: str, dtype: torch.dtype, block: int) -> None:
    for seed, n in enumerate(LENGTHS):
        x = sample(n, seed).to(dtype)
        rc, rs = quantize(x, block, impl="reference")
        gc, gs = quantize(x.cuda(), block, impl=gpu)
        assert torch.equal(rc, gc.cpu()) and torch.equal(rs.view(torch.int32), gs.cpu().view(torch.int32)), n
        assert torch.equal(dequantize(rc, rs, block, impl="reference"), dequantize(gc, gs, block, impl=gpu).cpu())
        acc = sample(n, seed + 50)
        ga = acc.cuda()
        dequantize_accumulate(acc, rc, rs, 0.3, block, impl="reference")
        dequantize_accumulate(ga, gc, gs, 0.3, block, impl=gpu)
        assert torch.equal(acc.view(torch.int32), ga.cpu().view(torch.int32)), n


def test_gpu_special_values(gpu: str) -> None:
    for x in (torch.zeros(5000), torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5]), torch.randn(9000) * 1e-30):
        rc, rs = quantize(x, 4096, impl="reference")
        gc, gs = quantize(x.cuda(), 4096, impl=gpu)
        assert torch.equal(rc, gc.cpu()) and torch.equal(rs.view(torch.int32), gs.cpu().view(torch.int32))


def test_gpu_refuses_bad_input_and_payloads(gpu: str) -> None:
    x = torch.randn(10_000, device="cuda")
    x[4097] = float("nan")
    with pytest.raises(NonFiniteError, match="element 4097"):
        quantize(x, impl=gpu)
    codes, scales = quantize(torch.randn(10_000, device="cuda"), impl=gpu)
    codes[9999] = -128
    acc = torch.ones(10_000, device="cuda")
    with pytest.raises(MalformedPayload, match="code 9999"):
        dequantize_accumulate(acc, codes, scales, 1.0, impl=gpu)
    assert bool((acc == 1).all())


def test_int8_codec_on_cuda_matches_cpu(gpu: str) -> None:
    x = sample(100_003, 1)
    cpu_codec, gpu_codec = get_codec("int8", impl="reference"), get_codec("int8", impl=gpu)
    payload = gpu_codec.encode(x.cuda())
    assert torch.equal(payload.cpu(), cpu_codec.encode(x))
    acc = torch.zeros(100_003, device="cuda")
    gpu_codec.decode_accumulate(acc, payload.cpu(), 0.5)
    ref = torch.zeros(100_003)
    cpu_codec.decode_accumulate(ref, payload.cpu(), 0.5)
    assert torch.equal(acc.cpu(), ref)


def test_bnb8_codec_round_trip() -> None:
    pytest.importorskip("bitsandbytes")
    codec = get_codec("bnb8", block_size=4096)
    x = sample(100_003, 2).cuda()
    payload = codec.encode(x)
    assert payload.numel() == codec.encoded_nbytes(x.numel())
    v = codec.decode(payload.cpu(), x.numel())
    absmax = torch.nn.functional.pad(x.abs(), (0, 25 * 4096 - x.numel())).view(-1, 4096).amax(dim=1)
    bound = absmax.repeat_interleave(4096)[: x.numel()] * 0.02  # dynamic map: ~1% steps at the top
    assert bool(((x - v.to(x.device)).abs() <= bound).all())
    acc = torch.ones(x.numel(), device="cuda")
    bad = payload.clone()
    bad[:4].view(torch.float32)[0] = float("nan")
    with pytest.raises(MalformedPayload):
        codec.decode_accumulate(acc, bad, 1.0)
    assert bool((acc == 1).all())
