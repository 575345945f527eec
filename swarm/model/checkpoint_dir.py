"""Local checkpoints of the swarm state (`--checkpoint-dir`): whole step directories, written
atomically, the newest two kept, loaded with every shard verified.

    snapshot = make_snapshot(diloco.state_dict(), RunInfo(...))   # copies θ_outer + momentum
    CheckpointDir(path).write(snapshot)                           # atomic; keeps the last two
    manifest, state = CheckpointDir(path).load_latest(expect=run_info)

On disk:
    step-00000012/manifest.json, shard-00000.safetensors, ...
    LATEST                                   the name of the newest whole step directory
A write goes to `step-<N>.tmp-<pid>`, every file is fsynced, the directory is renamed into
place and fsynced, then LATEST is replaced the same way; older steps beyond `keep` are
removed, and so are steps after the one written (a lineage the node left).
A node killed at any instant leaves LATEST naming a whole checkpoint (or nothing yet); loading
verifies every shard's hash and falls back to the older step when the newest is damaged.

The manifest and the shards are the state's format (checkpoint.py), the same on disk and on the wire.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from swarm.model.checkpoint import (
    CheckpointError,
    IncompatibleState,
    Manifest,
    RunInfo,
    Snapshot,
    parse_manifest,
    read_file,
    state_from_shards,
    verify_shard,
)
from swarm.utils.atomic import fsync_path, write_atomic

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
LOCAL_FILE = "local.safetensors"  # a node's own tensors beside a checkpoint's shards (never served)
LINEAGE_FILE = "lineage.msgpack"  # the receipts of the rounds that made the state (swarm/state/lineage_book.py)


class CheckpointDir:
    """Local checkpoints: written atomically, the last `keep` kept (see the module docstring).
    Call write/load from a worker thread: they do disk I/O and hashing."""

    def __init__(self, path: Path | str, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.path, self.keep = Path(path), keep

    def write(self, snapshot: Snapshot, local: Mapping[str, torch.Tensor] | None = None,
              lineage: bytes | None = None) -> Path:  # fmt: skip
        """Write the snapshot (and `local`: this node's own tensors, never served, e.g. its
        error-feedback residual, in LOCAL_FILE beside the shards; `lineage`: the receipts of the
        rounds that made the state, in LINEAGE_FILE) as one step directory."""
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / f"step-{snapshot.manifest.step:08d}"
        temp = self.path / f"{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir()
        for name, data in snapshot.shards.items():
            _write_synced(temp / name, data)
        _write_synced(temp / "manifest.json", snapshot.manifest.to_json())
        if lineage is not None:
            _write_synced(temp / LINEAGE_FILE, lineage)
        if local:
            _write_synced(temp / LOCAL_FILE, safetensors_save({k: v.contiguous() for k, v in local.items()}))
        fsync_path(temp)
        if final.exists():  # the same step written again (after a restart): replace it whole
            shutil.rmtree(final)
        os.rename(temp, final)
        fsync_path(self.path)
        write_atomic(self.path / "LATEST", final.name.encode())
        fsync_path(self.path)
        self._prune(keep_also=final.name)
        return final

    def load_latest(self, expect: RunInfo | None = None) -> tuple[Manifest, dict[str, Any]] | None:
        """The newest whole, verified checkpoint (falling back to older ones), or None when
        there is none. Raises CheckpointError when one exists but belongs to another run/model."""
        errors = []
        for directory in self._candidates():
            try:
                manifest = parse_manifest((directory / "manifest.json").read_bytes())
                if expect is not None:
                    manifest.check_usable_by(expect)
                shards = []
                for info in manifest.shards:
                    data = read_file(directory / info.name)
                    verify_shard(info, data)
                    shards.append(data)
                state = state_from_shards(manifest, shards)
                for skipped in errors:  # a newer checkpoint that could not be used: never silently
                    logger.warning("skipped the checkpoint %s; resuming from %s instead", skipped, directory.name)
                return manifest, state
            except OSError as e:
                errors.append(f"{directory.name}: {e.strerror or e}")
            except IncompatibleState as e:
                raise IncompatibleState(f"{self.path}: {e}") from None
            except CheckpointError as e:
                errors.append(f"{directory.name}: {e}")
        if errors:
            raise CheckpointError(f"no whole checkpoint in {self.path}: {'; '.join(errors)}")
        return None

    def load_lineage(self, step: int) -> bytes | None:
        """The receipts written with the checkpoint of `step` (None: none, or unreadable)."""
        path = self.path / f"step-{step:08d}" / LINEAGE_FILE
        try:
            return bytes(read_file(path)) if path.exists() else None
        except OSError as e:
            logger.warning("ignoring the unreadable %s: %s", path, e)
            return None

    def load_local(self, step: int) -> dict[str, torch.Tensor]:
        """The node's own tensors written with the checkpoint of `step` ({} when there are none
        or they cannot be read: they are an optimisation, never a reason not to resume)."""
        path = self.path / f"step-{step:08d}" / LOCAL_FILE
        try:
            return safetensors_load(bytes(read_file(path))) if path.exists() else {}
        except (OSError, SafetensorError) as e:
            logger.warning("ignoring the unreadable %s: %s", path, e)
            return {}

    def _candidates(self) -> list[Path]:
        """Step directories, the one LATEST names first, then the others newest first."""
        if not self.path.is_dir():
            return []
        steps = sorted((p for p in self.path.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()), reverse=True)
        try:
            latest = (self.path / "LATEST").read_text().strip()
        except OSError:
            latest = ""
        return sorted(steps, key=lambda p: p.name != latest)

    def _prune(self, keep_also: str) -> None:
        steps = sorted((p for p in self.path.iterdir() if _STEP_DIR.match(p.name)), reverse=True)
        # steps after the one just written are of a lineage the node left (a fork's smaller side
        # that stepped back to the larger one's state): a restart must not resume them
        left = [p for p in steps if p.name > keep_also]
        kept = [p for p in steps if p.name <= keep_also]
        for old in left + kept[self.keep :]:
            if old.name != keep_also:
                shutil.rmtree(old, ignore_errors=True)
        for temp in self.path.glob("step-*.tmp-*"):  # left by a killed writer
            if temp.name.rsplit("-", 1)[-1] != str(os.getpid()):
                shutil.rmtree(temp, ignore_errors=True)


def _write_synced(path: Path, data: bytes | bytearray | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
