"""`--data https://...` and `--data hf-prepared:ORG/NAME` (swarm/model/remote_tokens.py): a
prepared folder served by a real HTTP server on 127.0.0.1 (as a plain folder, and in the layout of
the Hugging Face hub's resolve URLs) gives the node its manifest and eval split at once and each
train shard only when a chunk in it is claimed, verified; a corrupted shard is refused after a
second download and never lands in the cache; a server that dies mid-download once is recovered
from by the second download, and one that always dies is one clear error."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from swarm.cli.common import CliError
from swarm.cli.node_data import open_prepared
from swarm.data.cursor import cursor_for
from swarm.model.data import DataUnavailableError, load_data, prepared_corpus, remote_corpus
from swarm.model.prepare import PrepareConfig, load_tokenizer, prepare
from swarm.model.remote_tokens import RemoteTokens, remote_url
from swarm.model.tokens import TokensError, read_manifest
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
    def __init__(self) -> None:
        self.asked: list[str] = []  # the paths asked for, in order

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
            faults.asked.append(self.path)
            if self.headers.get("Authorization") not in (None, "Bearer hf_test"):
                self.send_error(401)
                return None
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


def _shards_asked(faults: Faults) -> list[str]:
    return [p.rsplit("/", 1)[-1] for p in faults.asked if p.endswith(".bin")]


@pytest.mark.timeout(60)
def test_a_served_folder_gives_eval_now_and_each_train_shard_as_its_chunk_is_claimed(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("swarm.model.remote_tokens.DEFAULT_CACHE", tmp_path / "cache")
    local, faults = prepared_corpus(folder), Faults()
    with serve(folder.parent, faults) as url:
        data = remote_corpus(url)
        assert data.name == local.name and data.fingerprint == local.fingerprint  # one dataset, one run setting
        assert data.eval.tolist() == local.eval.tolist()
        assert all(name.startswith("eval-") for name in _shards_asked(faults))  # no train shard yet
        cursor = cursor_for(data.train, seq_len=32, name=data.name)
        assert cursor is not None and cursor.plan.n == len(read_manifest(folder).train)
        chunk = cursor.plan.n - 1  # a chunk of the last shard: the node won its claim
        cursor.offer(0, chunk, 0.0)
        inputs, _ = cursor.next_batch(4, timeout=30)
        start = cursor.plan.starts[chunk]
        assert inputs[0].tolist() == local.train.windows(torch.tensor([start]), 32)[0].tolist()
        train_asked = [n for n in _shards_asked(faults) if n.startswith("train-")]
        assert train_asked == [f"train-{cursor.plan.shards[chunk]:05d}.bin"]  # that shard only, once
        config, opened = open_prepared(NodeConfig(data=url, seq_len=32))  # swarm-node's way in
        assert opened is not None and config.data == local.name
        assert load_data(url).name == local.name


@pytest.mark.timeout(60)
def test_a_hugging_face_repo_of_prepared_shards_is_read_through_the_hubs_resolve_urls(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "hub"
    repo = root / "datasets" / "org" / "corpus" / "resolve" / "v1" / "prepared"
    repo.parent.mkdir(parents=True)
    repo.symlink_to(folder, target_is_directory=True)
    faults = Faults()
    with serve(root, faults) as url:
        endpoint = url.removesuffix("/data/")
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_TOKEN", "hf_test")  # the server refuses any other bearer token
        assert (
            remote_url("hf-prepared:org/corpus/prepared@v1") == f"{endpoint}/datasets/org/corpus/resolve/v1/prepared/"
        )
        assert remote_url("hf-prepared:org/corpus").endswith("/datasets/org/corpus/resolve/main/")
        assert remote_url("hf-prepared:org/corpus@refs/pr/1").endswith("/resolve/refs%2Fpr%2F1/")
        remote = RemoteTokens.open("hf-prepared:org/corpus/prepared@v1", tmp_path / "cache")
        assert remote.manifest.sha256 == read_manifest(folder).sha256
        shard = remote.get(1)
        assert shard.tolist() == prepared_corpus(folder).train.shards[1].tolist()  # type: ignore[union-attr]
        assert _shards_asked(faults)[-1] == "train-00001.bin"
        with pytest.raises(DataUnavailableError, match=r"cannot fetch .*resolve/main/prepared/manifest.json"):
            remote_corpus("hf-prepared:org/corpus/prepared", tmp_path / "cache")  # no such revision
    for bad in ("hf-prepared:corpus", "hf-prepared:org/../x", "hf-prepared:/x"):
        with pytest.raises(TokensError, match="expected hf-prepared:ORG/NAME"):
            remote_url(bad)


@pytest.mark.timeout(60)
def test_a_corrupted_shard_is_refused_after_a_second_download_and_never_cached(folder: Path, tmp_path: Path) -> None:
    faults = Faults()
    faults.corrupt = "train-00001.bin"
    with serve(folder.parent, faults) as url:
        remote = RemoteTokens.open(url, tmp_path / "cache")
        remote.get(0)  # a good shard
        with pytest.raises(TokensError, match=r"shard train-00001.bin .*SHA-256 does not match .*2 times\): refused"):
            remote.get(1)
        assert _shards_asked(faults).count("train-00001.bin") == 2
        data = remote_corpus(url, tmp_path / "cache2")
        cursor = cursor_for(data.train, seq_len=32, name=data.name)
        assert cursor is not None
        cursor.offer(0, cursor.plan.shards.index(1), 0.0)  # a chunk of the bad shard: nothing trained on it
        with pytest.raises(TokensError, match=r"train-00001.bin .*refused"):
            cursor.next_batch(1, timeout=30)
    cached = remote.folder
    assert not (cached / "train-00001.bin").exists() and (cached / "train-00000.bin").exists()
    assert not list(cached.glob(".*tmp*"))  # no partial download left behind


@pytest.mark.timeout(60)
def test_a_server_that_dies_mid_download_once_is_recovered_from_and_always_is_one_error(
    folder: Path, tmp_path: Path
) -> None:
    faults = Faults()
    faults.cut, faults.cut_times = "train-00000.bin", 1
    with serve(folder.parent, faults) as url:
        remote = RemoteTokens.open(url, tmp_path / "cache")
        assert remote.get(0).tolist() == prepared_corpus(folder).train.shards[0].tolist()  # type: ignore[union-attr]
        faults.cut_times = 99
        cut_short = r"shard train-00000.bin .*(2000 bytes, not the 4000|the download failed).*refused"
        with pytest.raises(TokensError, match=cut_short):
            RemoteTokens.open(url, tmp_path / "other-cache").get(0)
    with pytest.raises(CliError, match="cannot fetch"):  # the server is gone: swarm-node's one line
        open_prepared(NodeConfig(data=url, seq_len=32))
