"""GPU validation in one command (issue 19): codecs bit for bit and their speed, bf16 training of
`150m` with its MFU, and a 2-node swarm on one GPU; one JSON line with every figure.

On a machine with network (once, beforehand), a folder of wheels for the GPU machine's Python:

    python -m scripts.gpu_check --prepare-wheels wheels/ [--python-version 3.12]

On the GPU machine (no network; Python with torch (CUDA), triton, msgpack, uvloop, click, rich,
safetensors), from the repository root:

    python -m scripts.gpu_check --wheels wheels/          # installs what is missing, then checks

Exit 0 when every check passed, 1 on a mismatch or a failed check, 2 when it could not run (no
CUDA, a missing module with no wheel for it). Targets (issue 19): each codec >= 50% of the
device copy's GB/s; `150m` bf16 MFU >= 35% on an H100-class GPU. MFU counts 6 x parameters +
12 x layers x seq x dim FLOPs per token (the PaLM paper's appendix B) against the dense bf16
peak of the GPU (PEAK_BF16_TFLOPS, by name; --peak-tflops overrides), named in the output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# what the project imports (pyproject's dependencies) and the GPU extra, by import name
MODULES = {
    "torch": "torch", "msgpack": "msgpack", "uvloop": "uvloop", "multiaddr": "multiaddr", "base58": "base58",
    "click": "click", "rich": "rich", "cryptography": "cryptography", "safetensors": "safetensors",
    "ninja": "ninja", "matplotlib": "matplotlib", "blake3": "blake3", "prometheus_client": "prometheus-client",
    "triton": "triton", "bitsandbytes": "bitsandbytes",
}  # fmt: skip
# what the GPU machine is said to have (issue 19); the rest comes from the wheels folder
PREINSTALLED = ("torch", "triton", "msgpack", "uvloop", "click", "rich", "safetensors")
# dense bf16 peaks, TFLOPS (vendor data sheets, without sparsity); the first name found in the
# device's name wins, so longer names come first
PEAK_BF16_TFLOPS = {
    "H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "GH200": 989.4, "A100": 312.0, "L40S": 362.1,
    "L40": 181.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.2, "RTX 3090": 71.0,
}  # fmt: skip
CODEC_TARGET = 0.5  # of the device copy's GB/s
MFU_TARGET = 0.35


# --- pure parts (tested on the CPU) -------------------------------------------------------------


def missing_modules(names: dict[str, str] = MODULES) -> list[str]:
    """The pip names of the modules this interpreter cannot import."""
    return [pip for module, pip in names.items() if importlib.util.find_spec(module) is None]


def prepare_commands(dest: Path, python_version: str, platform: str) -> list[list[str]]:
    """pip commands that fill `dest` with wheels for that Python and platform: every module the
    GPU machine lacks (with their dependencies), setuptools to install the project, and the
    project itself."""
    wanted = [pip for module, pip in MODULES.items() if module not in PREINSTALLED] + ["setuptools>=68", "wheel"]
    download = [sys.executable, "-m", "pip", "download", "--dest", str(dest), "--only-binary=:all:",
                "--python-version", python_version, "--platform", platform, *wanted]  # fmt: skip
    project = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest), str(ROOT)]
    return [download, project]


def install_commands(wheels: Path, missing: list[str]) -> list[list[str]]:
    """pip commands that install `missing` and the project from `wheels`, offline (setuptools
    first: a Python 3.12 venv has none, and the project's build needs it)."""
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheels)]
    return [[*pip, *missing, "setuptools>=68", "wheel"], [*pip, "--no-deps", "--no-build-isolation", "-e", str(ROOT)]]


def peak_tflops(device_name: str) -> tuple[str, float] | None:
    """(the table's name, dense bf16 TFLOPS) of a device, or None when the table lacks it."""
    for name, peak in PEAK_BF16_TFLOPS.items():
        if name.lower() in device_name.lower():
            return name, peak
    return None


