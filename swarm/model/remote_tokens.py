"""A prepared folder (tokens.py) served over HTTP, fetched shard by shard as the node needs it.

    --data https://host/path/                      # the folder's manifest.json at its root
    --data hf-prepared:ORG/NAME[/PATH][@REVISION]  # a Hugging Face dataset repo holding one

    remote = RemoteTokens.open("hf-prepared:org/data")   # the manifest and the eval split, verified
    remote.prefetch(3)                                    # train shard 3 downloads in a thread
    shard = remote.get(3)                                 # waits for it: a memmap, or TokensError

A Hugging Face repo is read through the hub's own resolve URLs,
`{HF_ENDPOINT}/datasets/ORG/NAME/resolve/REVISION/PATH/FILE` (HF_ENDPOINT defaults to
https://huggingface.co; HF_TOKEN, when set, goes along as a bearer token for a private repo), so
that both sources travel one download path with one verification, and a test serves the same
layout from 127.0.0.1. huggingface_hub's own download would keep a second cache of its own layout
and check files by ETag, not by the manifest's SHA-256.

The manifest comes first (at most MAX_MANIFEST_BYTES, parsed and bounded as a local one); the
cache folder is named by the URL and the manifest's digest, so a folder republished with other
tokens never mixes with the old one. The eval split is fetched at once (every node scores on
it); a train shard when the node first claims a chunk in it (the chunk cursor calls `prefetch`
when a chunk is won, so the shard downloads while the chunk before it trains). Each shard is
streamed to a temporary file while its SHA-256 is computed, at most the size its token count
says and within a deadline its size sets; a shard whose hash or size does not match, or whose
download breaks off, is downloaded once more and then refused with one line naming the shard:
a bad shard is never renamed into place, so never read. Shards already in the cache with the
right size and hash are kept.

Failure mode: the cache keeps every shard it fetched (a node trains chunks of many shards over
an epoch), so its disk use grows up to the dataset's size.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from swarm.model.tokens import (
    DTYPES,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    ShardEntry,
    TokenManifest,
    TokensError,
    file_sha256,
    parse_manifest,
)
from swarm.utils.atomic import atomic_path, write_atomic

DEFAULT_CACHE = Path(os.environ.get("SWARM_DATA_CACHE", Path.home() / ".cache" / "swarm" / "data"))
HF_PREFIX = "hf-prepared:"
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
TIMEOUT_S = 30.0  # per connection and per read: a stalled server ends the download
MIN_BYTES_PER_S = 256 << 10  # a shard slower than this (after a minute's grace) is a broken download
READ_BYTES = 1 << 20
TRIES = 2  # a shard that fails twice is refused
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,200})*$")


def is_remote(spec: str) -> bool:
    return spec.startswith(("http://", "https://", HF_PREFIX))


def remote_url(spec: str) -> str:
    """The base URL (ending in /) of `--data spec`: an http(s) URL as it is, a Hugging Face repo
    of prepared shards as the hub's resolve URL of its folder; TokensError when malformed."""
    if len(spec) > 2048:
        raise TokensError(f"{spec[:80]!r}...: a --data URL has at most 2048 characters")
    if spec.startswith(("http://", "https://")):
        return spec if spec.endswith("/") else spec + "/"
    if not spec.startswith(HF_PREFIX):
        raise TokensError(f"{spec[:80]!r} is neither an http(s) URL nor {HF_PREFIX}ORG/NAME[/PATH][@REVISION]")
    repo, _, revision = spec[len(HF_PREFIX) :].partition("@")
    if not _HF_REPO.match(repo) or ".." in repo.split("/"):
        raise TokensError(f"--data {spec[:80]}: expected {HF_PREFIX}ORG/NAME[/PATH][@REVISION]")
    org, name, *path = repo.split("/")
    endpoint = os.environ.get("HF_ENDPOINT", HF_DEFAULT_ENDPOINT).rstrip("/")
    rev = urllib.parse.quote(revision or "main", safe="")  # refs/pr/1 is one path segment, as the hub wants
    return f"{endpoint}/datasets/{org}/{name}/resolve/{rev}/" + "".join(p + "/" for p in path)


@dataclass
class _Download:
    done: threading.Event = field(default_factory=threading.Event)
    error: TokensError | None = None


