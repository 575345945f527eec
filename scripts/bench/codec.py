"""Benchmark of the codecs (swarm_kernels): int8, and the low-bit int4 and int2: quantize and
the fused dequantize_accumulate, per implementation, next to the machine's memcpy bandwidth
measured in the same run, and with ``--compare hivemind`` hivemind's Uniform8BitQuantization
(and bitsandbytes where installed).

    python -m scripts.bench.codec                      # tables, medians of --repeat runs
    python -m scripts.bench.codec --codecs int4,int2 --impl cpu --block-size 64
    python -m scripts.bench.codec --compare hivemind   # + hivemind 1.1.12 (pip extra "bench")
    python -m scripts.bench.codec --json               # one JSON object

Throughput is GB/s of fp32 input (4 bytes x elements / seconds; GB = 1e9 bytes), the median of
``--repeat`` timed runs after one warm-up, on one vector of ``--elements`` (default 64M) values.
The runs are interleaved: each round times every workload once (memcpy included), so a change
of load on a shared machine hits every number alike.

- ``quantize``: ``quantize(x, B, out=(codes, scales))`` into preallocated outputs;
- ``dequant_acc``: ``dequantize_accumulate(acc, codes, scales, w, B)`` (acc += w * decoded);
- memcpy: ``dst.copy_(src)`` (torch, all threads) and ``np.copyto`` (one thread) of the same
  size as the input; the faster median is ``memcpy_GBps`` (bytes of the source per second);
- hivemind: ``Uniform8BitQuantization.compress`` of the whole tensor, and ``extract`` followed
  by ``acc.add_(t, alpha=w)``, which is what its reducer does with each received part; the
  row "hivemind (512 KiB parts)" does the same per part, as its averager cuts the vector; the
  "/ hivemind" ratios divide by the faster of the two rows;
- bitsandbytes: ``functional.quantize_blockwise`` and ``dequantize_blockwise`` + ``add_``,
  on the device where the other numbers are taken (CPU here), when it runs there.

- int4 / int2 (``swarm_kernels.lowbit``): the same two workloads on the packed codes; their
  rows (JSON keys ``int4_cpu_quantize_GBps`` ...) also give the bytes a parameter on the wire
  and the relative RMS error ``|x - decode(encode(x))| / |x|`` on gaussian data (the timed
  vector) and on heavy-tailed data (gaussian x lognormal: ``randn * exp(randn)``), int8's too.

Each implementation's codes, scales and accumulator are checked against the reference's
(bit for bit) in the same run. Targets: int8 cpu >= 50% of memcpy, >= 3x hivemind;
int4 / int2 cpu >= 50% of memcpy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from swarm_kernels import available_impls, dequantize_accumulate, get_codec, lowbit, quantize
from swarm_kernels.reference import num_blocks

WEIGHT = 0.25
HIVEMIND_PART_BYTES = 2**19  # hivemind's DecentralizedAverager part_size_bytes default
LOWBIT = ("int4", "int2")
ERROR_ELEMENTS = 1 << 22  # the error figures' sample size (at most)


Timer = tuple[Callable[[], object], Callable[[], None]]  # (workload, sync after it)


def _no_sync() -> None:
    pass


def interleaved_medians(timers: dict[str, Timer], repeat: int) -> dict[str, float]:
    """Median seconds of each workload. One warm-up each, then ``repeat`` rounds that time every
    workload once, so that a load change on this shared machine hits all of them alike."""
    for fn, sync in timers.values():
        fn()
        sync()
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(repeat):
        for name, (fn, sync) in timers.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def memcpy_timers(n: int) -> dict[str, Timer]:
    src = torch.randn(n)
    dst = torch.empty_like(src)
    a, b = src.numpy(), dst.numpy()
    return {"torch_copy": (lambda: dst.copy_(src), _no_sync), "numpy_copyto": (lambda: np.copyto(b, a), _no_sync)}


def impl_timers(impl: str, x: torch.Tensor, block: int) -> tuple[dict[str, Timer], Callable[[], tuple]]:
    """Timers for one implementation, and a function giving its outputs for the bit check."""
    dev = x.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else _no_sync
    codes = torch.empty(x.numel(), dtype=torch.int8, device=dev)
    scales = torch.empty(num_blocks(x.numel(), block), dtype=torch.float32, device=dev)
    acc = torch.zeros_like(x)

    def outputs() -> tuple:
        c, s = quantize(x, block, impl=impl)
        check = torch.zeros_like(x)  # one accumulate from zero
        dequantize_accumulate(check, c, s, WEIGHT, block, impl=impl)
        return c.cpu(), s.cpu(), check.cpu()

    return {
        f"{impl}_quantize": (lambda: quantize(x, block, impl=impl, out=(codes, scales)), sync),
        f"{impl}_dequant_acc": (lambda: dequantize_accumulate(acc, codes, scales, WEIGHT, block, impl=impl), sync),
    }, outputs


def lowbit_timers(name: str, impl: str, x: torch.Tensor, block: int) -> tuple[dict[str, Timer], Callable[[], tuple]]:
    """Timers of the low-bit codec ``name`` for one implementation, and its outputs' function."""
    fmt = lowbit.FORMATS[name]
    packed = torch.empty(fmt.packed_nbytes(x.numel()), dtype=torch.uint8)
    scales = torch.empty(num_blocks(x.numel(), block), dtype=torch.float32)
    acc = torch.zeros_like(x)

    def outputs() -> tuple:
        p, s = lowbit.quantize(x, fmt, block, impl=impl)
        check = torch.zeros_like(x)
        lowbit.dequantize_accumulate(check, p, s, WEIGHT, fmt, block, impl=impl)
        return p, s, check

    def quantize_into() -> None:
        lowbit.quantize(x, fmt, block, impl=impl, out=(packed, scales))

    def accumulate() -> None:
        lowbit.dequantize_accumulate(acc, packed, scales, WEIGHT, fmt, block, impl=impl)

    return {
        f"{name}_{impl}_quantize": (quantize_into, _no_sync),
        f"{name}_{impl}_dequant_acc": (accumulate, _no_sync),
    }, outputs