def flops_per_token(parameters: int, layers: int, seq_len: int, dim: int) -> float:
    """Training FLOPs of one token: 6N for the weights' matmuls (forward and backward) and
    12·L·T·d for attention's (PaLM, appendix B)."""
    return 6.0 * parameters + 12.0 * layers * seq_len * dim


def mfu(tokens_per_s: float, per_token: float, peak: float) -> float:
    """Model FLOPs utilization: the FLOPs the step rate implies over the peak (both per second)."""
    return tokens_per_s * per_token / (peak * 1e12)


# --- GPU parts ------------------------------------------------------------------------------


def _gb_per_s(fn: Any, nbytes: int, repeat: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def edge_case_sample(n: int, seed: int = 0) -> Any:
    """fp32 values of many magnitudes, with the codec's edge cases at the front: a zero block,
    values that round half-way, subnormals, the largest finite values, a lone outlier."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    edges = torch.cat([
        torch.zeros(4096), torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5] * 100), torch.full((4096,), 1e-40),
        torch.full((16,), 1.0e38), torch.tensor([1e30] + [1e-3] * 4095),
    ])  # fmt: skip
    x[: edges.numel()] = edges[:n]
    return x


def check_codecs(n: int, block: int) -> dict[str, Any]:
    """Triton int8 against the reference bit for bit on `n` values (and the device's int4/int2
    paths on n/16); GB/s of quantize and dequantize+accumulate against the device copy."""
    import torch

    from swarm_kernels import dequantize_accumulate, lowbit, quantize

    x = edge_case_sample(n)
    gx = x.cuda()
    rc, rs = quantize(x, block, impl="reference")
    gc, gs = quantize(gx, block, impl="gpu")
    same = torch.equal(rc, gc.cpu()) and torch.equal(rs.view(torch.int32), gs.cpu().view(torch.int32))
    racc, gacc = torch.zeros(n), torch.zeros(n, device="cuda")
    dequantize_accumulate(racc, rc, rs, 0.3, block, impl="reference")
    dequantize_accumulate(gacc, gc, gs, 0.3, block, impl="gpu")
    same_acc = torch.equal(racc.view(torch.int32), gacc.cpu().view(torch.int32))
    del racc
    copy_dst = torch.empty_like(gx)
    copy = _gb_per_s(lambda: copy_dst.copy_(gx), 4 * n)
    quant = _gb_per_s(lambda: quantize(gx, block, impl="gpu", out=(gc, gs)), 4 * n)
    acc = _gb_per_s(lambda: dequantize_accumulate(gacc, gc, gs, 0.3, block, impl="gpu"), 4 * n)
    out: dict[str, Any] = {"int8_elements": n, "int8_bit_identical": same and same_acc, "device_copy_gbs": copy,
                           "int8_quantize_gbs": quant, "int8_dequant_acc_gbs": acc}  # fmt: skip
    small = x[: max(1, n // 16)]
    for name in ("int4", "int2"):
        fmt = lowbit.FORMATS[name]
        rp, rsc = lowbit.quantize(small, fmt, block, impl="reference")
        gp, gsc = lowbit.quantize(small.cuda(), fmt, block, impl="reference")
        out[f"{name}_bit_identical"] = torch.equal(rp, gp.cpu()) and torch.equal(rsc, gsc.cpu())
    out.update(check_bnb(x[: max(1, n // 16)]))
    return out


def check_bnb(x: Any) -> dict[str, Any]:
    """bitsandbytes' codec (not our numbers, kernels/bnb.py): its decode equals the dynamic map's
    level times the block's absmax, recomputed in torch, and every index is a nearest level."""
    import torch

    if importlib.util.find_spec("bitsandbytes") is None:
        return {"bnb8": "not installed"}
    from swarm_kernels import get_codec
    from swarm_kernels.reference import num_blocks

    codec = get_codec("bnb8", block_size=4096)
    finite = x.clamp(-1e30, 1e30).cuda()
    payload = codec.encode(finite)
    nb = num_blocks(finite.numel(), 4096)
    absmax = payload[: 4 * nb].view(torch.float32)
    indices = payload[4 * nb :].long()
    levels = codec._map(finite.device)
    expected = levels[indices] * absmax.repeat_interleave(4096)[: finite.numel()]
    decoded = torch.zeros_like(finite)
    codec.decode_accumulate(decoded, payload, 1.0)
    scaled = finite / absmax.repeat_interleave(4096)[: finite.numel()].clamp_min(1e-38)
    ordered, _ = levels.sort()
    above = torch.searchsorted(ordered, scaled).clamp(1, ordered.numel() - 1)  # the two levels around each value
    nearest = torch.minimum((scaled - ordered[above]).abs(), (scaled - ordered[above - 1]).abs())
    chosen = (scaled - levels[indices]).abs()
    return {"bnb8_decode_exact": bool(torch.equal(decoded, expected)),
            "bnb8_nearest_level": bool((chosen <= nearest + 1e-6).all())}  # fmt: skip


def check_training(model: str, batch: int, seq_len: int, steps: int) -> dict[str, Any]:
    """Inner steps of `model` in bf16 on the GPU (DiLoCo's own path): tokens/s and MFU."""
    import torch

    from swarm.model.configs import DiLoCoConfig
    from swarm.model.diloco import DiLoCo
    from swarm.model.llama import build_model
    from swarm.model.presets import preset

    config = preset(model)
    diloco = DiLoCo(build_model(config, seed=0, device=torch.device("cuda")),
                    DiLoCoConfig(inner_steps=steps + 10, warmup_steps=2))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=g).cuda()
    for _ in range(3):  # warm-up: kernels compiled and cached
        diloco.inner_step(inputs[:, :-1], inputs[:, 1:])
    torch.cuda.synchronize()
    started = time.perf_counter()
    losses = [diloco.inner_step(inputs[:, :-1], inputs[:, 1:]).loss for _ in range(steps)]
    torch.cuda.synchronize()
    tokens_per_s = batch * seq_len * steps / (time.perf_counter() - started)
    name = torch.cuda.get_device_name()
    per_token = flops_per_token(diloco.parameter_count, config.n_layers, seq_len, config.dim)
    return {"model": model, "device": name, "batch": batch, "seq_len": seq_len, "tokens_per_s": tokens_per_s,
            "flops_per_token": per_token, "loss_first": losses[0], "loss_last": losses[-1]}  # fmt: skip


