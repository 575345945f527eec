"""`swarm-data prepare`: local text files -> token shards + manifest.json (the format: tokens.py).

    tok = load_tokenizer("tokenizer.json")                  # or a Hugging Face id, with transformers
    result = prepare([Path("corpus/")], tok, Path("data"), PrepareConfig(shard_tokens=1 << 26))

Documents (sources.py) are tokenized in batches by the tokenizer's Rust side (`encode_batch_fast`,
all cores), each followed by the EOS id, and written as shards of `shard_tokens` tokens; whole
documents (document 0, then every `eval_every`-th, until `eval_tokens` are held) go to the eval
split instead, kept in memory until the end.

Resumable: after each train shard, `progress.json` records the shards written and the cursor
(the document whose tokens run past the last shard, and how many of them are already in shards);
the eval tokens held so far go to `eval-held-<shards>.bin` first. A prepare killed at any instant
continues from the last whole shard when it is run again with the same inputs, tokenizer and
settings, and writes the same shards as a run that was never killed. Inputs that changed since
(size or modification time), or other settings, are refused: `force` starts over.

Every file is written to a temporary name, fsynced and renamed, so a shard or manifest on disk is
always whole. `manifest.json` is written last: its presence means the folder is complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from swarm.model.sources import Source, documents, find_sources, listing
from swarm.model.tokens import (
    DTYPES,
    MANIFEST,
    ShardEntry,
    TokenizerInfo,
    TokenManifest,
    TokensError,
    file_sha256,
    shard_name,
)
from swarm.utils.atomic import write_atomic

PROGRESS = "progress.json"
PROGRESS_FORMAT = "swarm-tokens-progress/1"
# end-of-text tokens under the names tokenizers commonly give them, tried in this order
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
MAX_PROGRESS_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareConfig:
    shard_tokens: int = 1 << 26  # tokens per shard: 128 MB of uint16
    eval_every: int = 100  # document 0, then every eval_every-th, is held out ...
    eval_tokens: int = 1 << 20  # ... until the eval split holds this many tokens
    text_field: str = "text"  # of a .jsonl object or a .parquet column
    max_document_bytes: int = 64 << 20
    batch_documents: int = 1024  # documents per encode_batch call
    batch_bytes: int = 16 << 20  # ... or this much text, whichever comes first
    force: bool = False  # start over in a folder that holds another (or a finished) prepare

    def __post_init__(self) -> None:
        bounds = {"shard_tokens": (1, 1 << 31), "eval_every": (1, 1 << 30), "eval_tokens": (1, 1 << 31),
                  "max_document_bytes": (1, 1 << 31), "batch_documents": (1, 1 << 20),
                  "batch_bytes": (1, 1 << 31)}  # fmt: skip
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise TokensError(f"{name} must be an integer in {low}..{high}, got {value!r}")
        if not self.text_field or len(self.text_field) > 128:
            raise TokensError("text_field must be a name of 1 to 128 characters")

    def job_fields(self) -> dict[str, Any]:
        """The settings that change the shards (not the batch sizes, which change only speed)."""
        return {n: getattr(self, n) for n in ("shard_tokens", "eval_every", "eval_tokens", "text_field",
                                              "max_document_bytes")}  # fmt: skip


@dataclass(frozen=True, slots=True)
class LoadedTokenizer:
    tokenizer: Any  # a tokenizers.Tokenizer
    info: TokenizerInfo


def vocab_digest(vocab: Mapping[str, int]) -> str:
    """SHA-256 of the token -> id map, in id order: equal for equal vocabularies, however loaded."""
    items = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def load_tokenizer(spec: str, eos_token: str | None = None) -> LoadedTokenizer:
    """A fast tokenizer from a tokenizer.json path, or from a Hugging Face name (needs
    transformers, and the network or its cache). The EOS id: `eos_token`'s, else the
    tokenizer's own end-of-text token. TokensError when any of that fails."""
    path = Path(spec)
    eos_id: int | None = None
    if path.is_file():
        from tokenizers import Tokenizer  # the `hf` extra's; imported only by prepare

        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise TokensError(f"{path} is not a tokenizer.json: {e}") from None
        name = path.name
    elif path.suffix == ".json":
        raise TokensError(f"{spec}: no such tokenizer file")
    else:  # a Hugging Face id ("gpt2", "org/name") or a local folder that transformers reads
        tokenizer, eos_id = _hub_tokenizer(spec)
        name = spec
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if eos_token is not None:
        eos_id = vocab.get(eos_token)
        if eos_id is None:
            raise TokensError(f"the tokenizer has no token {eos_token!r} for the end of a document")
    if eos_id is None:
        eos_id = next((vocab[t] for t in EOS_NAMES if t in vocab), None)
    if eos_id is None:
        raise TokensError(f"the tokenizer has none of the usual end-of-text tokens ({', '.join(EOS_NAMES)}): "
                          "name one with --eos-token")  # fmt: skip
    vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    if vocab_size > 1 << 32:
        raise TokensError(f"a vocabulary of {vocab_size} tokens does not fit 32 bits")
    return LoadedTokenizer(tokenizer, TokenizerInfo(name[:256], vocab_size, vocab_digest(vocab), eos_id))


