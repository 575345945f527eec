"""The vocabulary of an exported model (`swarm-export`): tokenizer files, or a README that says
the ids are bytes.

    info = write_tokenizer("tokenizer.json", Path("hf-model"), vocab_size=400)   # then, with no code of ours:
    AutoTokenizer.from_pretrained("hf-model")                                    # the run's tokenizer
    write_readme(Path("hf-model"), run, step, info)

A run on prepared data (`tokens:<digest>`) trained on a tokenizer's ids; the checkpoint names
the data, not the tokenizer file, so the export is handed it (`--tokenizer`, the same
tokenizer.json or Hugging Face name given to `swarm-data prepare`) and refuses one whose
vocabulary is not the model's size. It is written as transformers' `PreTrainedTokenizerFast`
writes it (tokenizer.json, tokenizer_config.json, special_tokens_map.json), with the data's
end-of-text token as its EOS. A byte-level run (`--data stdlib`) has no tokenizer: ids 0..255
are the bytes themselves, which the README says, with the two lines that decode them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarm.model.checkpoint import RunInfo
from swarm.model.prepare import load_tokenizer
from swarm.model.tokens import TokensError

BYTE_VOCAB = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TokenizerExportError(ValueError):
    """A tokenizer that cannot be exported with this model (one line)."""


@dataclass(frozen=True, slots=True)
class ExportedTokenizer:
    name: str
    vocab_size: int
    vocab_sha256: str
    eos_id: int


def write_tokenizer(spec: str, out: Path, *, vocab_size: int) -> ExportedTokenizer:
    """The tokenizer `spec` (a tokenizer.json or a Hugging Face name) saved into `out` for
    AutoTokenizer; TokenizerExportError when it cannot be loaded or its vocabulary is not the
    model's. Needs transformers (the `hf` extra)."""
    try:
        loaded = load_tokenizer(spec)
    except TokensError as e:
        raise TokenizerExportError(f"--tokenizer {spec}: {e}") from None
    info = loaded.info
    if info.vocab_size != vocab_size:
        raise TokenizerExportError(f"--tokenizer {spec} has {info.vocab_size} tokens; the model was trained on "
                                   f"{vocab_size}: not the run's tokenizer")  # fmt: skip
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise TokenizerExportError("--tokenizer needs transformers: pip install -e '.[hf]'") from None
    eos = loaded.tokenizer.id_to_token(info.eos_id)
    fast = PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer, eos_token=eos)
    fast.save_pretrained(str(out))
    return ExportedTokenizer(info.name, info.vocab_size, info.vocab_sha256, info.eos_id)


def readme(run: RunInfo, step: int, tokenizer: ExportedTokenizer | None) -> str:
    """The model card: what the weights are, and what the token ids mean."""
    lines = [f"# {run.run_id}: model {run.model} at outer step {step}", "",
             "Trained by a swarm (peer-to-peer DiLoCo); `AutoModelForCausalLM.from_pretrained` loads this folder.",
             f"Data: `{run.data}`.", "", "## Vocabulary", ""]  # fmt: skip
    if tokenizer is not None:
        lines += [f"The tokenizer `{tokenizer.name}` ({tokenizer.vocab_size} tokens, vocabulary SHA-256 "
                  f"`{tokenizer.vocab_sha256}`, end of text id {tokenizer.eos_id}), in this folder: "
                  "`AutoTokenizer.from_pretrained` loads it."]  # fmt: skip
    elif run.model_config.get("vocab_size") == BYTE_VOCAB and run.data == "stdlib":
        lines += ["Bytes: token id i is the byte i (0..255), one token per byte of UTF-8 text; there is no",
                  "tokenizer file.", "", "```python",
                  'ids = list("text".encode("utf-8"))                        # encode',
                  'text = bytes(ids).decode("utf-8", errors="replace")       # decode', "```"]  # fmt: skip
    else:
        lines += [f"Token ids of the data `{run.data}`; its tokenizer was not exported (pass `--tokenizer`)."]
    return "\n".join(lines) + "\n"
