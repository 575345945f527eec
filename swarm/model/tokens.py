"""A prepared dataset on disk: token shards plus manifest.json (written by prepare.py).

    manifest = read_manifest(Path("data"))        # parsed and bounded; TokensError when malformed
    verify(Path("data"), manifest)                # sizes and SHA-256 of every shard
    train = open_split(Path("data"), manifest, "train")   # numpy memmaps, no copy

A shard (`train-00000.bin`, `eval-00000.bin`, ...) is a raw little-endian array of token ids,
uint16 when the tokenizer's vocabulary fits, else uint32, so `numpy.memmap` reads it as it is.
Every train shard but the last holds exactly `shard_tokens` tokens. Documents are joined in
input order, each followed by the tokenizer's EOS id; whole documents (document 0, then every
`eval_every`-th, until the split holds `eval_tokens`) form the held-out eval split.

The manifest names the tokenizer, the SHA-256 of its vocabulary and every shard's token count and
SHA-256. Its own hash (`TokenManifest.sha256`, over its canonical JSON) therefore pins every
token: two folders of equal digest hold the same train and eval tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "swarm-tokens/1"
PREPARED_PREFIX = "tokens:"  # the run setting `data` of a prepared folder: tokens:<its manifest's digest>
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20
MAX_SHARDS = 100_000
MAX_SHARD_TOKENS = 1 << 31
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "eval")
_SHARD_NAME = {split: re.compile(rf"^{split}-\d{{5,}}\.bin$") for split in SPLITS}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HASH_CHUNK = 16 << 20


class TokensError(ValueError):
    """A prepared dataset that cannot be used (missing, malformed, damaged, or not matching its
    manifest): the message names the file and what is wrong, in one line."""


@dataclass(frozen=True, slots=True)
class ShardEntry:
    name: str
    tokens: int
    sha256: str


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    name: str  # a tokenizer.json's file name, or a Hugging Face tokenizer id
    vocab_size: int
    vocab_sha256: str  # of the token -> id map (vocab_digest in prepare.py)
    eos_id: int  # appended after every document


@dataclass(frozen=True, slots=True)
class TokenManifest:
    tokenizer: TokenizerInfo
    dtype: str  # a key of DTYPES
    shard_tokens: int
    train: tuple[ShardEntry, ...]
    eval: tuple[ShardEntry, ...]
    documents: dict[str, int]  # per split
    sources: dict[str, Any]  # files, bytes, the digest of their listing (what was tokenized)
    eval_every: int
    eval_tokens: int

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.split(split))

    def split(self, split: str) -> tuple[ShardEntry, ...]:
        return self.train if split == "train" else self.eval

    def to_json(self) -> bytes:
        """The canonical form (sorted keys, no spaces): equal manifests give equal bytes."""
        body = {
            "format": FORMAT,
            "tokenizer": {"name": self.tokenizer.name, "vocab_size": self.tokenizer.vocab_size,
                          "vocab_sha256": self.tokenizer.vocab_sha256, "eos_id": self.tokenizer.eos_id},
            "dtype": self.dtype,
            "shard_tokens": self.shard_tokens,
            "eval_every": self.eval_every,
            "eval_tokens": self.eval_tokens,
            "documents": self.documents,
            "sources": self.sources,
            **{split: [{"name": s.name, "tokens": s.tokens, "sha256": s.sha256} for s in self.split(split)]
               for split in SPLITS},
            "totals": {split: self.tokens(split) for split in SPLITS},
        }  # fmt: skip
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json()).hexdigest()


def parse_manifest(data: bytes) -> TokenManifest:
    """A manifest from its JSON, every field checked and bounded; raises TokensError."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise TokensError(f"{MANIFEST} of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise TokensError(f"{MANIFEST} is not JSON: {e}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise TokensError(f"{MANIFEST} is not a {FORMAT} manifest")
    raw_tok = _get(body, "tokenizer", dict)
    tokenizer = TokenizerInfo(_get(raw_tok, "name", str)[:256], _get(raw_tok, "vocab_size", int),
                              _get(raw_tok, "vocab_sha256", str), _get(raw_tok, "eos_id", int))  # fmt: skip
    dtype = _get(body, "dtype", str)
    if dtype not in DTYPES:
        raise TokensError(f"{MANIFEST}: dtype must be one of {', '.join(DTYPES)}, got {dtype[:16]!r}")
    if not 0 < tokenizer.vocab_size <= np.iinfo(DTYPES[dtype]).max + 1 or not _HEX64.match(tokenizer.vocab_sha256):
        raise TokensError(f"{MANIFEST}: a vocabulary of {tokenizer.vocab_size} does not fit {dtype}, or a bad digest")
    if not 0 <= tokenizer.eos_id < tokenizer.vocab_size:
        raise TokensError(f"{MANIFEST}: eos_id {tokenizer.eos_id} is outside the vocabulary")
    shard_tokens = _get(body, "shard_tokens", int)
    if not 0 < shard_tokens <= MAX_SHARD_TOKENS:
        raise TokensError(f"{MANIFEST}: shard_tokens must be in 1..{MAX_SHARD_TOKENS}")
    splits = {split: _entries(body, split, shard_tokens) for split in SPLITS}
    documents = _get(body, "documents", dict)
    if set(documents) != set(SPLITS) or not all(isinstance(documents[s], int) and documents[s] >= 0 for s in SPLITS):
        raise TokensError(f"{MANIFEST}: documents must count each split")
    totals = _get(body, "totals", dict)
    for split in SPLITS:
        counted = sum(s.tokens for s in splits[split])
        if totals.get(split) != counted:
            said = totals.get(split)
            raise TokensError(f"{MANIFEST}: the {split} total says {said!r} tokens, its shards hold {counted}")
    return TokenManifest(tokenizer, dtype, shard_tokens, splits["train"], splits["eval"], documents,
                         _get(body, "sources", dict), _get(body, "eval_every", int),
                         _get(body, "eval_tokens", int))  # fmt: skip


def _entries(body: dict[str, Any], split: str, shard_tokens: int) -> tuple[ShardEntry, ...]:
    raw = _get(body, split, list)
    if not 1 <= len(raw) <= MAX_SHARDS:
        raise TokensError(f"{MANIFEST}: the {split} split must have 1 to {MAX_SHARDS} shards")
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise TokensError(f"{MANIFEST}: a {split} shard entry is not an object")
        entry = ShardEntry(_get(item, "name", str), _get(item, "tokens", int), _get(item, "sha256", str))
        if entry.name != shard_name(split, i) or not _SHARD_NAME[split].match(entry.name):
            raise TokensError(f"{MANIFEST}: {split} shard {i} is named {entry.name[:64]!r}, not {shard_name(split, i)}")
        last = i == len(raw) - 1
        if not (0 < entry.tokens <= shard_tokens) or (split == "train" and not last and entry.tokens != shard_tokens):
            raise TokensError(f"{MANIFEST}: {entry.name} holds {entry.tokens} tokens; shards hold {shard_tokens} "
                              "(the last one 1 to that many)")  # fmt: skip
        if not _HEX64.match(entry.sha256):
            raise TokensError(f"{MANIFEST}: {entry.name} has a malformed SHA-256")
        entries.append(entry)
    return tuple(entries)


def _get(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TokensError(f"{MANIFEST}: {key!r} must be a {kind.__name__}")
    return value


def is_prepared_folder(spec: str) -> bool:
    """Whether `--data spec` names a folder: a prepared dataset, or a folder that read_manifest
    says is not one (the other values of --data are names: stdlib, hf:..., tokens:...)."""
    return spec != "stdlib" and not spec.startswith(("hf:", PREPARED_PREFIX)) and Path(spec).is_dir()


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


def read_manifest(folder: Path) -> TokenManifest:
    """The manifest of a prepared folder; TokensError when it is missing or malformed."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise TokensError(f"{folder} is not a folder")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise TokensError(f"{folder} has no {MANIFEST}: not a prepared dataset (swarm-data prepare writes one), "
                          "or its prepare has not finished") from None  # fmt: skip
    except OSError as e:
        raise TokensError(f"cannot read {path}: {e.strerror or e}") from None
    return parse_manifest(data)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify(folder: Path, manifest: TokenManifest, *, hashes: bool = True) -> None:
    """Every shard is there with the size its token count says and (hashes) its SHA-256.
    Raises TokensError naming the first shard that is not."""
    itemsize = DTYPES[manifest.dtype].itemsize
    for split in SPLITS:
        for entry in manifest.split(split):
            path = folder / entry.name
            try:
                size = path.stat().st_size
            except OSError as e:
                raise TokensError(f"shard {path}: {e.strerror or e}") from None
            if size != entry.tokens * itemsize:
                raise TokensError(
                    f"shard {path} has {size} bytes; the manifest says {entry.tokens} tokens "
                    f"({entry.tokens * itemsize} bytes): truncated, or the manifest is wrong"
                )
            if hashes and file_sha256(path) != entry.sha256:
                raise TokensError(f"shard {path}: its SHA-256 does not match the manifest (the file is damaged)")


def open_split(folder: Path, manifest: TokenManifest, split: str) -> list[np.memmap]:
    """Read-only memmaps of the split's shards, in order (call `verify` first)."""
    dtype = DTYPES[manifest.dtype]
    return [np.memmap(folder / e.name, dtype=dtype, mode="r", shape=(e.tokens,)) for e in manifest.split(split)]
