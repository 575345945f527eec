"""What an offline wandb run wrote (WANDB_MODE=offline): its run record and its logged history,
read from the run's `.wandb` file (a LevelDB-style log of protobuf records, wandb's own format)."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024  # the log's block size: a record's header never straddles one
HEADER = 7  # ":W&B", a 2-byte magic and a version byte
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    project: str = ""
    group: str = ""
    name: str = ""
    run_id: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one dict per log, with "_step"
    finished: bool = False  # its exit record is written


def offline_runs(wandb_dir: Path, wait: float = 30.0) -> list[OfflineRun]:
    """Every offline run under WANDB_DIR, in the order of their folders' names, once each holds
    its exit record: wandb's service process writes the file, and under load it may still be
    flushing it when the run's finish() has returned (at most `wait` seconds). A record caught
    half-written then fails to parse; that read counts as unfinished until the wait is over."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + wait
    while True:
        try:
            runs = [read_run(path) for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))]
        except DecodeError:
            if time.monotonic() > deadline:
                raise
            runs = [OfflineRun()]
        if all(run.finished for run in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def read_run(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun()
    for data in _records(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.project, run.group, run.name, run.run_id = r.project, r.run_group, r.display_name, r.run_id
            run.config.update({item.key: json.loads(item.value_json) for item in r.config.update})
        elif kind == "exit":
            run.finished = True
        elif kind == "history":
            run.history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})  # fmt: skip
    return run


def _records(raw: bytes) -> list[bytes]:
    assert raw[:4] == b":W&B", "not a wandb run file"
    out, pos, pending = [], HEADER, b""
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if pos + 7 + length > len(raw):  # the writer is still writing this record
            break
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == FULL:
            out.append(data)
        elif kind == FIRST:
            pending = data
        elif kind == MIDDLE:
            pending += data
        elif kind == LAST:
            out.append(pending + data)
    return out