def _hub_tokenizer(name: str) -> tuple[Any, int | None]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokensError(f"{name!r} is not a file; a tokenizer name needs transformers (pip install -e '.[hf]'), "
                          "or pass a tokenizer.json") from None  # fmt: skip
    try:
        loaded = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # no network, unknown name, gated repository: all the same to a user
        raise TokensError(f"cannot load the tokenizer {name!r}: {e}") from None
    if not getattr(loaded, "is_fast", False):
        raise TokensError(f"{name!r} has no fast (Rust) tokenizer: export its tokenizer.json and pass that")
    return loaded.backend_tokenizer, loaded.eos_token_id


@dataclass(frozen=True, slots=True)
class PrepareResult:
    manifest: TokenManifest
    out: Path
    resumed_shards: int  # train shards found written by an earlier, killed run
    tokens: int  # tokenized by this run
    seconds: float


@dataclass(slots=True)
class _Progress:
    """What a killed prepare leaves for the next one (PROGRESS), and the eval tokens held."""

    job: str
    train: list[ShardEntry] = field(default_factory=list)
    next_document: int = 0  # the first document not wholly in the shards written
    skip_tokens: int = 0  # of that document's tokens (with its EOS), those already in shards
    documents: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})
    eval_parts: list[np.ndarray] = field(default_factory=list)
    eval_held: int = 0
    eval_file: str | None = None  # where eval_parts were last saved
    eval_saved: int = 0  # eval tokens in eval_file

    def to_json(self) -> bytes:
        body = {"format": PROGRESS_FORMAT, "job": self.job, "next_document": self.next_document,
                "skip_tokens": self.skip_tokens, "documents": self.documents, "eval_file": self.eval_file,
                "eval_tokens": self.eval_saved, "train": [dataclasses.asdict(e) for e in self.train]}  # fmt: skip
        return json.dumps(body, sort_keys=True).encode()


def prepare(
    paths: Sequence[Path],
    tokenizer: LoadedTokenizer,
    out: Path,
    config: PrepareConfig,
    *,
    on_shard: Callable[[int], None] | None = None,
) -> PrepareResult:
    """Tokenize `paths` into `out` (see the module docstring). `on_shard(i)` runs after train
    shard i is on disk, before the progress records it. Raises TokensError."""
    started = time.monotonic()
    sources = find_sources(paths)
    dtype = DTYPES["uint16"] if tokenizer.info.vocab_size <= 1 << 16 else DTYPES["uint32"]
    progress = _open_output(out, _job_digest(sources, tokenizer.info, config), config.force, dtype)
    if not progress.train:  # a run killed before its first shard is recorded must still be resumable
        _save_progress(out, progress)
    resumed, tokens = len(progress.train), 0
    pending: list[np.ndarray] = []
    pending_tokens = 0
    index = progress.next_document
    texts = documents(sources, text_field=config.text_field, start=index,
                      max_document_bytes=config.max_document_bytes)  # fmt: skip
    for batch in _batches(texts, config):
        for encoding in tokenizer.tokenizer.encode_batch_fast(batch, add_special_tokens=False):
            ids = _with_eos(encoding.ids, tokenizer.info.eos_id, dtype)
            full = len(ids)
            tokens += full
            partial = index == progress.next_document and progress.skip_tokens > 0
            if partial:  # a train document cut by the last shard of the killed run: its rest
                ids = ids[progress.skip_tokens :]
            elif index % config.eval_every == 0 and progress.eval_held < config.eval_tokens:
                progress.eval_parts.append(ids)
                progress.eval_held += full
                progress.documents["eval"] += 1
                index += 1
                continue
            else:
                progress.documents["train"] += 1
            pending.append(ids)
            pending_tokens += len(ids)
            if pending_tokens >= config.shard_tokens:
                pending = _write_full_shards(out, progress, pending, (index, full), config.shard_tokens, on_shard)
                pending_tokens = sum(len(p) for p in pending)
            index += 1
    manifest = _finish(out, progress, pending, tokenizer.info, dtype, config, sources)
    return PrepareResult(manifest, out, resumed, tokens, time.monotonic() - started)


