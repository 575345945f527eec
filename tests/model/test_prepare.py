"""swarm-data prepare / info (swarm/model/prepare.py, tokens.py, sources.py): token shards equal
a direct encoding, a killed prepare resumes to the same shards, and every damaged or
inconsistent input is one clear error. The data and the tokenizer (a small BPE) are made here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from swarm.cli.data import main as data_main
from swarm.model.prepare import LoadedTokenizer, PrepareConfig, load_tokenizer, prepare
from swarm.model.tokens import TokensError, open_split, read_manifest, verify
from tests.model.token_corpus import train_tokenizer, write_corpus

tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[hf]')")

SHARD = 1000
CONFIG = PrepareConfig(shard_tokens=SHARD, eval_every=7, eval_tokens=800, batch_documents=16)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[str], Path]:
    """Input paths, their documents in prepare's order, and a tokenizer.json trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    paths, docs = write_corpus(root)
    return paths, docs, train_tokenizer(docs, root / "tokenizer.json")


def _expected(docs: list[str], tok_path: Path, config: PrepareConfig) -> tuple[np.ndarray, np.ndarray]:
    """The train and eval streams by a direct encoding, document by document."""
    tok = tokenizers.Tokenizer.from_file(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    train, held, held_tokens = [], [], 0
    for i, text in enumerate(docs):
        ids = [*tok.encode(text, add_special_tokens=False).ids, eos]
        if i % config.eval_every == 0 and held_tokens < config.eval_tokens:
            held.append(ids)
            held_tokens += len(ids)
        else:
            train.append(ids)
    return np.concatenate(train), np.concatenate(held)


def _stream(folder: Path, split: str) -> np.ndarray:
    manifest = read_manifest(folder)
    return np.concatenate([np.asarray(m) for m in open_split(folder, manifest, split)])


def _shard_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def prepared(corpus: tuple[list[Path], list[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    paths, _, tok_path = corpus
    out = tmp_path_factory.mktemp("prepared") / "data"
    result = prepare(paths, load_tokenizer(str(tok_path)), out, CONFIG)
    assert result.resumed_shards == 0 and result.tokens > 10 * SHARD
    return out


def test_the_shards_hold_a_direct_encoding_of_the_documents(
    corpus: tuple[list[Path], list[str], Path], prepared: Path
) -> None:
    _, docs, tok_path = corpus
    train, held = _expected(docs, tok_path, CONFIG)
    manifest = read_manifest(prepared)
    verify(prepared, manifest)
    assert manifest.dtype == "uint16" and manifest.tokenizer.eos_id == 0 and manifest.tokenizer.name == "tokenizer.json"
    assert np.array_equal(_stream(prepared, "train"), train) and np.array_equal(_stream(prepared, "eval"), held)
    assert all(e.tokens == SHARD for e in manifest.train[:-1]) and len(manifest.train) == -(-len(train) // SHARD)
    assert manifest.documents == {"train": len(docs) - manifest.documents["eval"], "eval": manifest.documents["eval"]}
    assert 800 <= manifest.tokens("eval") < 800 + 200 and manifest.documents["eval"] < len(docs) // 7
    raw = (prepared / manifest.train[0].name).read_bytes()  # raw little-endian uint16, nothing else
    assert np.array_equal(np.frombuffer(raw, dtype="<u2"), train[:SHARD])
    assert sorted(p.name for p in prepared.iterdir() if not p.name.startswith(("train-", "eval-"))) == ["manifest.json"]


class Killed(BaseException):
    """A kill at the worst moment: the shard is on disk, the progress does not record it yet."""


@pytest.mark.parametrize("kills", [[1], [4, 9], [0, 1, 2]], ids=["once", "twice", "every-shard"])
def test_a_killed_prepare_resumes_to_the_same_shards(
    corpus: tuple[list[Path], list[str], Path], prepared: Path, tmp_path: Path, kills: list[int]
) -> None:
    paths, _, tok_path = corpus
    tok = load_tokenizer(str(tok_path))
    out = tmp_path / "data"
    for kill in kills:
        with pytest.raises(Killed):
            prepare(paths, tok, out, CONFIG, on_shard=lambda shard, at=kill: _die_at(shard, at))
        assert (out / "progress.json").exists() and not (out / "manifest.json").exists()
    (out / ".train-00099.bin.tmp-4242").write_bytes(b"half")  # a writer killed mid-file
    result = prepare(paths, tok, out, CONFIG)
    assert result.resumed_shards == max(kills)  # from the last shard the progress recorded
    assert _shard_bytes(out) == _shard_bytes(prepared)
    assert read_manifest(out).sha256 == read_manifest(prepared).sha256


def test_a_resume_with_other_inputs_or_settings_is_refused(
    corpus: tuple[list[Path], list[str], Path], tmp_path: Path
) -> None:
    paths, _, tok_path = corpus
    tok = load_tokenizer(str(tok_path))
    out = tmp_path / "data"
    with pytest.raises(Killed):
        prepare(paths, tok, out, CONFIG, on_shard=lambda shard: _die_at(shard, 3))
    with pytest.raises(TokensError, match="other inputs, tokenizer or settings"):
        prepare(paths, tok, out, dataclasses.replace(CONFIG, eval_every=5))
    with pytest.raises(TokensError, match="other inputs"):
        prepare(paths[:1], tok, out, CONFIG)
    prepare(paths, tok, out, dataclasses.replace(CONFIG, force=True))  # --force starts over
    with pytest.raises(TokensError, match="already holds a prepared dataset"):
        prepare(paths, tok, out, CONFIG)


def test_a_vocabulary_past_uint16_is_stored_as_uint32(
    corpus: tuple[list[Path], list[str], Path], prepared: Path, tmp_path: Path
) -> None:
    paths, _, tok_path = corpus
    tok = load_tokenizer(str(tok_path))
    wide = LoadedTokenizer(tok.tokenizer, dataclasses.replace(tok.info, vocab_size=70_000))
    prepare(paths, wide, tmp_path / "wide", CONFIG)
    manifest = read_manifest(tmp_path / "wide")
    assert manifest.dtype == "uint32" and (tmp_path / "wide" / "train-00000.bin").stat().st_size == 4 * SHARD
    assert np.array_equal(_stream(tmp_path / "wide", "train"), _stream(prepared, "train"))


def _one_line_exit_2(args: list[str]) -> str:
    result = CliRunner().invoke(data_main, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    return result.output


def _copy(folder: Path, to: Path) -> Path:
    to.mkdir()
    for path in folder.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    return to


def test_info_prints_the_manifest_and_checks_the_shards(prepared: Path) -> None:
    result = CliRunner().invoke(data_main, ["info", str(prepared)])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(prepared)
    assert manifest.sha256 in result.output and "train-00000.bin" in result.output and "eval-00000.bin" in result.output
    as_json = CliRunner().invoke(data_main, ["info", str(prepared), "--json"])
    assert json.loads(as_json.output)["digest"] == manifest.sha256


def test_damaged_or_inconsistent_datasets_are_one_clear_error(prepared: Path, tmp_path: Path) -> None:
    flipped = _copy(prepared, tmp_path / "flipped")
    data = bytearray((flipped / "train-00002.bin").read_bytes())
    data[100] ^= 0x40
    (flipped / "train-00002.bin").write_bytes(bytes(data))
    assert "train-00002.bin: its SHA-256 does not match" in _one_line_exit_2(["info", str(flipped)])
    assert CliRunner().invoke(data_main, ["info", str(flipped), "--no-verify"]).exit_code == 0

    truncated = _copy(prepared, tmp_path / "truncated")
    (truncated / "train-00001.bin").write_bytes((truncated / "train-00001.bin").read_bytes()[:-2])
    assert "truncated" in _one_line_exit_2(["info", str(truncated), "--no-verify"])

    lying = _copy(prepared, tmp_path / "lying")  # a count changed with its total: the shard's size disagrees
    body = json.loads((lying / "manifest.json").read_text())
    body["train"][-1]["tokens"] += 5
    body["totals"]["train"] += 5
    (lying / "manifest.json").write_text(json.dumps(body))
    assert "the manifest says" in _one_line_exit_2(["info", str(lying)])
    body["totals"]["train"] += 1  # a total that its shards do not add up to
    (lying / "manifest.json").write_text(json.dumps(body))
    assert "total says" in _one_line_exit_2(["info", str(lying)])
    body["train"][0]["tokens"] -= 1  # a shard short of shard_tokens that is not the last
    (lying / "manifest.json").write_text(json.dumps(body))
    assert "train-00000.bin holds 999 tokens" in _one_line_exit_2(["info", str(lying)])

    assert "is not a folder" in _one_line_exit_2(["info", str(tmp_path / "nowhere")])
    assert "has no manifest.json" in _one_line_exit_2(["info", str(tmp_path)])
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "manifest.json").write_text("{not json")
    assert "not JSON" in _one_line_exit_2(["info", str(tmp_path / "garbage")])


def test_bad_prepare_inputs_are_one_clear_error(corpus: tuple[list[Path], list[str], Path], tmp_path: Path) -> None:
    paths, _, tok_path = corpus
    tok, out = str(tok_path), str(tmp_path / "o")
    line = _one_line_exit_2(["prepare", str(tmp_path / "missing.txt"), "--tokenizer", tok, "--out", out])
    assert "no such file or folder" in line
    line = _one_line_exit_2(["prepare", str(paths[1]), "--tokenizer", str(tmp_path / "t.json"), "--out",
                             str(tmp_path / "o")])  # fmt: skip
    assert "no such tokenizer file" in line
    with pytest.MonkeyPatch.context() as env:  # a Hugging Face id, never a missing file; offline here
        env.setenv("HF_HUB_OFFLINE", "1")
        with pytest.raises(TokensError, match="tokenizer") as refused:
            load_tokenizer("swarm-test-org/no-such-tokenizer")
        assert "no such tokenizer file" not in str(refused.value)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    line = _one_line_exit_2(["prepare", str(tmp_path / "bad.jsonl"), "--tokenizer", tok, "--out", str(tmp_path / "o")])
    assert "bad.jsonl:2: no string field 'text'" in line
    (tmp_path / "notes.md").write_text("# hi")
    line = _one_line_exit_2(["prepare", str(tmp_path / "notes.md"), "--tokenizer", tok, "--out", str(tmp_path / "o")])
    assert "not a .txt, .jsonl, .parquet file" in line
    line = _one_line_exit_2(["prepare", str(paths[1]), "--tokenizer", tok, "--eos-token", "<nope>", "--out",
                             str(tmp_path / "o")])  # fmt: skip
    assert "no token '<nope>'" in line
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("keep")
    line = _one_line_exit_2(["prepare", str(paths[1]), "--tokenizer", tok, "--out", str(tmp_path / "busy")])
    assert "is not empty" in line


def test_the_cli_prepares_and_reports_its_speed(corpus: tuple[list[Path], list[str], Path], tmp_path: Path) -> None:
    paths, _, tok_path = corpus
    args = ["prepare", *map(str, paths), "--tokenizer", str(tok_path), "--out", str(tmp_path / "d"),
            "--shard-tokens", str(SHARD), "--eval-every", "7", "--eval-tokens", "800"]  # fmt: skip
    result = CliRunner().invoke(data_main, args)
    assert result.exit_code == 0, result.output
    assert "tokens/s" in result.output and read_manifest(tmp_path / "d").sha256[:16] in result.output


def test_parquet_rows_are_documents(corpus: tuple[list[Path], list[str], Path], tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed: .parquet inputs are optional")
    import pyarrow.parquet as pq

    _, docs, tok_path = corpus
    pq.write_table(pa.table({"text": docs[3:], "n": list(range(len(docs) - 3))}), tmp_path / "rows.parquet",
                   row_group_size=50)  # fmt: skip
    config = dataclasses.replace(CONFIG, eval_every=1000)
    inputs, tok = [tmp_path / "rows.parquet", tmp_path / "rows.parquet"], load_tokenizer(str(tok_path))
    prepare(inputs[:1], tok, tmp_path / "d", config)
    train, _ = _expected(docs[3:], tok_path, config)
    assert np.array_equal(_stream(tmp_path / "d", "train"), train)
    (tmp_path / "again.parquet").write_bytes((tmp_path / "rows.parquet").read_bytes())
    inputs = [tmp_path / "rows.parquet", tmp_path / "again.parquet"]
    prepare(inputs, tok, tmp_path / "whole", config)
    for kill in (3, 15):  # then in the second file (of 22 shards): the first is skipped whole, then rows
        with pytest.raises(Killed):
            prepare(inputs, tok, tmp_path / "resumed", config, on_shard=lambda i, at=kill: _die_at(i, at))
    prepare(inputs, tok, tmp_path / "resumed", config)
    assert _shard_bytes(tmp_path / "resumed") == _shard_bytes(tmp_path / "whole")


def _die_at(shard: int, at: int) -> None:
    if shard == at:
        raise Killed
