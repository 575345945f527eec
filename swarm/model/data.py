"""Training data: token streams, per-node training windows and the shared eval set.

    data = stdlib_corpus()                                   # no download, no token
    gen = node_generator(peer_id_bytes, step=global_inner_step)
    inputs, targets = sample_batch(data.train, batch_size=8, seq_len=256, generator=gen)
    windows = eval_windows(data.eval, seq_len=256)           # the same on every node

The default corpus is the Python standard library's own source files, read from the running
interpreter (`sysconfig.get_paths()["stdlib"]`; test suites and site-packages left out), in
sorted order, joined and capped in size, as byte-level tokens (one token per byte, ids 0..255).
`split_tokens` holds out one block of 16 Ki tokens in 20 as the eval set; training windows never
touch it. (A window may straddle the seam where a held-out block was cut out: harmless.)

A prepared folder (`swarm-data prepare`, prepare.py; `prepared_corpus`) is read in place: its
train shards as numpy memmaps (`ShardedTokens`, one stream over all shards, never copied into
memory), its eval split as a tensor. Its name is `tokens:<the manifest's digest>`, which is the
run setting `data` of a node that trains on it: nodes whose folders hold other tokens are refused
by the run's settings check, whatever their folders are called.

A prepared folder at an http(s) URL or in a Hugging Face repo (`hf-prepared:ORG/NAME`;
`remote_corpus`, remote_tokens.py) has its manifest and eval split fetched at once and each train
shard when a chunk in it is claimed (`ShardedTokens.lazy`): the same name, chunks and claims as
a local copy.

A Hugging Face dataset (`hf:<dataset>[:<config>]` with a tokenizer) is prepared once into a
local cache by prepare's code (hf_source.py) and read as a prepared folder: the same shards,
memmaps and chunk claims, never a Python list of tokens.

Failure modes: nodes on different Python versions read different corpora (and so different eval
sets); compare `TokenData.fingerprint` before comparing eval losses across nodes. A Hugging Face
dataset needs the `datasets` package (and the network, or a local folder of
`Dataset.save_to_disk`); without it DataUnavailableError says the fix. A prepared folder's shards are all
hashed when it is opened (about a second per GB): a damaged shard is refused, never trained on.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from swarm.model.hf_source import HFSource, prepare_hf
from swarm.model.remote_tokens import RemoteTokens, is_remote
from swarm.model.tokens import PREPARED_PREFIX, TokensError, is_prepared_folder, open_split, read_manifest, verify
from swarm_kernels import as_memoryview

BYTE_VOCAB = 256
DEFAULT_MAX_BYTES = 16 << 20  # about all of the stdlib's non-test source (CPython 3.11: ~12 MB)
EVAL_BLOCK = 1 << 14  # the token stream is split into train and eval in blocks of this many tokens
EVAL_SHARE = 20  # one block in EVAL_SHARE goes to the eval set
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


class DataUnavailableError(RuntimeError):
    """The requested data or tokenizer cannot be loaded here; the message says why and the fix."""


class ShardSource(Protocol):
    """Shards that arrive later (remote_tokens.RemoteTokens): `prefetch` starts a fetch, `get`
    waits for it and returns the shard, or raises TokensError."""

    def prefetch(self, shard: int) -> None: ...

    def get(self, shard: int) -> np.ndarray: ...


class ShardedTokens:
    """One token stream over several 1-D arrays (a prepared folder's memmapped shards), read
    without copying them: `len` and `windows` are all that sampling needs. Built `lazy`, a shard
    is fetched from its source when a chunk in it is claimed (`prefetch`) or first read."""

    def __init__(self, shards: Sequence[np.ndarray]) -> None:
        if not shards or any(s.ndim != 1 or len(s) == 0 for s in shards):
            raise ValueError("ShardedTokens needs one or more non-empty 1-D arrays")
        self.shards: list[np.ndarray | None] = list(shards)
        self.lengths = tuple(len(s) for s in shards)
        self.ends = np.cumsum(self.lengths)  # the stream offset where each shard ends
        self._source: ShardSource | None = None

    @classmethod
    def lazy(cls, lengths: Sequence[int], source: ShardSource) -> ShardedTokens:
        if not lengths or any(n <= 0 for n in lengths):
            raise ValueError("ShardedTokens needs one or more non-empty shards")
        tokens = cls.__new__(cls)
        tokens.shards, tokens.lengths = [None] * len(lengths), tuple(lengths)
        tokens.ends, tokens._source = np.cumsum(tokens.lengths), source
        return tokens

    def __len__(self) -> int:
        return int(self.ends[-1])

    def prefetch(self, shard: int) -> None:
        """Start fetching a shard that is not here yet (a chunk in it was claimed)."""
        if self._source is not None and self.shards[shard] is None:
            self._source.prefetch(shard)

    def _shard(self, shard: int) -> np.ndarray:
        array = self.shards[shard]
        if array is None:
            assert self._source is not None  # only a lazy stream has missing shards
            array = self.shards[shard] = self._source.get(shard)
        return array

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """int64 [len(starts), length]: the tokens at starts[i] .. starts[i] + length - 1, a
        window that crosses from one shard into the next joined from both."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            if not 0 <= start <= len(self) - length:
                raise ValueError(f"window {start}..{start + length} is outside the {len(self)} tokens")
            shard = int(np.searchsorted(self.ends, start, side="right"))
            filled = 0
            while filled < length:
                begin = start + filled - (int(self.ends[shard - 1]) if shard else 0)
                piece = self._shard(shard)[begin : begin + length - filled]
                out[row, filled : filled + len(piece)] = piece
                filled += len(piece)
                shard += 1
        return torch.from_numpy(out)


@dataclass(frozen=True, slots=True)
class TokenData:
    name: str  # "stdlib", "hf:<dataset>" or "tokens:<digest>" (a prepared folder)
    train: torch.Tensor | ShardedTokens  # 1-D token ids (uint8 for bytes, int32 for a tokenizer), on the CPU
    eval: torch.Tensor  # 1-D, held out: never sampled for training
    vocab_size: int
    fingerprint: str  # sha256 over both splits: equal on two nodes => same train and eval tokens

    def __post_init__(self) -> None:
        for split in (self.train, self.eval):
            if isinstance(split, ShardedTokens) and split is self.train:
                continue
            if split.dim() != 1 or split.dtype not in (torch.uint8, torch.int32, torch.int64):
                raise ValueError("token splits must be 1-D uint8/int32/int64 tensors")


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> TokenData:
    """The standard library's source as bytes: deterministic for one Python version and cap."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    texts, total = [], 0
    for path in _stdlib_files():
        texts.append(path.read_bytes()[: max_bytes - total] + b"\n")
        total += len(texts[-1])
        if total >= max_bytes:
            break
    tokens = torch.frombuffer(bytearray(b"".join(texts)), dtype=torch.uint8)
    return _token_data("stdlib", *split_tokens(tokens), BYTE_VOCAB)


def _stdlib_files() -> Iterator[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataUnavailableError(f"this interpreter has no standard library source at {root}")
    files = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]  # prune: never walk the tests
        for name in filenames:
            if name.endswith(".py"):
                path = Path(folder, name)
                files.append((path.relative_to(root).as_posix(), path))
    yield from (path for _, path in sorted(files))


def split_tokens(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval): the stream cut into blocks of EVAL_BLOCK tokens; block 1, then every
    EVAL_SHARE-th block, is held out (5%). Needs more than one block."""
    if len(tokens) <= EVAL_BLOCK:
        raise DataUnavailableError(f"{len(tokens)} tokens are too few to split: need more than {EVAL_BLOCK}")
    # slices, not a mask over the stream: a mask of 12 M tokens took 0.4 s of every node's start
    train, held = [], []
    kept_from = 0
    for start in range(EVAL_BLOCK, len(tokens), EVAL_BLOCK * EVAL_SHARE):
        train.append(tokens[kept_from:start])
        held.append(tokens[start : start + EVAL_BLOCK])
        kept_from = start + EVAL_BLOCK
    train.append(tokens[kept_from:])
    return torch.cat(train), torch.cat(held)


def _token_data(name: str, train: torch.Tensor, eval_: torch.Tensor, vocab_size: int) -> TokenData:
    digest = hashlib.sha256(name.encode())
    for split in (train, eval_):
        digest.update(len(split).to_bytes(8, "little"))
        digest.update(as_memoryview(split.contiguous()))
    return TokenData(name, train, eval_, vocab_size, digest.hexdigest())


def prepared_corpus(folder: Path, *, verify_hashes: bool = True) -> TokenData:
    """A `swarm-data prepare` folder: train as memmapped shards, eval as a tensor (module
    docstring). Raises DataUnavailableError naming the file and what is wrong."""
    try:
        manifest = read_manifest(folder)
        verify(folder, manifest, hashes=verify_hashes)
        train = ShardedTokens(open_split(folder, manifest, "train"))
        held = np.concatenate(open_split(folder, manifest, "eval")).astype(np.int32)
    except TokensError as e:
        raise DataUnavailableError(f"--data {folder}: {e}") from None
    digest = manifest.sha256
    return TokenData(PREPARED_PREFIX + digest, train, torch.from_numpy(held), manifest.tokenizer.vocab_size, digest)


def remote_corpus(spec: str, cache: Path | None = None) -> TokenData:
    """A prepared folder at an http(s) URL or in a Hugging Face repo (remote_tokens.py): the
    manifest and eval split now, each train shard when a chunk in it is claimed. The run setting
    is the manifest's digest, as for a local copy. Raises DataUnavailableError in one line."""
    try:
        remote = RemoteTokens.open(spec, cache)
        held = np.concatenate(remote.eval_split()).astype(np.int32)
    except TokensError as e:
        raise DataUnavailableError(f"--data {spec}: {e}") from None
    manifest = remote.manifest
    train = ShardedTokens.lazy([entry.tokens for entry in manifest.train], remote)
    digest = manifest.sha256
    return TokenData(PREPARED_PREFIX + digest, train, torch.from_numpy(held), manifest.tokenizer.vocab_size, digest)


def load_data(spec: str, *, tokenizer: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> TokenData:
    """`--data`: "stdlib" (the default corpus), "hf:<dataset>[:<config>]" with a tokenizer (a
    tokenizer.json or Hugging Face name; prepared into a local cache), or the path of a folder
    that `swarm-data prepare` wrote."""
    if spec == "stdlib":
        return stdlib_corpus(max_bytes)
    if spec.startswith("hf:") and len(spec) > 3:
        if not tokenizer:
            raise DataUnavailableError(f"--data {spec} needs --tokenizer (a tokenizer.json or a Hugging Face name)")
        dataset, _, config = spec[3:].partition(":")
        try:  # prepared once into a local cache (hf_source.py), then read as a prepared folder
            folder = prepare_hf(HFSource(dataset=dataset, config=config or None), tokenizer)
        except TokensError as e:
            raise DataUnavailableError(f"--data {spec}: {e}") from None
        return prepared_corpus(folder)
    if spec.startswith(PREPARED_PREFIX):  # a run's setting, adopted by a node that was given no --data
        raise DataUnavailableError(f"this run trains on the prepared dataset {spec[:len(PREPARED_PREFIX) + 16]}...: "
                                   "pass --data DIR, a folder of `swarm-data prepare` whose digest "
                                   "(swarm-data info DIR) is that one")  # fmt: skip
    if is_prepared_folder(spec):
        return prepared_corpus(Path(spec))
    if is_remote(spec):  # a prepared folder at a URL or in a Hugging Face repo: shards fetched as claimed
        return remote_corpus(spec)
    raise ValueError(f"unknown data {spec!r}: use 'stdlib', 'hf:<dataset>[:<config>]', a prepared folder, "
                     "its http(s) URL or 'hf-prepared:ORG/NAME'")  # fmt: skip


def node_generator(peer_id_bytes: bytes, step: int, *, extra: bool = False) -> torch.Generator:
    """The CPU generator a node samples its training windows with at `step`: different for every
    (PeerID, step), the same whenever the node repeats that step (after a restart, say). `extra`:
    an inner step past H (DiLoCo.extra_room), whose index is also the next outer step's: drawn
    apart, so that the next step does not train on the same windows again."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    domain = b"swarm.data.extra:" if extra else b"swarm.data:"
    digest = hashlib.sha256(domain + step.to_bytes(8, "little") + bytes(peer_id_bytes)).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample_batch(
    train_tokens: torch.Tensor | ShardedTokens, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows of `seq_len + 1` tokens: (inputs, targets), each int64
    [batch_size, seq_len], on the CPU; targets are the inputs shifted by one token."""
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError("batch_size and seq_len must be positive")
    if len(train_tokens) <= seq_len + 1:
        raise ValueError(f"{len(train_tokens)} training tokens are too few for windows of {seq_len + 1}")
    starts = torch.randint(0, len(train_tokens) - seq_len, (batch_size,), generator=generator)
    if isinstance(train_tokens, ShardedTokens):  # the same draw, read from the shards
        windows = train_tokens.windows(starts, seq_len + 1)
    else:
        windows = train_tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def eval_windows(eval_tokens: torch.Tensor, seq_len: int, max_windows: int = 64) -> torch.Tensor:
    """Up to `max_windows` evenly spaced windows of `seq_len + 1` tokens, int64
    [n, seq_len + 1]: a function of the eval tokens alone, so every node scores the same text."""
    if seq_len <= 0 or max_windows <= 0:
        raise ValueError("seq_len and max_windows must be positive")
    n = min(max_windows, len(eval_tokens) // (seq_len + 1))
    if n == 0:
        raise ValueError(f"{len(eval_tokens)} eval tokens are too few for one window of {seq_len + 1}")
    starts = torch.arange(n) * ((len(eval_tokens) - seq_len - 1) // max(n - 1, 1))
    return eval_tokens[starts[:, None] + torch.arange(seq_len + 1)].long()
