"""`--data hf:<dataset>`: a Hugging Face dataset prepared once into a local cache, then trained on
as any prepared folder (tokens.py), never held as a Python list of tokens.

    folder = prepare_hf("org/name", "tokenizer.json", cache=Path("~/.cache/swarm/data"))
    data = prepared_corpus(folder)            # model/data.py: memmapped shards, chunk claims

The dataset is streamed (`datasets.load_dataset(..., streaming=True)`; a folder written by
`Dataset.save_to_disk` is read with `load_from_disk`) row by row into `source/text.jsonl`
(the `text_field` of each row, at most `max_documents` rows), then `swarm-data prepare`'s code
(prepare.py) tokenizes that file into shards and a manifest. The cache folder is named by a hash
of what decides the tokens (dataset, config, split, field, row cap, tokenizer), so a second node
start finds it done, and a start killed midway continues: the export is redone (it is written to
a temporary name and renamed), the prepare resumes from its last whole shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from swarm.model.prepare import PrepareConfig, load_tokenizer, prepare
from swarm.model.tokens import MANIFEST, TokensError
from swarm.utils.atomic import atomic_path

DEFAULT_CACHE = Path(os.environ.get("SWARM_DATA_CACHE", Path.home() / ".cache" / "swarm" / "data"))
MAX_DOCUMENTS = 10_000_000  # rows exported at most (a streamed dataset may be endless)
MAX_ROW_BYTES = 64 << 20


class HFDataError(TokensError):
    """A dataset that cannot be exported (missing packages, unknown dataset, missing field)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HFSource:
    dataset: str  # a hub id, or a folder written by Dataset.save_to_disk
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    max_documents: int = MAX_DOCUMENTS

    def key(self, tokenizer: str) -> str:
        fields = [self.dataset, self.config, self.split, self.text_field, self.max_documents, tokenizer]
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:16]


def prepare_hf(source: HFSource, tokenizer: str, cache: Path | None = None) -> Path:
    """The prepared folder of `source` tokenized by `tokenizer`, made under `cache` (default:
    $SWARM_DATA_CACHE or ~/.cache/swarm/data) if not there."""
    folder = (cache if cache is not None else DEFAULT_CACHE) / f"hf-{source.key(tokenizer)}"
    prepared = folder / "prepared"
    if (prepared / MANIFEST).is_file():
        return prepared
    text = folder / "source" / "text.jsonl"
    if not text.is_file():
        _export(source, text)
    prepare([text], load_tokenizer(tokenizer), prepared, PrepareConfig(text_field="text"))
    return prepared


def _export(source: HFSource, out: Path) -> None:
    rows = _rows(source)
    with atomic_path(out) as temp, open(temp, "w", encoding="utf-8") as f:
        for n, row in enumerate(rows):
            if n >= source.max_documents:
                break
            value = row.get(source.text_field) if isinstance(row, dict) else None
            if not isinstance(value, str):
                raise HFDataError(f"hf:{source.dataset}: row {n} has no text field {source.text_field!r}")
            if len(value) > MAX_ROW_BYTES:
                raise HFDataError(f"hf:{source.dataset}: row {n} is over {MAX_ROW_BYTES} characters")
            f.write(json.dumps({"text": value}, ensure_ascii=False) + "\n")


def _rows(source: HFSource) -> object:
    try:
        import datasets  # the `hf` extra's; imported only here
    except ImportError:
        raise HFDataError(f"--data hf:{source.dataset} needs the datasets package: pip install datasets") from None
    local = Path(source.dataset)
    try:
        if local.is_dir() and (local / "dataset_info.json").is_file():  # Dataset.save_to_disk
            loaded = datasets.load_from_disk(str(local))
            return loaded[source.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        return datasets.load_dataset(source.dataset, source.config, split=source.split, streaming=True)
    except Exception as e:  # hub unreachable, unknown dataset or split: all the same to a user
        raise HFDataError(f"cannot load dataset {source.dataset!r}: {type(e).__name__}: {e}") from None
