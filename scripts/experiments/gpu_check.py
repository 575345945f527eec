"""GPU validation in one command: codecs bit for bit and their speed, bf16 training of
`150m` (eager and compiled) with its MFU, and a 2-node swarm on one GPU; one JSON line with
every figure.

On a machine with network and the project installed (once, beforehand), a folder of wheels for
the GPU machine's Python (scripts/experiments/gpu_wheels.py says what goes in):

    python -m scripts.experiments.gpu_check --prepare-wheels wheels/ [--python-version 3.12] [--present a,b]

On the GPU machine (no network; Python with torch (CUDA), triton, msgpack, uvloop, click, rich,
safetensors), from the repository root:

    python -m scripts.experiments.gpu_check --wheels wheels/     # installs them into --site, then checks

Exit 0 when every check passed, 1 on a mismatch or a failed check, 2 when it could not run (no
CUDA, a missing module with no wheel for it). Targets: each codec >= 50% of the
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
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.experiments import gpu_wheels

ROOT = Path(__file__).resolve().parents[2]
# what the project imports (pyproject's dependencies) and the GPU extra, by import name
MODULES = {
    "torch": "torch", "msgpack": "msgpack", "uvloop": "uvloop", "multiaddr": "multiaddr", "base58": "base58",
    "click": "click", "rich": "rich", "cryptography": "cryptography", "safetensors": "safetensors",
    "ninja": "ninja", "matplotlib": "matplotlib", "blake3": "blake3", "prometheus_client": "prometheus-client",
    "triton": "triton", "bitsandbytes": "bitsandbytes",
}  # fmt: skip
# dense bf16 peaks, TFLOPS (vendor data sheets, without sparsity); the first name found in the
# device's name wins, so longer names come first
PEAK_BF16_TFLOPS = {
    "H200": 989.4, "H100 PCIe": 756.0, "H100": 989.4, "GH200": 989.4, "A100": 312.0, "L40S": 362.1,
    "L40": 181.0, "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.2, "RTX 3090": 71.0,
}  # fmt: skip
CODEC_TARGET = 0.5  # of the device copy's GB/s
MFU_TARGET = 0.35
# figures that fail the check when False
MUST_HOLD = ("_bit_identical", "_exact", "_bracketed", "_agree", "_falls")


# --- pure parts (tested on the CPU) -------------------------------------------------------------


def missing_modules(names: dict[str, str] = MODULES) -> list[str]:
    """The pip names of the modules this interpreter cannot import."""
    return [pip for module, pip in names.items() if importlib.util.find_spec(module) is None]


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
    """bitsandbytes' codec (not our numbers, swarm_kernels/bnb.py): its decode equals the dynamic map's
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
    bracket = torch.stack([ordered[above - 1], ordered[above]])
    # a block of zeros (absmax 0) decodes to zeros whatever its indices: only the others count
    counted = absmax.repeat_interleave(4096)[: finite.numel()] > 0
    bracketed = (levels[indices] == bracket).any(0) | ~counted
    not_nearest = (chosen > nearest + 1e-6) & counted
    return {"bnb8_decode_exact": bool(torch.equal(decoded, expected)),
            # its index is one of the two levels around the value: always (else a broken encode);
            # the nearer of them: measured, not required (bitsandbytes' own search)
            "bnb8_index_bracketed": bool(bracketed.all()),
            "bnb8_not_nearest_fraction": float(not_nearest.sum() / counted.sum().clamp_min(1))}  # fmt: skip


def sweep_dequant(n: int, block: int) -> dict[str, Any]:
    """GB/s of dequantize+accumulate (its payload check included) for other tile shapes of the
    Triton kernel, each checked bit for bit against the reference on the same values."""
    import torch

    from swarm_kernels import dequantize_accumulate, gpu, quantize

    x = edge_case_sample(n, seed=1)
    codes, scales = quantize(x, block, impl="reference")
    expected = torch.zeros(n)
    dequantize_accumulate(expected, codes, scales, 0.3, block, impl="reference")
    gc, gs = codes.cuda(), scales.cuda()
    default = (gpu.DEQUANT_TILE, gpu.DEQUANT_WARPS)
    out: dict[str, Any] = {}
    try:
        for tile, warps in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (16384, 16)):
            gpu.DEQUANT_TILE, gpu.DEQUANT_WARPS = tile, warps
            acc = torch.zeros(n, device="cuda")
            dequantize_accumulate(acc, gc, gs, 0.3, block, impl="gpu")
            same = torch.equal(acc.cpu().view(torch.int32), expected.view(torch.int32))
            speed = _gb_per_s(lambda a=acc: dequantize_accumulate(a, gc, gs, 0.3, block, impl="gpu"), 4 * n)
            out[f"{tile}x{warps}"] = {"gbs": speed, "bit_identical": same}
    finally:
        gpu.DEQUANT_TILE, gpu.DEQUANT_WARPS = default
    return {"dequant_sweep": out, "dequant_sweep_bit_identical": all(v["bit_identical"] for v in out.values())}


