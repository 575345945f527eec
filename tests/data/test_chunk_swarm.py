"""Chunk claims between real swarm-node processes on prepared data: three nodes train one
dataset; one is killed (kill -9) and restarted from its checkpoint folder with its identity; it
resumes at its saved position, its lapsed chunk is trained again, and the epoch ends with every
chunk trained (the nodes' logs say so)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from swarm.model.prepare import PrepareConfig, load_tokenizer, prepare
from tests.model.token_corpus import train_tokenizer, write_corpus
from tests.node.conftest import Swarm

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[hf]')")


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_three_nodes_share_the_chunks_and_a_killed_node_resumes(swarm: Swarm, tmp_path: Path) -> None:
    paths, docs = write_corpus(tmp_path / "text", seed=4, rows=400)
    tok = load_tokenizer(str(train_tokenizer(docs, tmp_path / "tok.json")))
    prepare(paths, tok, tmp_path / "data", PrepareConfig(shard_tokens=400, eval_every=5, eval_tokens=1500))
    swarm.start_bootstrap()
    run = ("--run-id", "chunks", "--inner-steps", "4", "--matchmaking-time", "1", "--data", str(tmp_path / "data"))

    def start(name: str) -> object:
        return swarm.node(name, *run, "--checkpoint-dir", str(tmp_path / f"ckpt-{name[0]}"),
                          "--identity", str(tmp_path / f"{name[0]}.key"))  # fmt: skip

    nodes = {name: start(name) for name in ("a", "b", "c")}
    swarm.wait_for(lambda: len(swarm.events("c", "outer_step")) >= 1, 150, "node c's first outer step")
    nodes["c"].kill()  # type: ignore[attr-defined]  (kill -9: no release of its claims)
    nodes["c"].wait(30)  # type: ignore[attr-defined]
    assert (tmp_path / "ckpt-c" / "data-position.json").exists()
    start("c-again")
    swarm.wait_for(lambda: "data: resuming at epoch" in swarm.stderr("c-again"), 60, "c to resume its position")
    over = "data: epoch 0 is over (every chunk trained"
    swarm.wait_for(lambda: any(over in swarm.stderr(n) for n in ("a", "b", "c-again")), 200, "the end of epoch 0")
    # from the logs: every chunk of epoch 0 trained, and twice only where the killed node had
    # trained it before its done marks reached the DHT
    done: dict[int, list[str]] = {}
    for name in ("a", "b", "c", "c-again"):
        for m in re.finditer(r"data: chunk (\d+) of epoch 0 done", swarm.stderr(name)):
            done.setdefault(int(m.group(1)), []).append(name)
    chunks = len(json.loads((tmp_path / "data" / "manifest.json").read_text())["train"])
    assert set(done) == set(range(chunks)), sorted(set(range(chunks)) - set(done))
    twice = {c: who for c, who in done.items() if len(who) > 1}
    assert all("c" in who and len(who) == 2 for who in twice.values()), twice
