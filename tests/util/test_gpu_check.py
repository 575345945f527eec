"""scripts/gpu_check.py's CPU-testable parts (issue 19): the wheel folder's commands, the MFU
arithmetic, the peak table, what counts as a failure, and a clean exit without CUDA."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from scripts import gpu_check
from swarm_kernels import lowbit, quantize


def test_the_wheel_folder_is_filled_for_the_gpu_machines_python_and_installed_offline(tmp_path: Path) -> None:
    download, project = gpu_check.prepare_commands(tmp_path, "3.12", "manylinux2014_x86_64")
    assert download[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--only-binary=:all:", "3.12", "manylinux2014_x86_64", str(tmp_path)} <= set(download)
    assert {"multiaddr", "cryptography", "bitsandbytes", "blake3", "setuptools>=68"} <= set(download)
    assert "torch" not in download and "triton" not in download  # the GPU machine has its own
    assert project[3] == "wheel" and project[-1] == str(gpu_check.ROOT)
    first, last = gpu_check.install_commands(tmp_path, ["multiaddr", "blake3"])
    assert "--no-index" in first and {"multiaddr", "blake3", "setuptools>=68"} <= set(first)
    assert "--no-index" in last and last[-2:] == ["-e", str(gpu_check.ROOT)]
    nothing_missing = gpu_check.install_commands(tmp_path, [])[0]
    assert "multiaddr" not in nothing_missing and "setuptools>=68" in nothing_missing


def test_missing_modules_names_what_cannot_be_imported() -> None:
    assert gpu_check.missing_modules({"json": "json", "no_such_module_here": "no-such"}) == ["no-such"]


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", ("H100", 989.4)), ("NVIDIA H100 PCIe", ("H100 PCIe", 756.0)),
     ("NVIDIA H200", ("H200", 989.4)), ("NVIDIA A100-SXM4-80GB", ("A100", 312.0)), ("NVIDIA L40S", ("L40S", 362.1)),
     ("Some Future GPU", None)],
)  # fmt: skip
def test_the_peak_is_looked_up_by_the_devices_name(name: str, peak: tuple[str, float] | None) -> None:
    assert gpu_check.peak_tflops(name) == peak


def test_mfu_arithmetic() -> None:
    # 150m's shape: 12 layers of dim 1024, at 1024 tokens a sequence
    per_token = gpu_check.flops_per_token(154_000_000, 12, 1024, 1024)
    assert per_token == 6 * 154e6 + 12 * 12 * 1024 * 1024
    # 400k tokens/s at that cost on a 989.4 TFLOPS GPU
    assert gpu_check.mfu(400_000, per_token, 989.4) == pytest.approx(400_000 * per_token / 989.4e12)
    assert 0.35 < gpu_check.mfu(400_000, per_token, 989.4) < 0.45


def test_a_mismatch_or_a_failed_node_is_a_failure_and_a_missed_target_is_only_reported() -> None:
    figures = {"int8_bit_identical": True, "int4_bit_identical": False, "swarm_states_agree": True,
               "swarm_exit_codes": [0, 1], "device_copy_gbs": 100.0, "int8_quantize_gbs": 40.0,
               "int8_dequant_acc_gbs": 60.0, "mfu": 0.2}  # fmt: skip
    assert gpu_check.failures(figures) == ["int4_bit_identical", "swarm_exit_codes"]
    assert gpu_check.targets(figures) == {"int8_quantize_half_of_copy": False, "int8_dequant_acc_half_of_copy": True,
                                          "mfu_35": False}  # fmt: skip


def test_the_edge_case_sample_is_valid_codec_input() -> None:
    x = gpu_check.edge_case_sample(20_000)
    assert x.dtype == torch.float32 and x.numel() == 20_000 and bool(torch.isfinite(x).all())
    assert bool((x[:4096] == 0).all()) and float(x.abs().max()) > 9e37
    quantize(x, 4096, impl="reference")  # none of them is refused
    for name in ("int4", "int2"):
        lowbit.quantize(x, lowbit.FORMATS[name], 4096, impl="reference")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without CUDA")
def test_without_cuda_it_says_so_in_its_json_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--skip", "swarm"]) == 2
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["error"] == "no CUDA device" and isinstance(line["missing"], list)