def check_training(model: str, batch: int, seq_len: int, steps: int, compiled: bool = False) -> dict[str, Any]:
    """Inner steps of `model` in bf16 on the GPU (DiLoCo's own path): tokens/s and MFU; with
    `compiled`, through torch.compile first (what swarm-node --compile does)."""
    import torch

    from swarm.model.configs import DiLoCoConfig
    from swarm.model.diloco import DiLoCo
    from swarm.model.llama import build_model
    from swarm.model.presets import preset

    config = preset(model)
    built = build_model(config, seed=0, device=torch.device("cuda"))
    if compiled:
        built.compile()  # in place: the parameters keep their names
    torch.cuda.reset_peak_memory_stats()
    diloco = DiLoCo(built, DiLoCoConfig(inner_steps=steps + 10, warmup_steps=2))
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=g).cuda()
    began = time.perf_counter()
    for _ in range(3):  # warm-up: kernels compiled and cached (and with `compiled`, the model)
        diloco.inner_step(inputs[:, :-1], inputs[:, 1:])
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - began
    started = time.perf_counter()
    losses = [diloco.inner_step(inputs[:, :-1], inputs[:, 1:]).loss for _ in range(steps)]
    torch.cuda.synchronize()
    tokens_per_s = batch * seq_len * steps / (time.perf_counter() - started)
    per_token = flops_per_token(diloco.parameter_count, config.n_layers, seq_len, config.dim)
    return {"parameters": diloco.parameter_count, "batch": batch, "seq_len": seq_len, "tokens_per_s": tokens_per_s,
            "flops_per_token": per_token, "loss_first": losses[0], "loss_last": losses[-1],
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "warmup_s": warmup_s}  # fmt: skip


def training_figures(model: str, raw: dict[str, Any], peak: float | None) -> dict[str, Any]:
    """One model's training figures under its name, with its MFU (when the peak is known) and
    whether its loss fell over the timed steps (one batch, repeated: it must)."""
    out = {f"{model}_{key}": value for key, value in raw.items()}
    out[f"{model}_loss_falls"] = raw["loss_last"] < raw["loss_first"]
    if peak:
        out[f"{model}_mfu"] = mfu(raw["tokens_per_s"], raw["flops_per_token"], peak)
    return out


def check_swarm(outer_steps: int, timeout: float, device: str = "cuda", compiled: bool = False) -> dict[str, Any]:
    """Two swarm-node processes on the one GPU and a bootstrap DHT node, on 127.0.0.1: their
    states agree after every outer step and the eval loss falls."""
    from swarm.utils import process_control

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
                "/ip4/127.0.0.1/tcp/0", "--run-id", "gpu-check", "--model", "tiny", "--device", device,
                "--inner-steps", "20", "--max-outer-steps", str(outer_steps), "--matchmaking-time", "2",
                "--metrics-file", str(work / f"node{i}.jsonl"), *(["--compile"] if compiled else [])],
                stdout=subprocess.DEVNULL, stderr=open(work / f"node{i}.log", "wb")))  # fmt: skip  # noqa: SIM115
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
    """What did not pass: a mismatch, a section that raised, a failed process; a missed target is
    named in targets(), not here."""
    bad = [k for k, v in figures.items() if (k.endswith(MUST_HOLD) and v is False) or k.endswith("_error")]
    if any(code != 0 for code in figures.get("swarm_exit_codes", [])):
        bad.append("swarm_exit_codes")
    return bad


def targets(figures: dict[str, Any]) -> dict[str, bool]:
    """The targets, each met or not (reported, never a failure by itself)."""
    out = {}
    copy = figures.get("device_copy_gbs")
    for key in ("int8_quantize_gbs", "int8_dequant_acc_gbs"):
        if copy and key in figures:
            out[key.removesuffix("_gbs") + "_half_of_copy"] = figures[key] >= CODEC_TARGET * copy
    for key, value in figures.items():
        if key.startswith("150m_") and key.endswith("_mfu"):
            out[f"{key}_35"] = value >= MFU_TARGET
    return out


