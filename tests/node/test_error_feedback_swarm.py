"""Error feedback and reducible sparsity in a swarm (--error-feedback, --compression int8:0.25): 3
SwarmNodes in one event loop over real sockets average what their codec carries of Δ plus their
residuals (of the step's chosen blocks only, when sparse), agree bit for bit at every step, keep a
residual of their own, and checkpoint it beside (never inside) the state they serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.model.checkpoint_dir import CheckpointDir
from swarm.model.data import TokenData
from swarm.p2p.identity import Identity
from tests.node.inprocess import LocalSwarm
from tests.node.test_attacks_bounds import HONEST_SEEDS, LONG, assert_agree, finish

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]


async def test_nodes_with_error_feedback_agree_and_checkpoint_their_residual(
    local: LocalSwarm, data: TokenData, tmp_path: Path
) -> None:
    bootstrap = await local.start_bootstrap()
    honest = [local.start((bootstrap,), identity=Identity.from_seed(seed), max_outer_steps=LONG, error_feedback=1.0,
                          checkpoint_dir=str(tmp_path) if i == 0 else None)
              for i, seed in enumerate(HONEST_SEEDS)]  # fmt: skip
    await finish(honest)
    assert_agree(honest)
    assert all(e["group_size"] >= 2 for n in honest for s, e in n.steps().items() if s >= 1)
    residuals = [n.node._feedback.residual for n in honest]
    assert all(r is not None and float(r.norm()) > 0 for r in residuals)  # the codec dropped something
    assert not torch.equal(residuals[0], residuals[1])  # each node's own: it is never averaged
    manifest, _ = CheckpointDir(tmp_path).load_latest()  # of the last state the node held
    saved = CheckpointDir(tmp_path).load_local(manifest.step)
    assert torch.equal(saved["error_feedback/residual"], residuals[0])
    assert all("error_feedback" not in name for shard in manifest.shards for name in shard.tensors)


async def test_sparse_steps_send_a_quarter_of_the_bytes_and_agree(local: LocalSwarm, data: TokenData) -> None:
    bootstrap = await local.start_bootstrap()
    honest = [local.start((bootstrap,), identity=Identity.from_seed(seed), max_outer_steps=LONG, error_feedback=1.0,
                          compression="int8:0.25")
              for seed in HONEST_SEEDS]  # fmt: skip
    await finish(honest)
    assert_agree(honest)
    steps = [e for n in honest for s, e in n.steps().items() if s >= 1 and e["group_size"] == 3]
    assert steps
    full = honest[0].node.diloco.parameter_count * 1.0625 * 2 * 2 / 3  # int8 bytes a dense round sends
    sent = sorted(e["bytes_sent"] for e in steps)
    assert 0.15 * full < sent[len(sent) // 2] < 0.35 * full, (sent, full)  # a quarter of the blocks, and headers
