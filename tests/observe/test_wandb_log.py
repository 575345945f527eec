"""WandbLogger (swarm/observe/wandb_log.py, `swarm-node --wandb PROJECT`) in wandb's offline mode:
the metrics endpoint's samples logged at each outer step into one run per node grouped by the run
id; a wandb that fails is a warning line; without the extra, --wandb is refused in one line."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from swarm.cli.node import main
from swarm.observe.metrics import NodeMetrics
from swarm.observe.wandb_log import WandbLogger, samples
from tests.observe.wandb_files import offline_runs

pytestmark = pytest.mark.timeout(90)
PEER = "12D3KooWTestPeer"
START = {"event": "start", "peer_id": PEER, "run_id": "demo", "model": "tiny", "device": "cpu",
         "client_mode": False, "outer_step": 0, "maddrs": [], "parameters": 123}  # fmt: skip


def outer_step(step: int) -> dict[str, object]:
    return {"event": "outer_step", "outer_step": step, "train_loss": 4.0 - step, "eval_loss": 4.1 - step,
            "group_size": 2, "group_id": "ab", "bytes_sent": 1000, "bytes_received": 900, "round_s": 0.5,
            "matchmaking_s": 0.2, "tokens": 512 * (step + 1), "inner_done": 4}  # fmt: skip


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # wandb reads its environment once per process: from here, ours
    yield tmp_path
    wandb.teardown()


def test_without_the_extra_wandb_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    result = CliRunner().invoke(main, ["--wandb", "proj", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
                                prog_name="swarm-node")  # fmt: skip
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert len(lines) == 1 and "pip install -e '.[wandb]'" in lines[0], result.stderr


def test_the_samples_are_the_endpoints_without_buckets_or_info() -> None:
    metrics = NodeMetrics()
    metrics(START)
    metrics(outer_step(0))
    metrics({"event": "data", "epoch": 1, "share": 0.25, "chunks_done": 3, "chunks": 12, "tokens": 4096})
    figures = samples(metrics)
    assert figures["swarm_outer_steps_total"] == 1 and figures["swarm_tokens_total"] == 512
    assert figures["swarm_sent_bytes_total/allreduce"] == 1000 and figures["swarm_errors_total/p2p/warning"] == 0
    assert figures["swarm_round_seconds_count"] == 1 and figures["swarm_round_seconds_sum"] == 0.5
    assert (figures["swarm_data_epoch"], figures["swarm_data_epoch_done_ratio"]) == (1, 0.25)
    assert figures["swarm_data_epoch_tokens"] == 4096
    assert not [k for k in figures if "_bucket" in k or k.startswith("swarm_node_info")]


def test_each_outer_step_logs_the_metrics_into_the_nodes_run(offline: Path) -> None:
    logger = WandbLogger("swarm-test")
    loop_thread = threading.get_ident()
    for event in (START, outer_step(0), {"event": "progress", "outer_step": 1, "inner_step": 2}, outer_step(1)):
        logger(event)  # returns at once: wandb runs in the worker thread
    assert logger._worker.ident != loop_thread
    logger.close()
    assert logger.failed is None and logger.logged == 2
    (run,) = offline_runs(offline)
    assert (run.project, run.group, run.name) == ("swarm-test", "demo", PEER)
    assert run.config["model"] == "tiny" and run.config["peer_id"] == PEER
    steps = {h["_step"]: h for h in run.history}
    assert sorted(steps) == [0, 1]
    assert steps[1]["swarm_outer_steps_total"] == 2 and steps[1]["swarm_tokens_total"] == 1024
    assert steps[1]["swarm_eval_loss"] == pytest.approx(3.1) and "swarm_sent_bytes_total/allreduce" in steps[1]
    assert set(samples(logger.metrics)) <= set(steps[1])  # everything the endpoint exposes


def test_a_wandb_that_fails_is_a_warning_and_training_goes_on(
    offline: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WANDB_MODE", "no-such-mode")  # wandb.init raises its own validation error
    import wandb

    wandb.teardown()
    caplog.set_level(logging.WARNING, logger="swarm.observe.wandb_log")
    logger = WandbLogger("swarm-test")
    for event in (START, outer_step(0), outer_step(1)):
        logger(event)
    logger.close()
    assert logger.failed is not None and logger.logged == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("wandb: cannot start the run in project 'swarm-test'"), lines
    assert "\n" not in lines[0]
    assert not offline_runs(offline)


def test_a_bad_project_name_is_refused() -> None:
    with pytest.raises(ValueError, match="without '/'"):
        WandbLogger("team/project")
