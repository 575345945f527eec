"""`--data https://...` (swarm/model/remote_tokens.py): a prepared folder served by a real HTTP
server on 127.0.0.1 is fetched into the cache and verified; a corrupted shard is refused after
a second download and never lands in the cache; a server that dies mid-download once is
recovered from by the second download, and one that always dies is one clear error."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarm.cli.common import CliError
from swarm.cli.node_data import open_prepared
from swarm.model.data import load_data
from swarm.model.prepare import PrepareConfig, load_tokenizer, prepare
from swarm.model.remote_tokens import fetch_prepared
from swarm.model.tokens import TokensError, read_manifest, verify
from swarm.node.config import NodeConfig
from tests.model.token_corpus import train_tokenizer, write_corpus

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[hf]')")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("served")
    paths, docs = write_corpus(root / "text", seed=3, rows=300)
    tok = load_tokenizer(str(train_tokenizer(docs, root / "tok.json")))
    prepare(paths, tok, root / "data", PrepareConfig(shard_tokens=2000, eval_every=5, eval_tokens=1500))
    return root / "data"


class Faults:
    corrupt: str | None = None  # a shard served with one byte flipped
    cut: str | None = None  # a shard whose connection closes halfway
    cut_times = 0  # how many times it is cut (then served whole)


@contextlib.contextmanager
def serve(root: Path, faults: Faults) -> Iterator[str]:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            name = self.path.rsplit("/", 1)[-1]
            if name not in (faults.corrupt, faults.cut):
                return super().do_GET()
            body = bytearray(Path(self.translate_path(self.path)).read_bytes())
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if name == faults.cut and faults.cut_times > 0:
                faults.cut_times -= 1
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return None
            if name == faults.corrupt:
                body[len(body) // 2] ^= 0xFF
            self.wfile.write(body)
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/data/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.timeout(60)
def test_a_served_folder_is_fetched_verified_and_trained_as_the_local_one(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWARM_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("swarm.model.remote_tokens.DEFAULT_CACHE", tmp_path / "cache")
    with serve(folder.parent, Faults()) as url:
        local = read_manifest(folder)
        fetched = fetch_prepared(url, tmp_path / "cache")
        assert read_manifest(fetched).sha256 == local.sha256
        verify(fetched, read_manifest(fetched))
        assert load_data(url).name == load_data(str(folder)).name  # one dataset, one run setting
        config, data = open_prepared(NodeConfig(data=url, seq_len=32))
        assert data is not None and config.data == f"tokens:{local.sha256}"


@pytest.mark.timeout(60)
def test_a_corrupted_shard_is_refused_after_a_second_download_and_never_cached(folder: Path, tmp_path: Path) -> None:
    faults = Faults()
    faults.corrupt = "train-00001.bin"
    with serve(folder.parent, faults) as url:
        with pytest.raises(TokensError, match=r"shard train-00001.bin .*SHA-256 does not match .*2 times\): refused"):
            fetch_prepared(url, tmp_path / "cache")
        with pytest.raises(CliError, match="refused"):  # swarm-node's way in: one line, exit 2
            _open_with_cache(url, tmp_path / "cache2")
    (cached,) = (tmp_path / "cache").glob("url-*")
    assert not (cached / "train-00001.bin").exists() and not (cached / "manifest.json").exists()
    assert not list(cached.glob(".*tmp*"))  # no partial download left behind


def _open_with_cache(url: str, cache: Path) -> None:
    import swarm.model.remote_tokens as remote

    old, remote.DEFAULT_CACHE = remote.DEFAULT_CACHE, cache
    try:
        open_prepared(NodeConfig(data=url, seq_len=32))
    finally:
        remote.DEFAULT_CACHE = old


@pytest.mark.timeout(60)
def test_a_server_that_dies_mid_download_once_is_recovered_from_and_always_is_one_error(
    folder: Path, tmp_path: Path
) -> None:
    faults = Faults()
    faults.cut, faults.cut_times = "train-00000.bin", 1
    with serve(folder.parent, faults) as url:
        fetched = fetch_prepared(url, tmp_path / "cache")
        verify(fetched, read_manifest(fetched))
        faults.cut_times = 99
        cut_short = r"shard train-00000.bin .*(2000 bytes, not the 4000|the download failed).*refused"
        with pytest.raises(TokensError, match=cut_short):
            fetch_prepared(url, tmp_path / "other-cache")
    with pytest.raises(TokensError, match="cannot fetch"):  # the server is gone
        fetch_prepared(url, tmp_path / "third-cache", timeout=2)
