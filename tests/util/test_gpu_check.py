"""scripts/experiments/gpu_check.py's CPU-testable parts: the wheel folder's commands, the MFU
arithmetic, the peak table, what counts as a failure, and a clean exit without CUDA."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
import torch

from scripts.experiments import gpu_check, gpu_wheels
from swarm_kernels import lowbit, quantize


def test_the_wheels_folder_holds_what_the_gpu_machine_lacks_at_the_versions_tested_here(tmp_path: Path) -> None:
    wanted = gpu_wheels.wanted(set(gpu_wheels.PRESENT))
    assert {"multiaddr", "cryptography", "cffi", "blake3", "base58", "bitsandbytes"} <= set(wanted)
    assert wanted["multiaddr"] == metadata.version("multiaddr") and wanted["bitsandbytes"] == ""  # newest
    assert not {"torch", "triton", "msgpack", "swarm-train"} & set(wanted)  # the machine's own; built apart
    assert "matplotlib" not in gpu_wheels.wanted({*gpu_wheels.PRESENT, "Matplotlib"})  # what it also has
    download = gpu_wheels.download_command(tmp_path, "blake3", "1.0.11", "3.12")
    assert {"--no-deps", "--only-binary=:all:", "3.12", "blake3==1.0.11", "manylinux2014_x86_64"} <= set(download)
    assert gpu_wheels.build_command(tmp_path, "varint", "1.0.2")[3:5] == ["wheel", "--no-deps"]
    assert gpu_wheels.is_pure("varint-1.0.2-py3-none-any.whl")
    assert not gpu_wheels.is_pure("cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.whl")
    for name in ("b-1-py3-none-any.whl", "a-1-py3-none-any.whl"):
        (tmp_path / name).touch()
    install = gpu_wheels.install_command(tmp_path, tmp_path / "site")
    assert {"--no-index", "--no-deps", "--target", str(tmp_path / "site")} <= set(install)
    assert install[-2:] == [str(tmp_path / "a-1-py3-none-any.whl"), str(tmp_path / "b-1-py3-none-any.whl")]


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
               "int8_dequant_acc_gbs": 60.0, "150m_b8_mfu": 0.2}  # fmt: skip
    assert gpu_check.failures(figures) == ["int4_bit_identical", "swarm_exit_codes"]
    assert gpu_check.targets(figures) == {"int8_quantize_half_of_copy": False, "int8_dequant_acc_half_of_copy": True,
                                          "150m_b8_mfu_35": False}  # fmt: skip


def test_a_section_that_raises_is_a_named_failure_and_the_next_section_runs() -> None:
    figures: dict[str, object] = {}

    def broken() -> dict[str, object]:
        raise RuntimeError("no kernel")

    gpu_check.guarded(figures, "codecs", broken)
    gpu_check.guarded(figures, "swarm", lambda: {"swarm_states_agree": True})
    assert figures == {"codecs_error": "RuntimeError: no kernel", "swarm_states_agree": True}
    assert gpu_check.failures(figures) == ["codecs_error"]


def test_training_figures_are_named_by_model_batch_and_mode() -> None:
    raw = {"tokens_per_s": 400_000.0, "flops_per_token": 1e9, "loss_first": 5.0, "loss_last": 4.0}
    out = gpu_check.training_figures("150m_b8_compiled", raw, 1000.0)
    assert out["150m_b8_compiled_mfu"] == pytest.approx(0.4) and out["150m_b8_compiled_loss_falls"] is True
    assert gpu_check.targets(out) == {"150m_b8_compiled_mfu_35": True}
    flat = gpu_check.training_figures("1b_b8", {**raw, "loss_last": 5.0}, None)
    assert "1b_b8_mfu" not in flat and gpu_check.failures(flat) == ["1b_b8_loss_falls"]


def test_an_unknown_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--modes", "eager,fast"])
    assert exited.value.code == 2 and "--modes eager,fast" in capsys.readouterr().err


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
