"""Nodes read prepared data (`--data DIR`, swarm/model/data.py, swarm/cli/node_data.py): the
shards are memmapped, not loaded; each node draws the windows today's stdlib corpus would draw
from the same token stream; the run setting `data` is the dataset's digest, so nodes whose
folders hold other tokens are refused by name, and equal tokens in other folders agree."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from swarm.cli.common import CliError
from swarm.cli.node_data import open_prepared
from swarm.model.checkpoint_dir import CheckpointDir
from swarm.model.data import DataUnavailableError, ShardedTokens, load_data, node_generator, sample_batch
from swarm.model.export import ExportOptions, export_checkpoint
from swarm.model.prepare import PrepareConfig, load_tokenizer, prepare
from swarm.node.config import NodeConfig
from swarm.node.settings import disagreement, training_settings
from tests.model.token_corpus import train_tokenizer, write_corpus
from tests.node.conftest import Swarm

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[hf]')")

SMALL_SHARDS = PrepareConfig(shard_tokens=300, eval_every=5, eval_tokens=1500)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two prepared datasets of other text ("a", "b") and a copy of "a" in another folder."""
    root = tmp_path_factory.mktemp("prepared")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        paths, docs = write_corpus(root / f"text-{name}", seed=seed, rows=600)
        tok = load_tokenizer(str(train_tokenizer(docs, root / f"tok-{name}.json")))
        out[name] = root / name
        prepare(paths, tok, out[name], SMALL_SHARDS)
    out["a-copy"] = Path(shutil.copytree(out["a"], root / "elsewhere" / "a"))
    return out


def _whole_stream(folder: Path) -> torch.Tensor:
    manifest = json.loads((folder / "manifest.json").read_text())
    parts = [np.fromfile(folder / s["name"], dtype="<u2") for s in manifest["train"]]
    return torch.from_numpy(np.concatenate(parts).astype(np.int32))


def test_a_prepared_folder_is_memmapped_and_sampled_as_one_stream(folders: dict[str, Path]) -> None:
    data = load_data(str(folders["a"]))
    digest = json.loads((folders["a"] / "manifest.json").read_text())
    assert isinstance(data.train, ShardedTokens) and len(data.train.shards) > 20
    assert all(isinstance(s, np.memmap) for s in data.train.shards)  # read in place, not loaded
    assert data.name == f"tokens:{data.fingerprint}" and data.vocab_size <= 400 and digest["tokenizer"]["eos_id"] == 0
    whole = _whole_stream(folders["a"])
    assert len(data.train) == len(whole) and data.eval.dtype == torch.int32
    # the windows today's sampling draws from one tensor of these tokens, for every (peer, step):
    # seq_len 64 over 300-token shards, so many windows run from one shard into the next
    for peer, step in ((b"peer-a", 0), (b"peer-a", 7), (b"peer-b", 7), (b"peer-c", 1234)):
        ours = sample_batch(data.train, 16, 64, node_generator(peer, step))
        today = sample_batch(whole, 16, 64, node_generator(peer, step))
        assert all(torch.equal(x, y) for x, y in zip(ours, today, strict=True))
    ends = torch.tensor([0, 299, 300 - 64, len(whole) - 65])  # at and across the seams, and the very end
    assert torch.equal(data.train.windows(ends, 65), whole[ends[:, None] + torch.arange(65)].long())
    with pytest.raises(ValueError, match="outside"):
        data.train.windows(torch.tensor([len(whole) - 64]), 65)


def test_the_run_setting_is_the_digest_so_other_tokens_are_refused_by_name(folders: dict[str, Path]) -> None:
    configs = {}
    for name, folder in folders.items():
        config, data = open_prepared(NodeConfig(data=str(folder), seq_len=64))
        assert data is not None and config.data == data.name and config.data.startswith("tokens:")
        configs[name] = config
    assert configs["a"].data == configs["a-copy"].data != configs["b"].data  # the tokens, not the path
    ours, theirs = training_settings(configs["b"]), training_settings(configs["a"])
    line = disagreement(ours, [("peer", theirs)], {"peer"})
    assert line is not None and f"--data {configs['a'].data!r} (this node: {configs['b'].data!r})" in line
    assert disagreement(training_settings(configs["a-copy"]), [("peer", theirs)], {"peer"}) is None
    assert open_prepared(NodeConfig()) == (NodeConfig(), None)  # --data stdlib: unchanged


def test_unusable_data_is_one_clear_error(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(DataUnavailableError, match="pass --data DIR"):
        load_data(load_data(str(folders["a"])).name)  # the setting a joining node adopted, with no folder
    damaged = Path(shutil.copytree(folders["a"], tmp_path / "damaged"))
    shard = damaged / "train-00003.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataUnavailableError, match=r"train-00003\.bin: its SHA-256 does not match"):
        load_data(str(damaged))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataUnavailableError, match=r"has no manifest\.json"):
        load_data(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unknown data"):
        load_data(str(tmp_path / "no-such-folder"))
    paths = [p for p in folders["a"].parent.glob("text-a/*")]
    tok = load_tokenizer(str(folders["a"].parent / "tok-a.json"))
    prepare(paths, tok, tmp_path / "short-eval", dataclasses.replace(SMALL_SHARDS, eval_tokens=50))
    with pytest.raises(CliError, match="eval tokens are too few for windows of --seq-len 256"):
        open_prepared(NodeConfig(data=str(tmp_path / "short-eval"), seq_len=256))


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_nodes_train_on_prepared_data_and_a_node_of_other_tokens_is_refused(
    folders: dict[str, Path], swarm: Swarm, tmp_path: Path
) -> None:
    swarm.start_bootstrap()
    run = ("--run-id", "tokens", "--inner-steps", "3", "--matchmaking-time", "1")
    first = swarm.node(
        "a", *run, "--data", str(folders["a"]), "--max-outer-steps", "200", "--checkpoint-dir", str(tmp_path / "ckpt")
    )  # fmt: skip (stopped below)
    swarm.wait_for(lambda: len(swarm.events("a", "outer_step")) >= 1, 150, "the first node's first outer step")
    other = swarm.node("b", *run, "--data", str(folders["b"]), "--max-outer-steps", "200", "--leave-after-steps", "2")
    assert other.wait(120) != 0
    digest_a = load_data(str(folders["a"])).name
    assert f"--data {digest_a!r} (this node: 'tokens:" in swarm.stderr("b"), swarm.stderr("b")
    first.send_signal(15)
    assert swarm.exit_code("a", first, 60) == 0, swarm.stderr("a")
    loaded = CheckpointDir(tmp_path / "ckpt").load_latest()
    assert loaded is not None and loaded[0].run.data == digest_a and loaded[0].run.settings["data"] == digest_a
    vocab = dataclasses.asdict(load_tokenizer(str(folders["a"].parent / "tok-a.json")).info)["vocab_size"]
    assert loaded[0].run.model_config["vocab_size"] == vocab
    # the node read the chunks it claimed in the DHT, and its position in them is in its checkpoint folder
    position = json.loads((tmp_path / "ckpt" / "data-position.json").read_text())
    assert position["data"] == digest_a and (position["current"] is not None or position["last"] is not None)
    losses = [e["train_loss"] for e in swarm.events("a", "outer_step") if e.get("train_loss") is not None]
    assert losses and all(np.isfinite(losses))
    # the way out: the run's model, with the dataset's end-of-text id for generate()
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", ExportOptions(eos_token_id=0))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == vocab and config["eos_token_id"] == 0
