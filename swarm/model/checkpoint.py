"""The format of the swarm state, the same on disk and on the wire: safetensors shards plus a
JSON manifest.

    snapshot = make_snapshot(diloco.state_dict(), RunInfo(...))   # copies θ_outer + momentum
    manifest = parse_manifest(data)                               # every field checked
    state = state_from_shards(manifest, verified_shards)          # views of the shards' bytes

State = θ_outer + outer momentum + outer step (DESIGN "Words"). Tensors are named
`params/<name>` and `momentum/<name>` and packed in name order into shards of about
`shard_bytes` (64 MiB by default; a tensor is never split). The manifest lists every shard
(name, tensors, byte length, SHA-256) and the run's identity: run id, outer step, model preset
and its full config, seed, data name and H. Its own hash (`Manifest.sha256`) is the SHA-256 of
its canonical JSON; that is what nodes advertise in the DHT and what a fetch is pinned to.

Local checkpoints of this format (`--checkpoint-dir`) are checkpoint_dir.py's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from swarm.model.configs import DEFAULT_SHARD_BYTES
from swarm.model.setting_values import decode_settings, differences

FORMAT = "swarm-state/1"
MAX_MANIFEST_BYTES = 4 << 20
MAX_SHARDS = 65_536
MAX_SHARD_BYTES = 4 << 30
_SHARD_NAME = re.compile(r"^shard-\d{5}\.safetensors$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
KINDS = ("params", "momentum")


class CheckpointError(ValueError):
    """A manifest or shard that cannot be used: malformed, damaged, or from another run/model.
    The message says which and why."""


class IncompatibleState(CheckpointError):
    """A whole, valid state of another run or another model than this node's."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What must match for a state to be usable by a node: the run and the exact model."""

    run_id: str
    model: str  # preset name
    model_config: dict[str, Any]  # dataclasses.asdict(ModelConfig)
    seed: int = 0
    data: str = "stdlib"
    inner_steps: int = 0  # H when the state was made (also in settings, which are checked)
    # the run's settings (swarm/node/settings.py), canonical: a state made under others is not usable
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ShardInfo:
    name: str
    tensors: tuple[str, ...]
    nbytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class Manifest:
    run: RunInfo
    step: int  # outer steps applied to this state
    shards: tuple[ShardInfo, ...]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def to_json(self) -> bytes:
        """The canonical form (sorted keys, no spaces): equal manifests give equal bytes."""
        body = {
            "format": FORMAT,
            "run_id": self.run.run_id,
            "step": self.step,
            "model": self.run.model,
            "model_config": self.run.model_config,
            "seed": self.run.seed,
            "data": self.run.data,
            "inner_steps": self.run.inner_steps,
            "settings": self.run.settings,
            "shards": [
                {"name": s.name, "tensors": list(s.tensors), "bytes": s.nbytes, "sha256": s.sha256} for s in self.shards
            ],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json()).hexdigest()

    def shard(self, name: str) -> ShardInfo:
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(name)

    def check_usable_by(self, expect: RunInfo) -> None:
        """Raise CheckpointError unless this state belongs to expect's run and exact model."""
        if self.run.run_id != expect.run_id:
            raise IncompatibleState(f"the state is of run {self.run.run_id!r}, not {expect.run_id!r}")
        if self.run.model != expect.model or self.run.model_config != expect.model_config:
            raise IncompatibleState(
                f"the state is of model {self.run.model!r} with another shape than this node's {expect.model!r}"
            )
        # the node's own comparison (setting_values); a setting named as the flag that sets it
        theirs = differences(expect.settings, self.run.settings, label=lambda name: "--" + name.replace("_", "-"))
        if theirs:
            raise IncompatibleState(f"the state was made under other run settings: {'; '.join(theirs)}")


def parse_manifest(data: bytes) -> Manifest:
    """A manifest from its JSON, every field checked; raises CheckpointError."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"manifest is not JSON: {e}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"not a {FORMAT} manifest (an unknown format or another program's file)")
    run = RunInfo(
        run_id=_get(body, "run_id", str),
        model=_get(body, "model", str),
        model_config=_get(body, "model_config", dict),
        seed=_get(body, "seed", int),
        data=_get(body, "data", str),
        inner_steps=_get(body, "inner_steps", int),
        settings=_settings(body.get("settings", {})),
    )
    step = _get(body, "step", int)
    raw_shards = _get(body, "shards", list)
    if step < 0 or not 1 <= len(raw_shards) <= MAX_SHARDS:
        raise CheckpointError("manifest: step must be >= 0 and there must be 1 to 65536 shards")
    shards, seen_names, seen_tensors = [], set(), set()
    for raw in raw_shards:
        if not isinstance(raw, dict):
            raise CheckpointError("manifest: a shard entry is not an object")
        shard = ShardInfo(
            _get(raw, "name", str), tuple(_get(raw, "tensors", list)), _get(raw, "bytes", int), _get(raw, "sha256", str)
        )
        if not _SHARD_NAME.match(shard.name) or shard.name in seen_names:
            raise CheckpointError(f"manifest: bad or repeated shard name {shard.name[:64]!r}")
        if not 0 < shard.nbytes <= MAX_SHARD_BYTES or not _HEX64.match(shard.sha256):
            raise CheckpointError(f"manifest: shard {shard.name} has a bad size or hash")
        if not shard.tensors or not all(isinstance(t, str) and t.split("/")[0] in KINDS for t in shard.tensors):
            raise CheckpointError(f"manifest: shard {shard.name} lists bad tensor names")
        if seen_tensors & set(shard.tensors):
            raise CheckpointError(f"manifest: shard {shard.name} repeats a tensor")
        seen_names.add(shard.name)
        seen_tensors.update(shard.tensors)
        shards.append(shard)
    return Manifest(run, step, tuple(shards))


def _settings(value: Any) -> dict[str, Any]:
    settings = decode_settings(value)
    if settings is None:
        raise CheckpointError("manifest: 'settings' must be a small map of plain values")
    return settings


def _get(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CheckpointError(f"manifest: {key!r} must be a {kind.__name__}")
    return value


# --- snapshots --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable state: the manifest and each shard's bytes (what peers are served)."""

    manifest: Manifest
    shards: Mapping[str, bytes]