def _with_eos(ids: list[int], eos: int, dtype: np.dtype) -> np.ndarray:
    array = np.empty(len(ids) + 1, dtype=dtype)
    array[:-1] = ids
    array[-1] = eos
    return array


def _batches(texts: Iterable[str], config: PrepareConfig) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if len(batch) >= config.batch_documents or size >= config.batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write_full_shards(out: Path, progress: _Progress, pending: list[np.ndarray], document: tuple[int, int],
                       shard_tokens: int, on_shard: Callable[[int], None] | None) -> list[np.ndarray]:  # fmt: skip
    """Write every whole shard the pending tokens make, recording each in the progress; returns
    what is left (fewer than shard_tokens). document: (index, tokens with its EOS) of the document
    whose tokens were appended last. The pending tokens were fewer than shard_tokens before it, so
    what is left after a cut is always the end of that document: the cursor points into it."""
    joined = np.concatenate(pending)
    index, full = document
    start = 0
    while len(joined) - start >= shard_tokens:
        _write_shard(out, progress.train, "train", joined[start : start + shard_tokens])
        if on_shard is not None:
            on_shard(len(progress.train) - 1)
        start += shard_tokens
        rest = len(joined) - start
        progress.next_document, progress.skip_tokens = (index, full - rest) if rest else (index + 1, 0)
        _save_progress(out, progress)
    return [joined[start:]] if start < len(joined) else []


def _write_shard(out: Path, entries: list[ShardEntry], split: str, tokens: np.ndarray) -> None:
    data = tokens.tobytes()
    name = shard_name(split, len(entries))
    write_atomic(out / name, data)
    entries.append(ShardEntry(name, len(tokens), hashlib.sha256(data).hexdigest()))


def _save_progress(out: Path, progress: _Progress) -> None:
    """The eval tokens held (when they changed) under a new name, then the progress naming them,
    then the old eval file away: a kill between any two steps leaves a consistent pair."""
    old = progress.eval_file
    if progress.eval_held != progress.eval_saved:
        progress.eval_file = f"eval-held-{len(progress.train):05d}.bin"
        write_atomic(out / progress.eval_file, np.concatenate(progress.eval_parts).tobytes())
        progress.eval_saved = progress.eval_held
    write_atomic(out / PROGRESS, progress.to_json())
    if old is not None and old != progress.eval_file:
        (out / old).unlink(missing_ok=True)


def _finish(out: Path, progress: _Progress, pending: list[np.ndarray], info: TokenizerInfo, dtype: np.dtype,
            config: PrepareConfig, sources: Sequence[Source]) -> TokenManifest:  # fmt: skip
    if pending:
        _write_shard(out, progress.train, "train", np.concatenate(pending))
    if not progress.train:
        raise TokensError("no document is left for training: every one went to the eval split (add more "
                          "documents, or raise --eval-every)")  # fmt: skip
    evals: list[ShardEntry] = []
    held = np.concatenate(progress.eval_parts)
    for start in range(0, len(held), config.shard_tokens):
        _write_shard(out, evals, "eval", held[start : start + config.shard_tokens])
    dtype_name = next(n for n, d in DTYPES.items() if d == dtype)
    sources_info = {"files": len(sources), "bytes": sum(s.size for s in sources)}
    manifest = TokenManifest(info, dtype_name, config.shard_tokens, tuple(progress.train), tuple(evals),
                             dict(progress.documents), sources_info, config.eval_every, config.eval_tokens)  # fmt: skip
    write_atomic(out / MANIFEST, json.dumps(json.loads(manifest.to_json()), indent=1, sort_keys=True).encode())
    (out / PROGRESS).unlink(missing_ok=True)
    for held_file in out.glob("eval-held-*.bin"):
        held_file.unlink()
    return manifest


