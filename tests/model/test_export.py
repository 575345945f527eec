"""swarm-export (swarm/model/export.py): a checkpoint written as a node writes it becomes a
transformers folder whose LlamaForCausalLM gives our model's logits.

transformers runs in a separate, isolated interpreter (`python -I`, started in a temporary
folder): that proves the folder loads with no code of ours.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from swarm.cli.export import main as export_main
from swarm.model.checkpoint import RunInfo, copy_state, make_snapshot
from swarm.model.checkpoint_dir import CheckpointDir
from swarm.model.configs import ModelConfig
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.model.export import ExportError, ExportOptions, export_checkpoint, hf_name
from swarm.model.llama import build_model
from swarm.model.presets import preset

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
SEQ = 48
# the tiny preset, and its variant with every option our mapping must carry: grouped-query
# attention, an untied output, another rotary base and norm epsilon, an odd FFN width
CASES = {
    "tiny": preset("tiny"),
    "tiny-gqa-untied": preset(
        "tiny", n_kv_heads=2, tie_embeddings=False, rope_theta=50_000.0, norm_eps=1e-6, ffn_dim=200, vocab_size=300
    ),
}

HF_SIDE = r"""
import json, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

jobs = json.loads(sys.argv[1])
tokens = torch.tensor(jobs["tokens"])
out = {}
for name, folder in jobs["folders"].items():
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        out[name + "/logits"] = model(tokens).logits.float().contiguous()
        out[name + "/generated"] = model.generate(tokens[:1, :8], max_new_tokens=6, do_sample=False)
    out[name + "/dtype_is_" + str(model.dtype).removeprefix("torch.")] = torch.ones(1)
