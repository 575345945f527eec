"""Watching a prepared-data run from a real swarm-node process: the swarm's way through its data
(epoch, share of its chunks trained, tokens) in the node's Prometheus metrics, its dashboard's
JSON and `swarm-dht inspect`, and `--wandb PROJECT` in wandb's offline mode: the node's own wandb
run, grouped by the run id, holds the metrics' keys at each outer step."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from swarm.utils import process_control
from swarm.utils.process_control import console_script
from tests.children import child_env
from tests.model.token_corpus import prepared_data
from tests.node.conftest import FAST, LOOPBACK, Swarm
from tests.observe.test_metrics import samples
from tests.observe.wandb_files import offline_runs

pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[hf]')")
# find_spec, not importorskip: importing wandb costs 0.5 s in every worker that collects this file
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install -e '.[wandb]')"
)


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def wait_for(condition: object, timeout: float, what: str, err: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; the node's stderr ends:\n{err.read_text()[-3000:]}")
        time.sleep(0.3)


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_nodes_data_progress_shows_in_metrics_dashboard_inspect_and_wandb(swarm: Swarm, tmp_path: Path) -> None:
    prepared_data(tmp_path, seed=5, rows=200, shard_tokens=400, eval_every=5, eval_tokens=1500)
    chunks = len(json.loads((tmp_path / "data" / "manifest.json").read_text())["train"])  # a chunk a shard
    env = child_env(OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wb"), WANDB_SILENT="true")
    (tmp_path / "wb").mkdir()
    out, err = tmp_path / "a.out", tmp_path / "a.err"
    # the tiny model, not FAST's debug one: at the debug model's pace the node ends its epoch of 22
    # chunks before the reads below, which check the first epoch's figures
    argv = [console_script("swarm-node"), "--host-maddrs", LOOPBACK, *FAST, "--model", "tiny", "--run-id", "seen",
            "--inner-steps", "4",
            "--data", str(tmp_path / "data"), "--metrics-file", str(swarm.metrics_path("a")), "--metrics-port", "0",
            "--wandb", "swarm-test", "-v"]  # fmt: skip
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = process_control.start(argv, stdout=stdout, stderr=stderr, text=True, env=env)
    swarm.procs.append(proc)  # stopped by the fixture, pass or fail

    def stepped_after_data() -> bool:  # an outer step logged once the data gauges were set
        data = swarm.events("a", "data")
        later = [e for e in swarm.events("a", "outer_step") if data and e["time"] > data[0]["time"]]
        return len(swarm.events("a", "outer_step")) >= 2 and bool(later)

    wait_for(stepped_after_data, 200, "two outer steps and a data event", err)
    url = re.search(r"metrics: (\S+)metrics", out.read_text())
    assert url, out.read_text()
    scrape = samples(get(url.group(1) + "metrics").decode())
    assert scrape["swarm_data_chunks"] == chunks and scrape["swarm_data_epoch"] == 0
    assert 1 <= scrape["swarm_data_epoch_chunks_done"] <= chunks
    assert scrape["swarm_data_epoch_done_ratio"] == pytest.approx(scrape["swarm_data_epoch_chunks_done"] / chunks)
    assert scrape["swarm_data_epoch_tokens"] >= 64 * scrape["swarm_data_epoch_chunks_done"]

    def dashboard_has_data() -> bool:  # the node's dashboard starts its DHT reader at the first request
        return json.loads(get(url.group(1) + "api/run"))["data"] is not None

    wait_for(dashboard_has_data, 60, "the dashboard's data section", err)
    shown = json.loads(get(url.group(1) + "api/run"))["data"]
    assert shown["chunks"] == chunks and shown["nodes"] == 1 and shown["chunks_done"] >= 1

    maddr = swarm.events("a", "start")[0]["maddrs"][0]
    inspect = [console_script("swarm-dht"), "inspect", "--run-id", "seen", "--initial-peers", maddr]
    as_json = subprocess.run([*inspect, "--json"], capture_output=True, text=True, timeout=60, env=env)
    data = json.loads(as_json.stdout)["data"]
    assert data["chunks"] == chunks and data["epoch"] == 0 and data["chunks_done"] >= 1, as_json.stderr
    table = subprocess.run(inspect, capture_output=True, text=True, timeout=60, env=env).stdout
    # the node trains on meanwhile: on a quiet machine it can begin epoch 1 between the two reads
    assert re.search(rf"^data: epoch [01], \d+ of {chunks} chunks done \(\d+\.\d%\), [\d,]+ tokens this epoch", table,
                     re.M), table  # fmt: skip

    proc.send_signal(signal.SIGTERM)  # finishes the round under way, then the wandb run
    assert swarm.exit_code("a", proc, 90) == 0, err.read_text()[-3000:]
    (run,) = offline_runs(tmp_path / "wb")
    peer = swarm.events("a", "start")[0]["peer_id"]
    assert (run.project, run.group, run.name) == ("swarm-test", "seen", peer)
    steps = {h["_step"]: h for h in run.history}
    done = [e["outer_step"] for e in swarm.events("a", "outer_step")]
    assert sorted(steps) == done  # one log per outer step, at wandb step = the outer step
    last = steps[done[-1]]
    assert last["swarm_outer_steps_total"] == len(done) and last["swarm_data_chunks"] == chunks
    for key in ("swarm_tokens_total", "swarm_train_loss", "swarm_data_epoch_done_ratio", "swarm_round_seconds_count",
                "swarm_sent_bytes_total/other", "swarm_errors_total/p2p/warning"):  # fmt: skip
        assert key in last, sorted(last)