def _job_digest(sources: Sequence[Source], info: TokenizerInfo, config: PrepareConfig) -> str:
    body = {"sources": listing(sources), "tokenizer": dataclasses.asdict(info), "config": config.job_fields()}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _ours(path: Path) -> bool:
    """A file a prepare writes (the only ones `force` removes)."""
    name = path.name
    return (name in (MANIFEST, PROGRESS) or (name.startswith(("train-", "eval-")) and name.endswith(".bin"))
            or (name.startswith(".") and ".tmp-" in name))  # fmt: skip


def _open_output(out: Path, job: str, force: bool, dtype: np.dtype) -> _Progress:
    """The progress to continue from: a fresh one, or a killed run's with its files checked."""
    if out.exists() and not out.is_dir():
        raise TokensError(f"{out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)
    for temp in out.glob(".*.tmp-*"):  # a killed writer's
        temp.unlink()
    entries = list(out.iterdir())
    if force:
        for path in entries:
            if _ours(path):
                path.unlink()
        return _Progress(job)
    if (out / MANIFEST).exists():
        raise TokensError(f"{out} already holds a prepared dataset (swarm-data info {out}); pass --force to redo it")
    if (out / PROGRESS).exists():
        return _resumed(out, job, dtype)
    if entries:
        raise TokensError(f"{out} is not empty: prepare into a new folder, or pass --force")
    return _Progress(job)


def _resumed(out: Path, job: str, dtype: np.dtype) -> _Progress:
    with open(out / PROGRESS, "rb") as f:
        data = f.read(MAX_PROGRESS_BYTES + 1)
    try:
        body = json.loads(data)
        if body.get("format") != PROGRESS_FORMAT:
            raise ValueError("another format")
        progress = _Progress(job, [ShardEntry(e["name"], int(e["tokens"]), e["sha256"]) for e in body["train"]],
                             int(body["next_document"]), int(body["skip_tokens"]),
                             {k: int(body["documents"][k]) for k in ("train", "eval")})  # fmt: skip
        eval_file, eval_tokens = body["eval_file"], int(body["eval_tokens"])
        if body["job"] != job:
            raise TokensError(f"{out} holds an unfinished prepare of other inputs, tokenizer or settings (or inputs "
                              "changed since): pass --force to start over")  # fmt: skip
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, TokensError):
            raise
        raise TokensError(f"{out / PROGRESS} is malformed ({e}): pass --force to start over") from None
    for i, entry in enumerate(progress.train):
        if entry.name != shard_name("train", i) or not _whole(out / entry.name, entry.tokens * dtype.itemsize,
                                                              entry.sha256):  # fmt: skip
            raise TokensError(f"{out / entry.name} is not the shard the unfinished prepare wrote: pass --force")
    if eval_file is not None:
        held = out / Path(eval_file).name
        try:
            progress.eval_parts = [np.fromfile(held, dtype=dtype)]
        except OSError as e:
            raise TokensError(f"{held}: {e.strerror or e}: pass --force to start over") from None
        if len(progress.eval_parts[0]) != eval_tokens:
            raise TokensError(f"{held} holds {len(progress.eval_parts[0])} tokens, not {eval_tokens}: pass --force")
        progress.eval_file, progress.eval_held = held.name, eval_tokens
        progress.eval_saved = eval_tokens
    return progress


def _whole(path: Path, nbytes: int, sha256: str) -> bool:
    with contextlib.suppress(OSError):
        return path.stat().st_size == nbytes and file_sha256(path) == sha256
    return False
