"""`--data https://host/path/`: a prepared folder (tokens.py) served over HTTP, fetched into a
local cache and verified before a token of it is used.

    folder = fetch_prepared("https://example.org/data/")   # the folder's manifest.json at its root
    data = prepared_corpus(folder)                          # model/data.py: memmaps, chunk claims

The manifest comes first (at most MAX_MANIFEST_BYTES, parsed and bounded as a local one); the
cache folder is named by the URL and the manifest's digest, so a folder republished with other
tokens never mixes with the old one. Each shard is streamed to a temporary file while its
SHA-256 is computed, at most the size its token count says; a shard whose hash or size does not
match, or whose download breaks off (a server that dies, a timeout), is downloaded once more and
then refused with one line naming the shard: a bad shard is never renamed into place, so never
read. Shards already in the cache with the right size and hash are kept. manifest.json is
written last: its presence means the cache folder is whole.

Failure mode: every shard is fetched when the node starts, not as its chunks are claimed.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.request
from pathlib import Path

from swarm.model.tokens import (
    DTYPES,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    ShardEntry,
    TokensError,
    file_sha256,
    parse_manifest,
)

DEFAULT_CACHE = Path(os.environ.get("SWARM_DATA_CACHE", Path.home() / ".cache" / "swarm" / "data"))
TIMEOUT_S = 30.0  # per connection and per read: a stalled server ends the download
READ_BYTES = 1 << 20
TRIES = 2  # a shard that fails twice is refused


def is_remote(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def fetch_prepared(url: str, cache: Path | None = None, *, timeout: float = TIMEOUT_S) -> Path:
    """The local, verified copy of the prepared folder at `url`; TokensError (one line) when the
    manifest or a shard cannot be fetched or does not verify."""
    if not is_remote(url) or len(url) > 2048:
        raise TokensError(f"{url[:80]!r} is not an http(s) URL of at most 2048 characters")
    base = url if url.endswith("/") else url + "/"
    raw = _get(base + MANIFEST, MAX_MANIFEST_BYTES, timeout)
    manifest = parse_manifest(raw)
    name = hashlib.sha256(base.encode()).hexdigest()[:16]
    folder = (cache if cache is not None else DEFAULT_CACHE) / f"url-{name}-{manifest.sha256[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    itemsize = DTYPES[manifest.dtype].itemsize
    for entry in (*manifest.train, *manifest.eval):
        _fetch_shard(base, folder, entry, entry.tokens * itemsize, timeout)
    temp = folder / f".{MANIFEST}.tmp-{os.getpid()}"
    temp.write_bytes(raw)
    os.replace(temp, folder / MANIFEST)
    return folder


def _fetch_shard(base: str, folder: Path, entry: ShardEntry, nbytes: int, timeout: float) -> None:
    path = folder / entry.name
    if path.is_file() and path.stat().st_size == nbytes and file_sha256(path) == entry.sha256:
        return
    problem = ""
    for _ in range(TRIES):
        problem = _download(base + entry.name, path, entry.sha256, nbytes, timeout)
        if not problem:
            return
    raise TokensError(f"shard {entry.name} from {base}: {problem} (downloaded {TRIES} times): refused")


def _download(url: str, path: Path, sha256: str, nbytes: int, timeout: float) -> str:
    """Stream url to path, checking size and hash on the way; '' when whole, else what went wrong."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    digest, size = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply, open(temp, "wb") as f:
            while chunk := reply.read(READ_BYTES):
                size += len(chunk)
                if size > nbytes:
                    return f"more than the {nbytes} bytes its token count says"
                digest.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if size != nbytes:
            return f"{size} bytes, not the {nbytes} its token count says"
        if digest.hexdigest() != sha256:
            return "its SHA-256 does not match the manifest"
        os.replace(temp, path)
        return ""
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:  # refused, reset, cut short
        return f"the download failed: {getattr(e, 'reason', None) or e}"
    finally:
        temp.unlink(missing_ok=True)


def _get(url: str, limit: int, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            data = reply.read(limit + 1)
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        raise TokensError(f"cannot fetch {url}: {getattr(e, 'reason', None) or e}") from None
    if len(data) > limit:
        raise TokensError(f"{url} is larger than {limit} bytes")
    return data
