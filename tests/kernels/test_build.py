"""Building the C++ extension: a cache keyed by source, safe when processes race or a build died
half way, and a loud fall back to the reference when no compiler works."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarm_kernels import _build, as_memoryview, dequantize_accumulate, get_codec, quantize

KERNELS = Path(_build.__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[2]  # so that the probes import tests.kernels

_PROBE = """
import json, os, time, warnings
t0 = time.monotonic()
import torch
from swarm_kernels import _cpu
from tests.kernels.test_build import digest
torch.set_num_threads(int(os.environ.get("PROBE_THREADS", "2")))
size = int(os.environ.get("PROBE_SIZE", "300001"))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result = digest(None, size)
    digest(None, size)
print(json.dumps({
    "available": _cpu.available(),
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    "digest": result,
    "seconds": time.monotonic() - t0,
}))
"""


def digest(impl: str | None, size: int = 300_001) -> str:
    """sha256 of quantize and dequantize_accumulate results on a fixed input of `size` values
    (int8, int4, int2); the default spans many of the extension's parallel chunks."""
    g = torch.Generator().manual_seed(42)
    x = torch.randn(size, generator=g) * torch.exp(torch.randn(size, generator=g) * 3)
    codes, scales = quantize(x, 1024, impl=impl)
    acc = torch.randn(size, generator=g)
    dequantize_accumulate(acc, codes, scales, 0.125, 1024, impl=impl)
    outputs = [codes, scales, acc]
    for name in ("int4", "int2"):
        codec = get_codec(name, block_size=1024, impl=impl)
        payload = codec.encode(x)
        codec.decode_accumulate(acc, payload, 0.125)
        outputs += [payload, acc.clone()]
    return hashlib.sha256(b"".join(as_memoryview(t) for t in outputs)).hexdigest()


def _probe(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, **env},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.swarm  # a child interpreter importing torch: seconds of CPU
def test_two_processes_build_at_once_over_a_stale_half_build(cpu_ext: str, tmp_path: Path) -> None:
    """A builder killed mid-build left torch's lock file and a broken library; two processes then
    start at once: one rebuilds, the other waits for it, both run the extension. Their results
    (on 1 and 2 threads) equal this process's and the reference's to the byte: deterministic
    across runs, processes and thread counts."""
    half = tmp_path / "swarm_kernels" / f"int8_cpu-{_build.build_key()}"
    half.mkdir(parents=True)
    (half / "lock").write_text("")  # torch's FileBaton would wait on this forever
    (half / f"swarm_int8_cpu_{_build.build_key()}.so").write_bytes(b"truncated")
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    probes = [_probe({**env, "PROBE_THREADS": "1"}), _probe({**env, "PROBE_THREADS": "2"})]
    results = [_result(p) for p in probes]
    assert all(r["available"] and not r["warnings"] for r in results), results
    expected = digest("reference")
    assert [r["digest"] for r in results] == [expected, expected]
    assert digest("cpu") == expected
    assert (half / _build.READY).exists() and not (half / "lock").exists()
    print(f"build + run in a fresh cache: {max(r['seconds'] for r in results):.1f} s")


def test_no_compiler_falls_back_to_reference_with_one_warning(tmp_path: Path) -> None:
    # Which path runs does not depend on the input's size: four blocks and a partial one are enough
    # to compare with the reference, at a fraction of the default input's CPU in both processes.
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-c++"), "PROBE_SIZE": "4097"}
    r = _result(_probe(env))
    assert r["available"] is False and r["digest"] == digest("reference", 4097)
    assert len(r["warnings"]) == 1 and "reference" in r["warnings"][0], r["warnings"]


def test_cache_key_follows_the_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key = _build.build_key()
    changed = tmp_path / "int8_cpu.cpp"
    changed.write_bytes(_build.SOURCE.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(_build, "SOURCE", changed)
    assert _build.build_key() != key
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert _build.cache_root() == tmp_path / "swarm_kernels"


def test_kernels_import_nothing_of_swarm() -> None:
    """DESIGN.md: swarm_kernels/ imports nothing of ours."""
    for path in KERNELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not [n for n in names if n == "swarm" or n.startswith("swarm.")], (path.name, names)
