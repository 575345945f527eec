"""`--data hf:<dataset>` (swarm/model/hf_source.py): a dataset saved by `datasets` on local disk
(no network) is prepared once into the cache by prepare's code and read as a prepared folder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from swarm.model import hf_source
from swarm.model.data import ShardedTokens, load_data
from swarm.model.hf_source import HFDataError, HFSource, prepare_hf
from swarm.model.tokens import open_split, read_manifest
from tests.model.token_corpus import train_tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs the datasets package")


def test_a_saved_dataset_is_prepared_into_the_cache_once_and_trained_as_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets
    import tokenizers

    docs = [f"row {i}: the swarm reads this dataset without a list of tokens" for i in range(300)]
    datasets.Dataset.from_dict({"text": docs, "n": list(range(300))}).save_to_disk(str(tmp_path / "ds"))
    tok = train_tokenizer(docs, tmp_path / "tok.json", vocab_size=300)
    monkeypatch.setattr(hf_source, "DEFAULT_CACHE", tmp_path / "cache")
    data = load_data(f"hf:{tmp_path / 'ds'}", tokenizer=str(tok))
    assert data.name.startswith("tokens:") and isinstance(data.train, ShardedTokens)
    (folder,) = (tmp_path / "cache").glob("hf-*/prepared")
    manifest = read_manifest(folder)
    # the shards' tokens are the documents' encodings, each followed by the end-of-text id
    encoder = tokenizers.Tokenizer.from_file(str(tok))
    expected = sum(len(encoder.encode(d, add_special_tokens=False).ids) + 1 for d in docs)
    assert manifest.tokens("train") + manifest.tokens("eval") == expected
    first = np.concatenate(open_split(folder, manifest, "train"))[: len(encoder.encode(docs[1]).ids)]
    assert first.tolist() == encoder.encode(docs[1], add_special_tokens=False).ids  # doc 0 is held out
    # a second start finds the cache: the same tokens, nothing prepared again
    mtime = (folder / "manifest.json").stat().st_mtime_ns
    assert load_data(f"hf:{tmp_path / 'ds'}", tokenizer=str(tok)).name == data.name
    assert (folder / "manifest.json").stat().st_mtime_ns == mtime


def test_a_row_without_the_text_field_is_one_clear_error(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"body": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
    tok = train_tokenizer(["a b c"] * 20, tmp_path / "tok.json", vocab_size=270)
    with pytest.raises(HFDataError, match="row 0 has no text field 'text'"):
        prepare_hf(HFSource(dataset=str(tmp_path / "ds")), str(tok), cache=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("hf-*/source/text.jsonl"))  # no half export left behind
