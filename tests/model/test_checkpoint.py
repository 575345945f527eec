"""The state's format (swarm/model/checkpoint.py) and the local checkpoint directory (checkpoint_dir.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import torch

from swarm.model.checkpoint import (
    CheckpointError,
    IncompatibleState,
    RunInfo,
    copy_state,
    make_snapshot,
    parse_manifest,
    state_from_shards,
    verify_shard,
)
from swarm.model.checkpoint_dir import CheckpointDir
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.model.llama import build_model
from swarm.model.presets import preset

RUN = RunInfo(run_id="r", model="tiny", model_config=dataclasses.asdict(preset("tiny")), seed=0, inner_steps=5)


def _diloco(step: int = 0) -> DiLoCo:
    d = DiLoCo(build_model(preset("tiny"), 0), DiLoCoConfig(inner_steps=1))
    gen = torch.Generator().manual_seed(step)
    for m in d.outer_momentum:
        m.copy_(torch.randn(m.shape, generator=gen))
    d.outer_step = step
    return d


def test_snapshot_roundtrip_is_exact_and_shards_follow_the_size() -> None:
    d = _diloco(3)
    snap = make_snapshot(copy_state(d.state_dict()), RUN, shard_bytes=1 << 20)
    manifest = snap.manifest
    assert manifest.step == 3 and len(manifest.shards) > 5
    assert all(s.nbytes <= (1 << 20) + (1 << 19) for s in manifest.shards[:-1])  # about the size, tensors whole
    assert sum(len(s.tensors) for s in manifest.shards) == 2 * len(d.names)
    for info in manifest.shards:
        verify_shard(info, snap.shards[info.name])
    state = state_from_shards(manifest, [snap.shards[s.name] for s in manifest.shards])
    other = _diloco(0)
    other.load_state_dict(state)
    assert other.outer_step == 3 and other.outer_sha256() == d.outer_sha256()
    assert all(torch.equal(a, b) for a, b in zip(other.outer_momentum, d.outer_momentum, strict=True))


def test_the_manifest_hash_is_canonical_and_pins_every_field() -> None:
    snap = make_snapshot(copy_state(_diloco(1).state_dict()), RUN, shard_bytes=4 << 20)
    again = make_snapshot(copy_state(_diloco(1).state_dict()), RUN, shard_bytes=4 << 20)
    assert snap.manifest.to_json() == again.manifest.to_json() and snap.manifest.sha256 == again.manifest.sha256
    parsed = parse_manifest(snap.manifest.to_json())
    assert parsed == snap.manifest
    moved = make_snapshot(copy_state(_diloco(2).state_dict()), RUN, shard_bytes=4 << 20)
    assert moved.manifest.sha256 != snap.manifest.sha256


def _mutated(field: str, value: object) -> bytes:
    snap = make_snapshot(copy_state(_diloco(1).state_dict()), RUN, shard_bytes=4 << 20)
    body = json.loads(snap.manifest.to_json())
    if field.startswith("shards."):
        body["shards"][0][field.split(".", 1)[1]] = value
    else:
        body[field] = value
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("format", "other/1"), ("step", -1), ("step", "3"), ("run_id", 5), ("model_config", []), ("shards", []),
        ("shards.name", "../../x"), ("shards.bytes", 0), ("shards.bytes", True), ("shards.sha256", "ab"),
        ("shards.tensors", []), ("shards.tensors", ["weights/x"]), ("seed", None),
    ],
)  # fmt: skip
def test_malformed_manifests_are_refused(field: str, value: object) -> None:
    with pytest.raises(CheckpointError):
        parse_manifest(_mutated(field, value))


def test_garbage_and_oversize_manifests_are_refused() -> None:
    for data in (b"", b"\xff\xfe", b"[1, 2]", b"{", b" " * (5 << 20)):
        with pytest.raises(CheckpointError):
            parse_manifest(data)


def test_a_state_for_another_run_or_model_is_incompatible() -> None:
    snap = make_snapshot(copy_state(_diloco(1).state_dict()), RUN)
    snap.manifest.check_usable_by(RUN)
    with pytest.raises(IncompatibleState, match="run"):
        snap.manifest.check_usable_by(dataclasses.replace(RUN, run_id="other"))
    small = RunInfo(run_id="r", model="small", model_config=dataclasses.asdict(preset("small")))
    with pytest.raises(IncompatibleState, match="model"):
        snap.manifest.check_usable_by(small)


def test_a_state_made_under_other_run_settings_is_incompatible_and_says_which() -> None:
    """The manifest carries the run's settings (a resumed node or a newcomer continues the
    same schedule): a state of another schedule is refused, naming both values."""
    ours = dataclasses.replace(RUN, settings={"lr_schedule": "cosine", "total_steps": 1000, "lr": 1e-3})
    snap = make_snapshot(copy_state(_diloco(1).state_dict()), ours)
    parsed = parse_manifest(snap.manifest.to_json())
    assert parsed.run.settings == ours.settings
    parsed.check_usable_by(ours)
    other = dataclasses.replace(RUN, settings={"lr_schedule": "constant", "total_steps": None, "lr": 1e-3})
    with pytest.raises(IncompatibleState, match=r"--lr-schedule 'cosine' \(this node: 'constant'\)"):
        parsed.check_usable_by(other)
    for bad in ({"x": [1]}, {"lr": float("nan")}, {str(i): i for i in range(40)}, "cosine"):
        body = json.loads(snap.manifest.to_json())
        body["settings"] = bad
        with pytest.raises(CheckpointError, match="settings"):
            parse_manifest(json.dumps(body).encode())


def test_a_shard_with_other_tensors_than_listed_is_refused() -> None:
    a = make_snapshot(copy_state(_diloco(1).state_dict()), RUN, shard_bytes=1 << 20)
    first, second = a.manifest.shards[:2]
    with pytest.raises(CheckpointError, match="other tensors"):
        state_from_shards(a.manifest, [a.shards[second.name], *[a.shards[s.name] for s in a.manifest.shards[1:]]])
    with pytest.raises(CheckpointError, match=r"SHA-256|bytes"):
        verify_shard(first, a.shards[second.name])
    with pytest.raises(CheckpointError, match="readable"):
        state_from_shards(a.manifest, [b"not safetensors"] + [a.shards[s.name] for s in a.manifest.shards[1:]])


def test_checkpoint_dir_keeps_the_last_two_and_loads_the_newest(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    assert ckpt.load_latest(RUN) is None
    for step in (1, 2, 3):
        ckpt.write(make_snapshot(copy_state(_diloco(step).state_dict()), RUN, shard_bytes=2 << 20))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000002", "step-00000003"]
    manifest, state = ckpt.load_latest(RUN)
    assert manifest.step == 3 and state["outer_step"] == 3
    with pytest.raises(IncompatibleState):
        ckpt.load_latest(dataclasses.replace(RUN, run_id="other"))


def test_a_step_written_after_later_ones_removes_them(tmp_path: Path) -> None:
    """A fork's smaller side that stepped back to the larger side's older state: a restart
    resumes the state it took, never the steps of the lineage it left."""
    ckpt = CheckpointDir(tmp_path)
    for step in (7, 8, 5):
        ckpt.write(make_snapshot(copy_state(_diloco(step).state_dict()), RUN, shard_bytes=2 << 20))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000005"]
    shard = next((tmp_path / "step-00000005").glob("shard-*"))
    shard.write_bytes(b"damaged")  # and nothing of the left lineage to fall back to
    with pytest.raises(CheckpointError):
        ckpt.load_latest(RUN)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="swarm.model.checkpoint_dir")
    ckpt = CheckpointDir(tmp_path)
    for step in (4, 5):
        ckpt.write(make_snapshot(copy_state(_diloco(step).state_dict()), RUN, shard_bytes=2 << 20))
    shard = next((tmp_path / "step-00000005").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    manifest, _ = ckpt.load_latest(RUN)
    assert manifest.step == 4
    skipped = [r.getMessage() for r in caplog.records if "skipped the checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "step-00000005" in skipped[0] and "step-00000004" in skipped[0], skipped
    # a writer killed mid-write: a temporary directory and no LATEST update; it is ignored and cleaned
    partial = tmp_path / f"step-00000006.tmp-{os.getpid() + 1}"
    partial.mkdir()
    (partial / "shard-00000.safetensors").write_bytes(b"half")
    assert ckpt.load_latest(RUN)[0].step == 4
    ckpt.write(make_snapshot(copy_state(_diloco(6).state_dict()), RUN, shard_bytes=2 << 20))
    assert not partial.exists() and ckpt.load_latest(RUN)[0].step == 6


def test_nothing_whole_is_an_error_that_says_why(tmp_path: Path) -> None:
    (tmp_path / "step-00000001").mkdir()
    (tmp_path / "step-00000001" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no whole checkpoint"):
        CheckpointDir(tmp_path).load_latest(RUN)


def _safetensors(header: dict, body: bytes) -> bytearray:
    raw = json.dumps(header).encode()
    return bytearray(len(raw).to_bytes(8, "little") + raw + body)


def test_shards_load_as_views_of_their_bytes_and_bad_headers_are_refused() -> None:
    from safetensors.torch import save

    from swarm.model.checkpoint import tensors_in_safetensors

    data = bytearray(save({"params/w": torch.arange(6, dtype=torch.float32).view(2, 3)}))
    tensors = tensors_in_safetensors(data)
    assert torch.equal(tensors["params/w"], torch.arange(6, dtype=torch.float32).view(2, 3))
    data[-4:] = torch.tensor([42.0]).view(torch.uint8).tolist()  # no copy: the tensor sees the buffer
    assert tensors["params/w"][1, 2] == 42.0
    body = bytes(24)
    for header, payload in (
        ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}, body),  # size mismatch
        ({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}}, body),  # past the end
        ({"w": {"dtype": "Q4", "shape": [6], "data_offsets": [0, 24]}}, body),  # unknown dtype
        ({"w": {"dtype": "F32", "shape": [-6], "data_offsets": [0, 24]}}, body),
        ({"w": {"dtype": "F32", "shape": [6], "data_offsets": [0]}}, body),
        ({"w": [1]}, body),
        ([1, 2], body),
    ):
        with pytest.raises(CheckpointError):
            tensors_in_safetensors(_safetensors(header, payload))  # type: ignore[arg-type]
    for raw in (bytearray(b"\x01"), bytearray((10**9).to_bytes(8, "little")), bytearray(b"\x02" + bytes(7) + b"{x")):
        with pytest.raises(CheckpointError):
            tensors_in_safetensors(raw)


def test_a_nodes_own_tensors_travel_beside_the_checkpoint_never_in_its_manifest(tmp_path: Path) -> None:
    ckpt = CheckpointDir(tmp_path)
    residual = torch.randn(1000)
    ckpt.write(make_snapshot(copy_state(_diloco(7).state_dict()), RUN), {"error_feedback/residual": residual})
    manifest, _ = ckpt.load_latest(RUN)
    assert all("error_feedback" not in name for shard in manifest.shards for name in shard.tensors)
    assert torch.equal(ckpt.load_local(7)["error_feedback/residual"], residual)
    assert ckpt.load_local(6) == {}  # no such step: nothing
    (tmp_path / "step-00000007" / "local.safetensors").write_bytes(b"not safetensors")
    assert ckpt.load_local(7) == {}  # unreadable: resumed without it, and a warning says so