def codec_figures(name: str, block: int, n: int) -> dict[str, float]:
    """Bytes a parameter and relative RMS errors (gaussian, heavy-tailed) of a codec."""
    codec = get_codec(name, block_size=block)
    g = torch.Generator().manual_seed(1)
    samples = {"gaussian": torch.randn(n, generator=g)}
    samples["heavy"] = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    figures = {f"{name}_bytes_per_param": codec.encoded_nbytes(n) / n}
    for kind, x in samples.items():
        v = codec.decode(codec.encode(x), n)
        figures[f"{name}_rel_error_{kind}"] = float((x.double() - v.double()).norm() / x.double().norm())
    return figures


def hivemind_timers(x: torch.Tensor) -> dict[str, Timer]:
    import warnings

    from hivemind.compression import CompressionInfo, Uniform8BitQuantization

    # its torch.quantize_per_tensor is deprecated in torch 2.13: one warning per call otherwise
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*", category=UserWarning)
    codec = Uniform8BitQuantization()
    info = CompressionInfo.from_tensor(x)
    acc = torch.zeros_like(x)
    serialized = codec.compress(x, info)
    # As its averager runs it: the vector cut into parts of 512 KiB (its default part size).
    parts = list(torch.split(x, HIVEMIND_PART_BYTES // 4))
    part_infos = [CompressionInfo.from_tensor(p) for p in parts]
    part_accs = list(torch.split(acc, HIVEMIND_PART_BYTES // 4))
    part_blobs = [codec.compress(p, i) for p, i in zip(parts, part_infos, strict=True)]

    def parts_compress() -> None:
        for p, i in zip(parts, part_infos, strict=True):
            codec.compress(p, i)

    def parts_extract() -> None:
        for a, blob in zip(part_accs, part_blobs, strict=True):
            a.add_(codec.extract(blob), alpha=WEIGHT)

    return {
        "hivemind_quantize": (lambda: codec.compress(x, info), _no_sync),
        "hivemind_dequant_acc": (lambda: acc.add_(codec.extract(serialized), alpha=WEIGHT), _no_sync),
        "hivemind_parts_quantize": (parts_compress, _no_sync),
        "hivemind_parts_dequant_acc": (parts_extract, _no_sync),
    }


def bitsandbytes_timers(x: torch.Tensor, block: int) -> tuple[dict[str, Timer], str | None]:
    try:
        from bitsandbytes import functional as bnbf

        indices, state = bnbf.quantize_blockwise(x, blocksize=block)
        bnbf.dequantize_blockwise(indices, state, blocksize=block)
    except ImportError:
        return {}, "bitsandbytes is not installed"
    except Exception as e:  # it may not run on this device: say so under the table
        return {}, f"bitsandbytes failed on {x.device.type}: {type(e).__name__}: {e}"[:200]
    acc = torch.zeros_like(x)
    return {
        "bitsandbytes_quantize": (lambda: bnbf.quantize_blockwise(x, blocksize=block), _no_sync),
        "bitsandbytes_dequant_acc": (
            lambda: acc.add_(bnbf.dequantize_blockwise(indices, state, blocksize=block), alpha=WEIGHT),
            _no_sync,
        ),
    }, None


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    if args.threads:
        torch.set_num_threads(args.threads)
    notes: list[str] = []
    result: dict[str, Any] = {"elements": args.elements, "block_size": args.block_size}
    result["threads"] = torch.get_num_threads()
    codecs = args.codecs.split(",")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.elements, generator=g)
    timers = memcpy_timers(args.elements)
    impls = [i for i in args.impl.split(",") if i in available_impls()]
    notes += [f"{i}: not available here" for i in args.impl.split(",") if i not in impls]
    outputs: dict[str, Callable[[], tuple]] = {}
    for impl in impls if "int8" in codecs else []:
        more, outputs[impl] = impl_timers(impl, x.cuda() if impl == "gpu" else x, args.block_size)
        timers.update(more)
    for name in (c for c in LOWBIT if c in codecs):
        for impl in (i for i in impls if i != "gpu"):  # no GPU kernel: CUDA tensors run the reference
            more, outputs[f"{name}_{impl}"] = lowbit_timers(name, impl, x, args.block_size)
            timers.update(more)
    if args.compare == "hivemind":
        timers.update(hivemind_timers(x))
        more, why = bitsandbytes_timers(x, args.block_size)
        timers.update(more)
        notes += [why] if why else []
    gb = args.elements * 4 / 1e9
    result.update({f"{name}_GBps": gb / seconds for name, seconds in interleaved_medians(timers, args.repeat).items()})
    result["memcpy_GBps"] = max(result["torch_copy_GBps"], result["numpy_copyto_GBps"])
    for prefix in ("", *(f"{c}_" for c in LOWBIT)):
        if f"{prefix}reference" not in outputs:
            continue
        expected = outputs[f"{prefix}reference"]()
        for key, produce in outputs.items():
            if key.startswith(prefix) and (prefix or key in impls) and not key.endswith("reference"):
                same = all(torch.equal(a.cpu(), b) for a, b in zip(produce(), expected, strict=True))
                result[f"{key}_bit_identical"] = same
                if not same:
                    notes.append(f"{key}: results DIFFER from the reference")
    for name in codecs:
        result.update(codec_figures(name, args.block_size, min(args.elements, ERROR_ELEMENTS)))
    return result, notes


def print_table(r: dict[str, Any], notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=110)
    mem = r["memcpy_GBps"]
    hq = max(r.get("hivemind_quantize_GBps", 0.0), r.get("hivemind_parts_quantize_GBps", 0.0)) or None
    hd = max(r.get("hivemind_dequant_acc_GBps", 0.0), r.get("hivemind_parts_dequant_acc_GBps", 0.0)) or None
    table = Table(
        title=f"int8 codec, {r['elements']:,} fp32 elements, block {r['block_size']}, "
        f"{r['threads']} threads (GB/s of fp32 input, medians)"
    )
    for col in ("implementation", "quantize", "% memcpy", "/ hivemind", "dequant+acc", "% memcpy", "/ hivemind"):
        table.add_column(col, justify="left" if col == "implementation" else "right", no_wrap=True)
    table.add_row(
        "memcpy",
        f"{mem:.2f}",
        "100%",
        "",
        f"{mem:.2f}",
        "100%",
        "",
        end_section=True,
    )
    for impl in ("reference", "cpu", "gpu", "hivemind", "hivemind_parts", "bitsandbytes"):
        q, d = r.get(f"{impl}_quantize_GBps"), r.get(f"{impl}_dequant_acc_GBps")
        if q is None:
            continue
        name = impl.replace("_parts", " (512 KiB parts)")
        name += "" if r.get(f"{impl}_bit_identical", True) else " (DIFFERS)"
        table.add_row(
            name,
            f"{q:.2f}",
            f"{100 * q / mem:.0f}%",
            f"{q / hq:.1f}x" if hq else "",
            f"{d:.2f}",
            f"{100 * d / mem:.0f}%",
            f"{d / hd:.1f}x" if hd else "",
        )
    console.print(table)
    console.print(
        f"memcpy: torch copy_ {r['torch_copy_GBps']:.2f} GB/s, numpy copyto {r['numpy_copyto_GBps']:.2f} GB/s "
        "(the faster is the 100% above)"
    )
    if "cpu_quantize_GBps" in r:
        low = min(r["cpu_quantize_GBps"], r["cpu_dequant_acc_GBps"])
        line = f"target cpu >= 50% of memcpy: {'met' if low >= 0.5 * mem else 'NOT met'} ({100 * low / mem:.0f}%)"
        if hq and hd:
            ratio = min(r["cpu_quantize_GBps"] / hq, r["cpu_dequant_acc_GBps"] / hd)
            line += f"; cpu >= 3x hivemind: {'met' if ratio >= 3 else 'NOT met'} ({ratio:.1f}x)"
        console.print(line)
    for note in notes:
        console.print(f"note: {note}")


def print_lowbit_table(r: dict[str, Any]) -> None:
    """int4 / int2 next to int8 (cpu): speed, bytes a parameter, error."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=130)
    mem = r["memcpy_GBps"]
    table = Table(
        title=f"low-bit codecs, {r['elements']:,} fp32 elements, block {r['block_size']}, {r['threads']} threads "
        "(GB/s of fp32 input, medians; errors: |x - decoded| / |x|)"
    )
    for col in ("codec", "quantize", "% memcpy", "dequant+acc", "% memcpy", "bytes/param", "err gauss", "err heavy"):
        table.add_column(col, justify="left" if col == "codec" else "right", no_wrap=True)
    lowest = None
    for name in ("int8", *LOWBIT):
        if f"{name}_bytes_per_param" not in r:
            continue
        for impl in ("reference", "cpu"):
            prefix = impl if name == "int8" else f"{name}_{impl}"
            q, d = r.get(f"{prefix}_quantize_GBps"), r.get(f"{prefix}_dequant_acc_GBps")
            if q is None:
                continue
            if impl == "cpu" and name != "int8":
                lowest = min(lowest or q, q, d)
            same = "" if r.get(f"{prefix}_bit_identical", True) else " (DIFFERS)"
            table.add_row(
                f"{name} {impl}{same}",
                f"{q:.2f}",
                f"{100 * q / mem:.0f}%",
                f"{d:.2f}",
                f"{100 * d / mem:.0f}%",
                f"{r[f'{name}_bytes_per_param']:.4f}",
                f"{r[f'{name}_rel_error_gaussian']:.4f}",
                f"{r[f'{name}_rel_error_heavy']:.4f}",
            )
    console.print(table)
    if lowest is not None:
        met = "met" if lowest >= 0.5 * mem else "NOT met"
        console.print(f"target int4 / int2 cpu >= 50% of memcpy ({mem:.2f} GB/s): {met} ({100 * lowest / mem:.0f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=64 * 2**20, help="fp32 elements (default 64M)")
    parser.add_argument("--block-size", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per number; medians are reported")
    parser.add_argument("--impl", default="reference,cpu,gpu", help="comma-separated; missing ones are skipped")
    parser.add_argument("--codecs", default="int8,int4,int2", help="comma-separated, of int8, int4, int2")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--compare", choices=["hivemind"], help="also time hivemind's Uniform8BitQuantization")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.elements < 1 or args.repeat < 1:
        parser.error("--elements and --repeat must be positive")
    if not set(args.codecs.split(",")) <= {"int8", *LOWBIT}:
        parser.error(f"--codecs: expected some of int8, {', '.join(LOWBIT)}")
    result, notes = run(args)
    if args.json:
        print(json.dumps(result | ({"notes": notes} if notes else {})))
    else:
        print_table(result, notes)
        print_lowbit_table(result)


if __name__ == "__main__":
    main()