def copy_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """CPU copies of a DiLoCo.state_dict(): the only work done while training waits."""
    return {
        "outer_step": int(state["outer_step"]),
        **{kind: {n: t.detach().to("cpu", copy=True).contiguous() for n, t in state[kind].items()} for kind in KINDS},
    }


def make_snapshot(state: Mapping[str, Any], run: RunInfo, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Snapshot:
    """Serialize a copied state (copy_state) into shards and hash them: run it in a thread."""
    named = [(f"{kind}/{name}", t) for kind in KINDS for name, t in state[kind].items()]
    groups: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += nbytes
    return _snapshot_of(groups, run, int(state["outer_step"]))


def snapshot_like(state: Mapping[str, Any], manifest: Manifest) -> Snapshot:
    """Serialize a state into the shards `manifest` lists (its tensors, in its order), whatever
    shard size made it, to compare with it shard by shard: a state computed here is `manifest`'s
    state iff the two manifests hash alike. KeyError when the manifest names a tensor the state
    lacks. Run it in a thread."""
    named = {f"{kind}/{name}": t for kind in KINDS for name, t in state[kind].items()}
    groups = [[(name, named[name]) for name in shard.tensors] for shard in manifest.shards]
    return _snapshot_of(groups, manifest.run, int(state["outer_step"]))


def _snapshot_of(groups: list[list[tuple[str, torch.Tensor]]], run: RunInfo, step: int) -> Snapshot:
    shards: dict[str, bytes] = {}
    infos = []
    for i, group in enumerate(groups):
        name = f"shard-{i:05d}.safetensors"
        data = safetensors_save(dict(group))
        shards[name] = data
        infos.append(ShardInfo(name, tuple(n for n, _ in group), len(data), hashlib.sha256(data).hexdigest()))
    return Snapshot(Manifest(run, step, tuple(infos)), shards)


def state_from_shards(manifest: Manifest, shards: Iterable[bytearray]) -> dict[str, Any]:
    """Rebuild {"outer_step", "params", "momentum"} from verified shard bytes (in manifest order).
    The tensors are views of those buffers (no copy). Raises CheckpointError when a shard is
    malformed or holds other tensors than the manifest lists."""
    state: dict[str, Any] = {"outer_step": manifest.step, "params": {}, "momentum": {}}
    for info, data in zip(manifest.shards, shards, strict=True):
        if not isinstance(data, bytearray):  # views of immutable bytes would be read-only
            data = bytearray(data)
        try:
            tensors = tensors_in_safetensors(data)
        except CheckpointError as e:
            raise CheckpointError(f"shard {info.name} is not a readable safetensors file: {e}") from None
        if set(tensors) != set(info.tensors):
            raise CheckpointError(f"shard {info.name} holds other tensors than its manifest lists")
        for full_name, tensor in tensors.items():
            kind, _, name = full_name.partition("/")
            state[kind][name] = tensor
    return state


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


def tensors_in_safetensors(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `data`, as views of it: a verified shard becomes
    the state without another copy (safetensors' own loader copies twice). Every header field
    is checked against the buffer; raises CheckpointError."""
    if len(data) < 8:
        raise CheckpointError("shorter than its header length")
    size = int.from_bytes(data[:8], "little")
    if not 2 <= size <= min(MAX_HEADER_BYTES, len(data) - 8):
        raise CheckpointError("bad header length")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError("header is not an object")
    body = 8 + size
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise CheckpointError(f"{name[:64]!r}: unknown dtype")
        dtype, shape, offsets = _DTYPES[entry["dtype"]], entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CheckpointError(f"{name[:64]!r}: bad shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{name[:64]!r}: bad data offsets")
        begin, end = offsets
        count = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= len(data) - body or end - begin != count * itemsize:
            raise CheckpointError(f"{name[:64]!r}: data offsets do not match its shape or the file")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # a bytes object is read-only: torch warns; a bytearray is not
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=body + begin)
        out[name] = flat.view(shape)
    return out


def verify_shard(info: ShardInfo, data: bytes | bytearray | memoryview) -> None:
    if len(data) != info.nbytes:
        raise CheckpointError(f"shard {info.name}: {len(data)} bytes, the manifest says {info.nbytes}")
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise CheckpointError(f"shard {info.name}: SHA-256 does not match the manifest")


def read_file(path: Path) -> bytearray:
    """A whole file in a bytearray of its size (one copy, writable: tensors can view it)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        if f.readinto(data) != size:
            raise CheckpointError(f"{path} changed while it was read")
    return data
