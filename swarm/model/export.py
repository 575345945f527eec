"""A checkpoint's θ_outer as a Hugging Face `transformers` model folder (`swarm-export`).

    result = export_checkpoint(Path("ckpt"), Path("hf-model"), ExportOptions(dtype="bfloat16"))
    # then, with no code of ours:  AutoModelForCausalLM.from_pretrained("hf-model")

Our decoder (llama.py) is Hugging Face's `LlamaForCausalLM` term for term, so the export is a
renaming: pre-norm RMSNorm blocks computed in fp32, rotary embeddings in the "rotate half" form
with the same inverse frequencies (so no permutation of the query and key rows, unlike Meta's
original weights), grouped-query attention whose key/value head j serves query heads
j*r .. j*r + r - 1 (HF's `repeat_kv`), SwiGLU with w1 = gate, w3 = up, w2 = down, no biases,
no embedding scale, tied or untied output. `tests/model/test_export.py` holds the exported model's
logits to ours within 1e-4 in fp32.

Differences, none of which changes a logit inside our range: HF computes the rotary angles in
fp32 (we compute them in fp64, then round), and HF extends them past `max_seq_len` where our
model refuses a longer sequence; `max_position_embeddings` records our limit.

What is written: `config.json`, `model.safetensors` (one file, metadata format "pt", as
`save_pretrained` writes it), `README.md` (what the weights and the token ids are), when the
token ids of the data are given `generation_config.json`, and with a tokenizer its files
(export_tokenizer.py; AutoTokenizer loads them).
Only θ_outer is exported: the outer momentum is training state, not the model. A node's own
model (`swarm.join`, model "custom") has no known architecture and is refused.

Failure modes: the whole state is read into memory (θ_outer and momentum: 8 bytes a
parameter, 8 GB for the 1b preset) because loading verifies every shard's hash first.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from swarm.model.checkpoint import CheckpointError, RunInfo
from swarm.model.checkpoint_dir import CheckpointDir
from swarm.model.configs import ModelConfig
from swarm.model.export_tokenizer import TOKENIZER_FILES, TokenizerExportError, readme, write_tokenizer
from swarm.model.llama import build_model
from swarm.utils.atomic import atomic_path, write_atomic

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WRITTEN = ("config.json", "model.safetensors", "generation_config.json", "README.md", *TOKENIZER_FILES)
# weight files another export (or `save_pretrained`) may have left: transformers would prefer or
# mix them with ours, so an export over an existing folder (--force) removes them
STALE = ("model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "generation_config.json",
         *TOKENIZER_FILES)  # fmt: skip
MAX_TOKEN_ID = (1 << 31) - 1

# our parameter name -> Hugging Face's, per block; the model-level names are below
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")


class ExportError(ValueError):
    """A checkpoint that cannot be exported, or an output folder we must not write: the message
    says which and why, in one line."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportOptions:
    dtype: str = "float32"  # of the exported weights (θ_outer is fp32): a key of DTYPES
    force: bool = False  # write into an output folder that is not empty
    bos_token_id: int | None = None  # the data's token ids, for generate(); None: unknown
    eos_token_id: int | None = None  # None: the tokenizer's end-of-text id, when one is exported
    tokenizer: str | None = None  # the run's tokenizer.json or Hugging Face name (export_tokenizer.py)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ExportError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value <= MAX_TOKEN_ID):
                raise ExportError(f"{name} must be a token id >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ExportResult:
    out: Path
    run_id: str
    step: int  # the outer step of the exported state
    model: str  # the preset name
    parameters: int
    nbytes: int  # of model.safetensors


def model_config_of(run: RunInfo) -> ModelConfig:
    """The decoder's config a checkpoint was made with; ExportError when it is not our Llama."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if not set(run.model_config) <= fields:
        unknown = ", ".join(sorted(set(run.model_config) - fields))[:120]
        raise ExportError(f"the checkpoint's model {run.model!r} is not one of our Llama presets (its config "
                          f"has {unknown}): it has no Hugging Face mapping; export it from the code that "
                          "defines it")  # fmt: skip
    try:
        return ModelConfig(**run.model_config)
    except (TypeError, ValueError) as e:
        raise ExportError(f"the checkpoint's model config of {run.model!r} is not valid: {e}") from None


def hf_config(config: ModelConfig, options: ExportOptions) -> dict[str, Any]:
    """config.json of the LlamaForCausalLM that equals our decoder of `config`. Both spellings of
    the rotary settings are written: `rope_theta` (transformers 4) and `rope_parameters` (5)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "torch_dtype": options.dtype,
        "use_cache": True,
        # None, not LlamaConfig's defaults (1 and 2): a byte-level model has no such tokens
        "bos_token_id": options.bos_token_id,
        "eos_token_id": options.eos_token_id,
        "pad_token_id": None,
    }