class RemoteTokens:
    """A remote prepared folder: its manifest, a cache folder holding the verified shards fetched
    so far, and train shards fetched on demand (one thread per shard under way)."""

    def __init__(self, base: str, folder: Path, manifest: TokenManifest, timeout: float = TIMEOUT_S) -> None:
        self.base, self.folder, self.manifest, self.timeout = base, folder, manifest, timeout
        self._lock = threading.Lock()
        self._downloads: dict[str, _Download] = {}

    @classmethod
    def open(cls, spec: str, cache: Path | None = None, *, timeout: float = TIMEOUT_S) -> RemoteTokens:
        """The manifest and the eval split, verified into the cache; TokensError (one line) when
        they cannot be fetched or do not verify. Train shards come later, as claimed."""
        base = remote_url(spec)
        raw = _get(base + MANIFEST, MAX_MANIFEST_BYTES, timeout)
        manifest = parse_manifest(raw)
        name = hashlib.sha256(base.encode()).hexdigest()[:16]
        folder = (cache if cache is not None else DEFAULT_CACHE) / f"url-{name}-{manifest.sha256[:16]}"
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / MANIFEST).is_file():  # what the cache folder holds shards of (its name has the digest)
            write_atomic(folder / MANIFEST, raw)
        remote = cls(base, folder, manifest, timeout)
        for entry in manifest.eval:
            remote._fetch(entry)
        return remote

    def eval_split(self) -> list[np.memmap]:
        return [self._memmap(entry) for entry in self.manifest.eval]

    def prefetch(self, shard: int) -> None:
        """Start fetching train shard `shard` in a thread (nothing when it is fetched or under way)."""
        entry = self.manifest.train[shard]
        with self._lock:
            if entry.name in self._downloads:
                return
            download = self._downloads[entry.name] = _Download()
        threading.Thread(target=self._run, args=(entry, download), name=f"fetch {entry.name}", daemon=True).start()

    def get(self, shard: int) -> np.memmap:
        """Train shard `shard`, fetched and verified (waits for a download under way); TokensError
        when it cannot be. The wait is bounded by the download's own deadlines."""
        entry = self.manifest.train[shard]
        self.prefetch(shard)
        download = self._downloads[entry.name]
        if not download.done.wait(TRIES * (self._deadline(entry) + self.timeout)):
            raise TokensError(f"shard {entry.name} from {self.base}: its download did not end in time")
        if download.error is not None:
            raise download.error
        return self._memmap(entry)

    def _run(self, entry: ShardEntry, download: _Download) -> None:
        try:
            self._fetch(entry)
        except TokensError as e:
            download.error = e
        except Exception as e:  # a disk that is full, a bug: the reader must hear of it, not wait
            download.error = TokensError(f"shard {entry.name}: {type(e).__name__}: {e}")
        finally:
            download.done.set()

    def _fetch(self, entry: ShardEntry) -> None:
        path, nbytes = self.folder / entry.name, self._nbytes(entry)
        if path.is_file() and path.stat().st_size == nbytes and file_sha256(path) == entry.sha256:
            return
        problem = ""
        for _ in range(TRIES):
            problem = _download(self.base + entry.name, path, entry.sha256, nbytes, self.timeout, self._deadline(entry))
            if not problem:
                return
        raise TokensError(f"shard {entry.name} from {self.base}: {problem} (downloaded {TRIES} times): refused")

    def _nbytes(self, entry: ShardEntry) -> int:
        return entry.tokens * DTYPES[self.manifest.dtype].itemsize

    def _deadline(self, entry: ShardEntry) -> float:
        return 60.0 + self._nbytes(entry) / MIN_BYTES_PER_S

    def _memmap(self, entry: ShardEntry) -> np.memmap:
        dtype = DTYPES[self.manifest.dtype]
        return np.memmap(self.folder / entry.name, dtype=dtype, mode="r", shape=(entry.tokens,))


def _download(url: str, path: Path, sha256: str, nbytes: int, timeout: float, deadline: float) -> str:
    """Stream url to path, checking size and hash on the way; '' when whole, else what went wrong."""
    digest, size, ends = hashlib.sha256(), 0, time.monotonic() + deadline
    try:
        with atomic_path(path) as temp:  # renamed onto `path` only when nothing below raised
            with _OPENER.open(_request(url), timeout=timeout) as reply, open(temp, "wb") as f:
                while chunk := reply.read(READ_BYTES):
                    size += len(chunk)
                    if size > nbytes:
                        raise _NotTheFile(f"more than the {nbytes} bytes its token count says")
                    if time.monotonic() > ends:
                        raise _NotTheFile(f"slower than {MIN_BYTES_PER_S >> 10} KiB/s")
                    digest.update(chunk)
                    f.write(chunk)
            if size != nbytes:
                raise _NotTheFile(f"{size} bytes, not the {nbytes} its token count says")
            if digest.hexdigest() != sha256:
                raise _NotTheFile("its SHA-256 does not match the manifest")
        return ""
    except _NotTheFile as e:
        return str(e)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:  # refused, reset, cut short
        return f"the download failed: {getattr(e, 'reason', None) or e}"


class _NotTheFile(Exception):
    """A download that is not the file the manifest names (why, in the message): it is dropped."""


class _TokenStaysOnItsHost(urllib.request.HTTPRedirectHandler):
    """The hub answers a resolve URL with a redirect to its file store: the token stays behind."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


_OPENER = urllib.request.build_opener(_TokenStaysOnItsHost)


def _request(url: str) -> urllib.request.Request:
    token = os.environ.get("HF_TOKEN")
    hub = os.environ.get("HF_ENDPOINT", HF_DEFAULT_ENDPOINT).rstrip("/") + "/"
    # the token is the hub's: it goes to the hub only, never to another --data URL
    headers = {"Authorization": f"Bearer {token}"} if token and url.startswith(hub) else {}
    return urllib.request.Request(url, headers=headers)


def _get(url: str, limit: int, timeout: float) -> bytes:
    try:
        with _OPENER.open(_request(url), timeout=timeout) as reply:
            data = reply.read(limit + 1)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        raise TokensError(f"cannot fetch {url}: {getattr(e, 'reason', None) or e}") from None
    if len(data) > limit:
        raise TokensError(f"{url} is larger than {limit} bytes")
    return data