def guarded(figures: dict[str, Any], section: str, check: Any) -> None:
    """Runs one section; an exception is recorded as that section's failure (and the next section
    still runs: a lent GPU's minutes are few)."""
    try:
        figures.update(check())
    except Exception as error:  # reported in the JSON line, and the exit is 1
        figures[f"{section}_error"] = f"{type(error).__name__}: {error}"[:500]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare-wheels", type=Path, metavar="DIR", help="download the wheels into DIR and exit")
    parser.add_argument("--python-version", default="3.12", help="of the GPU machine (--prepare-wheels)")
    parser.add_argument("--present", default="", help="comma-separated distributions the GPU machine has besides "
                        f"{', '.join(gpu_wheels.PRESENT)} (--prepare-wheels)")  # fmt: skip
    parser.add_argument("--wheels", type=Path, metavar="DIR", help="install the wheels of DIR first (offline)")
    parser.add_argument("--site", type=Path, default=Path(tempfile.gettempdir()) / "swarm-gpu-site",
                        help="where --wheels installs them (put first on the path)")  # fmt: skip
    parser.add_argument("--elements", type=int, default=256 * 2**20, help="values of the int8 check")
    parser.add_argument("--models", default="150m", help="comma-separated presets timed in bf16 (MFU)")
    parser.add_argument("--batch-sizes", default="8", help="comma-separated, each timed")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed inner steps")
    parser.add_argument("--outer-steps", type=int, default=3, help="of the 2-node swarm")
    parser.add_argument("--sweep", action="store_true", help="time other tile shapes of the accumulate kernel")
    parser.add_argument("--modes", default="eager,compiled", help="comma-separated of eager,compiled: how the "
                        "models are timed (compiled: torch.compile, as swarm-node --compile)")  # fmt: skip
    parser.add_argument("--swarm-compile", action="store_true", help="the 2-node swarm with swarm-node --compile")
    parser.add_argument("--swarm-timeout", type=float, default=300.0, help="seconds the 2-node swarm may take")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of this GPU (default: by its name)")
    parser.add_argument("--skip", default="", help="comma-separated of codecs,training,swarm")
    args = parser.parse_args(argv)
    if not set(filter(None, args.modes.split(","))) <= {"eager", "compiled"}:
        parser.error(f"--modes {args.modes}: each of eager, compiled")
    if args.prepare_wheels is not None:
        present = set(gpu_wheels.PRESENT) | set(filter(None, args.present.split(",")))
        for name in gpu_wheels.prepare(args.prepare_wheels, present, args.python_version):
            print(name)
        return 0
    if args.wheels is not None:
        subprocess.run(gpu_wheels.install_command(args.wheels, args.site), check=True)
        gpu_wheels.use_site(args.site)
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
    figures["device"] = torch.cuda.get_device_name()
    figures["torch"] = torch.__version__
    if "codecs" not in skip:
        guarded(figures, "codecs", lambda: check_codecs(args.elements, 4096))
        if args.sweep:
            guarded(figures, "sweep", lambda: sweep_dequant(args.elements, 4096))
    named = peak_tflops(figures["device"])
    peak = args.peak_tflops or (named[1] if named else None)
    figures["peak_bf16_tflops"] = peak
    figures["peak_from"] = "--peak-tflops" if args.peak_tflops else (named[0] if named else None)
    if "training" not in skip:
        for model in filter(None, args.models.split(",")):
            for batch in map(int, filter(None, args.batch_sizes.split(","))):
                for mode in filter(None, args.modes.split(",")):
                    name = f"{model}_b{batch}" + ("_compiled" if mode == "compiled" else "")
                    guarded(figures, f"training_{name}", lambda m=model, b=batch, n=name, c=mode == "compiled":
                            training_figures(n, check_training(m, b, args.seq_len, args.steps, c), peak))  # fmt: skip
    if "swarm" not in skip:
        guarded(figures, "swarm", lambda: check_swarm(args.outer_steps, args.swarm_timeout, "cuda", args.swarm_compile))
    figures["seconds"] = time.perf_counter() - started
    figures["targets"] = targets(figures)
    figures["failures"] = failures(figures)
    print(json.dumps(figures))
    return 1 if figures["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