def generation_config(options: ExportOptions) -> dict[str, Any] | None:
    """generation_config.json when the data's special tokens are known (else None: not written)."""
    if options.bos_token_id is None and options.eos_token_id is None:
        return None
    body: dict[str, Any] = {"bos_token_id": options.bos_token_id, "eos_token_id": options.eos_token_id}
    if options.eos_token_id is not None:
        body["pad_token_id"] = options.eos_token_id  # generate() pads finished sequences with it
    return body


def hf_name(name: str, config: ModelConfig) -> str:
    """Hugging Face's name of our parameter `name`; ExportError for a name our decoder lacks."""
    if name == "tok_embeddings.weight":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "output.weight" and not config.tie_embeddings:
        return "lm_head.weight"
    block = _BLOCK.match(name)
    if block is not None and int(block[1]) < config.n_layers and block[2] in _BLOCK_NAMES:
        return f"model.layers.{int(block[1])}.{_BLOCK_NAMES[block[2]]}"
    raise ExportError(f"the checkpoint holds a parameter {name[:80]!r} that our Llama of this config does not have")


def hf_state(params: Mapping[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """θ_outer renamed for Hugging Face and cast to dtype. Every parameter of our decoder must be
    there with its shape (a meta-device model says which): ExportError otherwise."""
    expected = {name: p.shape for name, p in build_model(config, seed=0, device="meta").named_parameters()}
    renamed = {}
    for name, tensor in params.items():
        new = hf_name(name, config)
        if name not in expected or tuple(tensor.shape) != tuple(expected[name]):
            raise ExportError(f"parameter {name!r} has shape {tuple(tensor.shape)}, the model config says "
                              f"{tuple(expected.get(name, ()))}")  # fmt: skip
        if not torch.isfinite(tensor).all():
            raise ExportError(f"parameter {name!r} holds NaN or infinite values: this state is not a usable model")
        renamed[new] = tensor.to(dtype).contiguous()
    missing = sorted(set(expected) - set(params))
    if missing:
        raise ExportError(f"the checkpoint lacks {len(missing)} parameter(s) of the model, e.g. {missing[0]!r}")
    return renamed


def export_checkpoint(checkpoint_dir: Path, out: Path, options: ExportOptions) -> ExportResult:
    """Read the newest whole checkpoint in checkpoint_dir and write θ_outer to `out` as a
    transformers model folder. Raises ExportError (no checkpoint, a damaged or unmappable one,
    an output folder that is not empty without options.force) before anything is written."""
    _check_output(out, options.force)
    try:
        loaded = CheckpointDir(checkpoint_dir).load_latest()
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    except OSError as e:
        raise ExportError(f"cannot read {checkpoint_dir}: {e.strerror or e}") from None
    if loaded is None:
        raise ExportError(f"no checkpoint in {checkpoint_dir} (a step-<N> folder that swarm-node --checkpoint-dir "
                          "writes)")  # fmt: skip
    manifest, state = loaded
    config = model_config_of(manifest.run)
    tensors = hf_state(state["params"], config, DTYPES[options.dtype])
    metadata = {"format": "pt", "swarm_run_id": manifest.run.run_id[:128], "swarm_outer_step": str(manifest.step)}
    out.mkdir(parents=True, exist_ok=True)
    for stale in STALE:
        (out / stale).unlink(missing_ok=True)
    tokenizer = None
    if options.tokenizer is not None:
        try:
            tokenizer = write_tokenizer(options.tokenizer, out, vocab_size=config.vocab_size)
        except TokenizerExportError as e:
            raise ExportError(str(e)) from None
        if options.eos_token_id is None:
            options = dataclasses.replace(options, eos_token_id=tokenizer.eos_id)
    # each file whole or not at all: a killed export never leaves half a file under the name transformers loads
    write_atomic(out / "README.md", readme(manifest.run, manifest.step, tokenizer).encode())
    with atomic_path(out / "model.safetensors") as temp:
        save_file(tensors, temp, metadata=metadata)
    write_atomic(out / "config.json", _json(hf_config(config, options)))
    generation = generation_config(options)
    if generation is not None:
        write_atomic(out / "generation_config.json", _json(generation))
    parameters = sum(t.numel() for t in tensors.values())
    nbytes = (out / "model.safetensors").stat().st_size
    return ExportResult(out, manifest.run.run_id, manifest.step, manifest.run.model, parameters, nbytes)


def _check_output(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} exists and is not empty (pass --force to write into it)")


def _json(body: Mapping[str, Any]) -> bytes:
    return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