def check_swarm(outer_steps: int, timeout: float) -> dict[str, Any]:
    """Two swarm-node processes on the one GPU and a bootstrap DHT node, on 127.0.0.1: their
    states agree after every outer step and the eval loss falls."""
    import tempfile

    from swarm import process_control

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    procs = []
    try:
        boot = process_control.start([process_control.console_script("swarm-dht"), "serve", "--json",
                                      "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE)  # fmt: skip
        procs.append(boot)
        maddr = process_control.read_json_line(boot, 60)["maddrs"][0]
        for i in range(2):
            procs.append(process_control.start([
                process_control.console_script("swarm-node"), "--initial-peers", maddr, "--host-maddrs",
                "/ip4/127.0.0.1/tcp/0", "--run-id", "gpu-check", "--model", "tiny", "--device", "cuda",
                "--inner-steps", "20", "--max-outer-steps", str(outer_steps), "--matchmaking-time", "2",
                "--metrics-file", str(work / f"node{i}.jsonl")], stdout=subprocess.DEVNULL,
                stderr=open(work / f"node{i}.log", "wb")))  # fmt: skip  # noqa: SIM115
        codes = [process_control.wait(p, timeout) for p in procs[1:]]
        events = [[json.loads(line) for line in (work / f"node{i}.jsonl").read_text().splitlines() if line.strip()]
                  for i in range(2)]  # fmt: skip
        steps = [[e for e in node if e.get("event") == "outer_step"] for node in events]
        shas = [{e["outer_step"]: e["state_sha256"] for e in s} for s in steps]
        common = set(shas[0]) & set(shas[1])
        evals = [e["eval_loss"] for e in steps[0] if e.get("eval_loss") is not None]
        return {"swarm_exit_codes": codes, "swarm_steps_in_common": len(common),
                "swarm_states_agree": bool(common) and all(shas[0][s] == shas[1][s] for s in common),
                "swarm_loss_falls": len(evals) >= 2 and evals[-1] < evals[0], "swarm_dir": str(work)}  # fmt: skip
    finally:
        process_control.stop_all(procs, 10.0)


def failures(figures: dict[str, Any]) -> list[str]:
    """What did not pass: a mismatch, a failed process, a target missed (named, not fatal)."""
    bad = [k for k, v in figures.items() if (k.endswith(("_bit_identical", "_exact", "_nearest_level", "_agree",
                                                        "_falls")) and v is False)]  # fmt: skip
    if any(code != 0 for code in figures.get("swarm_exit_codes", [])):
        bad.append("swarm_exit_codes")
    return bad


def targets(figures: dict[str, Any]) -> dict[str, bool]:
    """Issue 19's targets, each met or not (reported, never a failure by itself)."""
    out = {}
    copy = figures.get("device_copy_gbs")
    for key in ("int8_quantize_gbs", "int8_dequant_acc_gbs"):
        if copy and key in figures:
            out[key.removesuffix("_gbs") + "_half_of_copy"] = figures[key] >= CODEC_TARGET * copy
    if "mfu" in figures:
        out["mfu_35"] = figures["mfu"] >= MFU_TARGET
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare-wheels", type=Path, metavar="DIR", help="download the wheels into DIR and exit")
    parser.add_argument("--python-version", default="3.12", help="of the GPU machine (--prepare-wheels)")
    parser.add_argument("--platform", default="manylinux2014_x86_64", help="of the GPU machine (--prepare-wheels)")
    parser.add_argument("--wheels", type=Path, metavar="DIR", help="install what is missing from DIR first")
    parser.add_argument("--elements", type=int, default=256 * 2**20, help="values of the int8 check")
    parser.add_argument("--model", default="150m")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed inner steps")
    parser.add_argument("--outer-steps", type=int, default=3, help="of the 2-node swarm")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of this GPU (default: by its name)")
    parser.add_argument("--skip", default="", help="comma-separated of codecs,training,swarm")
    args = parser.parse_args(argv)
    if args.prepare_wheels is not None:
        args.prepare_wheels.mkdir(parents=True, exist_ok=True)
        for command in prepare_commands(args.prepare_wheels, args.python_version, args.platform):
            subprocess.run(command, check=True)
        return 0
    missing = missing_modules()
    if missing and args.wheels is not None:
        for command in install_commands(args.wheels, missing):
            subprocess.run(command, check=True)
        missing = missing_modules()
    figures: dict[str, Any] = {"missing": missing}
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({**figures, "error": "no CUDA device"}))
        return 2
    if any(m in missing for m in ("torch", "triton", "msgpack", "multiaddr", "cryptography", "blake3")):
        print(json.dumps({**figures, "error": "modules missing: prepare a wheels folder (--prepare-wheels)"}))
        return 2
    skip = set(filter(None, args.skip.split(",")))
    started = time.perf_counter()
    if "codecs" not in skip:
        figures.update(check_codecs(args.elements, 4096))
    named = peak_tflops(torch.cuda.get_device_name())
    peak = args.peak_tflops or (named[1] if named else None)
    if "training" not in skip:
        figures.update(check_training(args.model, args.batch_size, args.seq_len, args.steps))
        figures["peak_bf16_tflops"] = peak
        figures["peak_from"] = "--peak-tflops" if args.peak_tflops else (named[0] if named else None)
        if peak:
            figures["mfu"] = mfu(figures["tokens_per_s"], figures["flops_per_token"], peak)
    if "swarm" not in skip:
        figures.update(check_swarm(args.outer_steps, 300))
    figures["seconds"] = time.perf_counter() - started
    figures["targets"] = targets(figures)
    figures["failures"] = failures(figures)
    print(json.dumps(figures))
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