assert not any(m == "swarm" or m.startswith(("swarm.", "swarm_kernels")) for m in sys.modules)
save_file(out, jobs["result"])
"""


def _write_checkpoint(directory: Path, config: ModelConfig, model_name: str = "tiny", step: int = 7) -> torch.nn.Module:
    """A trained-looking state (θ_outer far from its init, norms not all ones) written through
    CheckpointDir as a node writes it; returns our model holding θ_outer."""
    model = build_model(config, seed=1)
    diloco = DiLoCo(model, DiLoCoConfig(inner_steps=1))
    gen = torch.Generator().manual_seed(5)
    state = diloco.state_dict()
    params = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in state["params"].items()}
    momentum = {n: torch.randn(t.shape, generator=gen) for n, t in state["momentum"].items()}
    diloco.load_state_dict({"outer_step": step, "params": params, "momentum": momentum})  # θ_inner ← θ_outer
    run = RunInfo(run_id="export-test", model=model_name, model_config=dataclasses.asdict(config), seed=1,
                  inner_steps=1, settings={"model": model_name})  # fmt: skip
    CheckpointDir(directory).write(make_snapshot(copy_state(diloco.state_dict()), run, shard_bytes=1 << 20))
    return model.eval()


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, SEQ), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    root = tmp_path_factory.mktemp("export")
    done = {}
    for name, config in CASES.items():
        model = _write_checkpoint(root / f"{name}-ckpt", config)
        result = CliRunner().invoke(export_main, ["--checkpoint-dir", str(root / f"{name}-ckpt"),
                                                  "--out", str(root / name)])  # fmt: skip
        assert result.exit_code == 0, result.output
        assert "outer step 7" in result.output
        done[name] = (model, root / name)
    return done


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers is not installed (pip install -e '.[hf]')")
@pytest.mark.swarm  # a child interpreter importing torch: seconds of CPU
def test_transformers_loads_the_folder_and_its_logits_equal_ours(
    exported: dict[str, tuple[torch.nn.Module, Path]], tmp_path: Path
) -> None:
    tokens = _tokens(256)
    jobs = {"tokens": tokens.tolist(), "folders": {n: str(f) for n, (_, f) in exported.items()},
            "result": str(tmp_path / "hf.safetensors")}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-I", "-c", HF_SIDE, json.dumps(jobs)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=100)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = load_file(tmp_path / "hf.safetensors")
    for name, (model, _) in exported.items():
        with torch.no_grad():
            ours = model(tokens)
        diff = (ours - theirs[f"{name}/logits"]).abs().max().item()
        assert diff <= 1e-4, f"{name}: logits differ by {diff}"
        assert ours.abs().max() > 1.0  # a real comparison, not of two near-zero outputs
        generated = theirs[f"{name}/generated"]
        assert generated.shape == (1, 14) and torch.equal(generated[:, :8], tokens[:1, :8])
        assert f"{name}/dtype_is_float32" in theirs
        with torch.no_grad():  # greedy: the first new token is our argmax too
            assert generated[0, 8] == model(tokens[:1, :8])[0, -1].argmax()


def test_the_folder_holds_hf_names_config_and_no_momentum(exported: dict[str, tuple[torch.nn.Module, Path]]) -> None:
    model, folder = exported["tiny-gqa-untied"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is False and config["intermediate_size"] == 200
    assert config["rope_theta"] == 50_000.0 and config["rms_norm_eps"] == 1e-6 and config["vocab_size"] == 300
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" in tensors and "model.layers.5.mlp.gate_proj.weight" in tensors
    assert len(tensors) == len(list(model.parameters()))  # θ_outer only: no momentum
    ours = dict(model.named_parameters())
    assert all(torch.equal(tensors[hf_name(n, CASES["tiny-gqa-untied"])], p) for n, p in ours.items())
    tied = load_file(exported["tiny"][1] / "model.safetensors")
    assert "lm_head.weight" not in tied and not (exported["tiny"][1] / "generation_config.json").exists()


def test_dtype_and_token_ids(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "ckpt", CASES["tiny"])
    options = ExportOptions(dtype="bfloat16", eos_token_id=0, bos_token_id=1)
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "out", options)
    assert result.step == 7 and result.model == "tiny"
    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "out" / "model.safetensors").values())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["eos_token_id"] == 0
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 0
    with pytest.raises(ExportError, match="dtype"):
        ExportOptions(dtype="int8")


def _one_line_exit_2(args: list[str]) -> str:
    result = CliRunner().invoke(export_main, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith("swarm-export: error:")
    return result.output


def test_bad_inputs_end_with_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert "no checkpoint in" in _one_line_exit_2(["--checkpoint-dir", str(tmp_path / "empty"), "--out",
                                                   str(tmp_path / "o1")])  # fmt: skip
    assert "no checkpoint in" in _one_line_exit_2(["--checkpoint-dir", str(tmp_path / "missing"), "--out",
                                                   str(tmp_path / "o1")])  # fmt: skip
    _write_checkpoint(tmp_path / "ckpt", CASES["tiny"])
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "busy")]
    assert "not empty" in _one_line_exit_2(args)
    assert not (tmp_path / "busy" / "config.json").exists()
    assert CliRunner().invoke(export_main, [*args, "--force"]).exit_code == 0
    assert (tmp_path / "busy" / "notes.txt").exists() and (tmp_path / "busy" / "model.safetensors").exists()
    # a caller's own model (swarm.join) trained in a swarm: no architecture we know
    custom = build_model(ModelConfig(dim=32, n_layers=1, n_heads=2), seed=0)
    diloco = DiLoCo(custom, DiLoCoConfig(inner_steps=1))
    run = RunInfo(run_id="r", model="custom", model_config={"architecture": "ab" * 16, "parameters": 9}, data="caller")
    CheckpointDir(tmp_path / "custom").write(make_snapshot(copy_state(diloco.state_dict()), run))
    line = _one_line_exit_2(["--checkpoint-dir", str(tmp_path / "custom"), "--out", str(tmp_path / "o2")])
    assert "'custom'" in line and "no Hugging Face mapping" in line
    # a damaged checkpoint (a flipped byte in its only step)
    shard = next((tmp_path / "ckpt").glob("step-*/shard-00000.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert "SHA-256" in _one_line_exit_2(["--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o3")])


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs transformers (the hf extra)")
def test_the_runs_tokenizer_is_exported_for_autotokenizer_and_a_byte_run_says_so(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.model.token_corpus import train_tokenizer

    docs = [f"the swarm trains model number {i} on text" for i in range(200)]
    tok_path = train_tokenizer(docs, tmp_path / "tok.json", vocab_size=300)
    import tokenizers

    ours = tokenizers.Tokenizer.from_file(str(tok_path))
    vocab = ours.get_vocab_size(with_added_tokens=True)
    config = dataclasses.replace(CASES["tiny"], vocab_size=vocab)
    _write_checkpoint(tmp_path / "ckpt", config)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", ExportOptions(tokenizer=str(tok_path)))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "the swarm trains model number 7"
    assert loaded(text)["input_ids"] == ours.encode(text).ids
    assert loaded.eos_token == "<|endoftext|>" and loaded.eos_token_id == 0
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 0
    assert "`AutoTokenizer.from_pretrained` loads it" in (tmp_path / "hf" / "README.md").read_text()
    # a tokenizer of another size is not the run's: refused in one line
    other = train_tokenizer(docs, tmp_path / "other.json", vocab_size=280)
    with pytest.raises(ExportError, match="not the run's tokenizer"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf2", ExportOptions(tokenizer=str(other)))
    # a byte-level run: no tokenizer files, and the README says the ids are bytes
    _write_checkpoint(tmp_path / "bytes", CASES["tiny"])
    run = CheckpointDir(tmp_path / "bytes").load_latest()
    assert run is not None and run[0].run.data == "stdlib"
    export_checkpoint(tmp_path / "bytes", tmp_path / "hf-bytes", ExportOptions())
    assert not (tmp_path / "hf-bytes" / "tokenizer.json").exists()
    assert "token id i is the byte i (0..255)" in (tmp_path / "hf-bytes" / "README.md").read_text()
