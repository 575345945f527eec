"""The documents of local text files, in a fixed order, for `swarm-data prepare` (prepare.py).

    sources = find_sources([Path("corpus/"), Path("extra.jsonl")])   # sorted; TokensError if none
    for text in documents(sources, text_field="text", start=0): ...

- `.txt`: the whole file is one document (UTF-8; an invalid byte becomes U+FFFD);
- `.jsonl`: every line that is not blank is one JSON object, its `text_field` the document;
- `.parquet` (when pyarrow is installed): the `text_field` column, one row a document.

A folder is searched recursively for those suffixes, in sorted order; a file named on the command
line must have one of them. `start` skips documents without tokenizing them (and .txt files
without reading them): a resumed prepare continues where it stopped.

Every document is bounded (`max_document_bytes`), so a corrupt line or a huge file cannot take
all the memory; such an input is an error naming the file and line, not a document skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from swarm.model.tokens import TokensError

SUFFIXES = (".txt", ".jsonl", ".parquet")
MAX_SOURCES = 1_000_000
PARQUET_BATCH = 1024


@dataclass(frozen=True, slots=True)
class Source:
    path: Path
    size: int
    mtime_ns: int  # with the size: a resumed prepare refuses inputs that changed meanwhile

    @property
    def kind(self) -> str:
        return self.path.suffix


def find_sources(paths: Sequence[Path]) -> list[Source]:
    """The input files under `paths` (files or folders), each once, in a fixed order: the paths
    in the order given, a folder's files sorted by their path. TokensError when a path is
    missing or of an unknown kind, or when no input file is found."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
            found.extend(inside)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise TokensError(f"{path}: not a {', '.join(SUFFIXES)} file")
            found.append(path)
        else:
            raise TokensError(f"{path}: no such file or folder")
        if len(found) > MAX_SOURCES:
            raise TokensError(f"more than {MAX_SOURCES} input files: join them into .jsonl files")
    if not found:
        raise TokensError(f"no {', '.join(SUFFIXES)} file in {', '.join(str(p) for p in paths)}")
    if any(p.suffix == ".parquet" for p in found) and importlib.util.find_spec("pyarrow") is None:
        raise TokensError("reading .parquet files needs pyarrow: pip install pyarrow")
    unique = list(dict.fromkeys(p.resolve() for p in found))
    sources = []
    for path in unique:
        stat = path.stat()
        sources.append(Source(path, stat.st_size, stat.st_mtime_ns))
    return sources


def documents(sources: Sequence[Source], *, text_field: str, start: int, max_document_bytes: int) -> Iterator[str]:
    """The documents of `sources` from document `start` on (counted from 0 over all of them)."""
    index = 0  # of the next document of the current source
    for source in sources:
        if source.kind == ".txt":
            if index < start:
                index += 1
                continue
            yield _read_txt(source.path, max_document_bytes)
            index += 1
        elif source.kind == ".jsonl":
            for text in _jsonl(source.path, text_field, max_document_bytes, skip=max(start - index, 0)):
                index += 1
                if text is not None:
                    yield text
        else:
            for text in _parquet(source.path, text_field, skip=max(start - index, 0)):
                index += 1
                if text is not None:
                    yield text


def _read_txt(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TokensError(f"{path} is larger than {limit} bytes, the limit of one document: split it, or write "
                          "its documents as lines of a .jsonl file")  # fmt: skip
    return data.decode("utf-8", errors="replace")


def _jsonl(path: Path, field: str, limit: int, *, skip: int) -> Iterator[str | None]:
    """One item per document: None for the first `skip` (not parsed), then the texts."""
    with open(path, "rb") as f:
        number = 0
        while line := f.readline(limit + 1):
            number += 1
            if len(line) > limit:
                raise TokensError(f"{path}:{number}: a line longer than {limit} bytes, the limit of one document")
            if not line.strip():
                continue
            if skip > 0:
                skip -= 1
                yield None
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise TokensError(f"{path}:{number}: not JSON ({e})") from None
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise TokensError(f"{path}:{number}: no string field {field!r}")
            yield text


def _parquet(path: Path, field: str, *, skip: int) -> Iterator[str | None]:
    import pyarrow.parquet as pq  # optional: checked by find_sources

    try:
        table = pq.ParquetFile(path)
        if field not in table.schema_arrow.names:
            raise TokensError(f"{path}: no column {field!r} (it has {', '.join(table.schema_arrow.names)[:200]})")
        rows = table.metadata.num_rows
        if skip >= rows:  # the whole file was prepared already: count it without reading it
            yield from (None for _ in range(rows))
            return
        for batch in table.iter_batches(batch_size=PARQUET_BATCH, columns=[field]):
            for text in batch.column(0).to_pylist():
                if skip > 0:
                    skip -= 1
                    yield None
                elif not isinstance(text, str):
                    raise TokensError(f"{path}: a row whose {field!r} is not a string")
                else:
                    yield text
    except TokensError:
        raise
    except (OSError, ValueError) as e:  # pyarrow's errors derive from these (ArrowInvalid: ValueError)
        raise TokensError(f"{path}: not a readable parquet file: {e}") from None


def listing(sources: Sequence[Source]) -> list[tuple[str, int, int]]:
    """What identifies the inputs of a prepare: (path, bytes, mtime) of each, in order."""
    return [(os.fspath(s.path), s.size, s.mtime_ns) for s in sources]
