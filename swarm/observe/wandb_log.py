"""WandbLogger: a node's metrics in Weights & Biases (`swarm-node --wandb PROJECT`, the `wandb` extra).

    logger = WandbLogger("my-project")              # or WandbLogger("my-project", server.metrics)
    node = SwarmNode(config, on_event=logger)       # one subscriber: events in, a wandb run out
    ...
    logger.close()                                  # finishes the wandb run (a bounded wait)

What it logs is what the node's Prometheus endpoint exposes (observe/metrics.py's NodeMetrics):
at each outer_step event, every sample of the registry (a histogram as its _sum and _count, a
labelled family as name/label/...), at wandb step = the outer step completed. The node's info
labels (peer, run, model, device) are the wandb run's config. One wandb run per node, grouped
by the swarm run's id (`group=`) and named by the node's PeerID; its id is derived from both, so
that a node that restarts with its identity goes on in its own wandb run.

wandb must be logged in beforehand (`wandb login`, or WANDB_API_KEY), or run offline
(WANDB_MODE=offline, then `wandb sync`): swarm-node sets WANDB_SILENT, so that wandb never
prompts for a key from its worker thread (that fails instead) nor prints over the node's panel.

Training never waits on wandb: its calls (`init` starts a service process, `log` may block on
it) run in one worker thread, fed through a bounded queue, and the event loop only enqueues (a
full queue drops the newest figures, logged once). A wandb failure is a warning line, never an
exception in the node: a run that cannot start logs nothing more, a failed `log` is skipped.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from typing import Any

from swarm.observe.metrics import NodeMetrics

logger = logging.getLogger(__name__)

EXTRA = "pip install -e '.[wandb]'"
MAX_PENDING = 64  # logs queued for the worker; beyond, the newest are dropped (wandb is stuck)
FINISH_WAIT = 60.0  # seconds close() waits for the worker to flush and finish the run


class WandbMissing(RuntimeError):
    """The wandb package is not installed (the optional extra)."""


def import_wandb() -> Any:
    """The wandb module; WandbMissing with the line that installs it."""
    try:
        import wandb
    except ImportError as e:
        raise WandbMissing(f"--wandb needs the optional wandb extra: {EXTRA} ({e})") from None
    return wandb


class WandbLogger:
    """An event subscriber that logs NodeMetrics' samples to a wandb run from a worker thread."""

    def __init__(self, project: str, metrics: NodeMetrics | None = None) -> None:
        """metrics: a NodeMetrics that another subscriber feeds (the --metrics-port server's);
        None: our own, fed here. WandbMissing without the wandb package."""
        if not project or "/" in project:
            raise ValueError("a wandb project is a non-empty name without '/'")
        self.project = project
        self.metrics = metrics if metrics is not None else NodeMetrics()
        self._feed = metrics is None
        self._wandb = import_wandb()
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(MAX_PENDING)
        self._worker = threading.Thread(target=self._work, name="wandb", daemon=True)
        self._started = False  # the start event came: the worker runs (until close)
        self._closed = False
        self._dropped = 0
        self.logged = 0  # logs wandb accepted (the worker's count)
        self.failed: str | None = None  # why the wandb run stopped logging (None: it did not)

    def __call__(self, event: dict[str, Any]) -> None:
        if self._feed:
            self.metrics(event)
        kind = event.get("event")
        if kind == "start" and not self._started and not self._closed:
            self._started = True
            self._worker.start()
            self._put(("init", _init_args(self.project, event)))
        elif kind == "outer_step" and self._started and isinstance(event.get("outer_step"), int):
            self._put(("log", (samples(self.metrics), event["outer_step"])))

    def close(self, timeout: float = FINISH_WAIT) -> None:
        """Finish the wandb run: the worker logs what is queued, then calls finish (at most
        `timeout` seconds; a worker still stuck in wandb is left behind, a daemon thread)."""
        self._closed = True
        if not self._started:
            return
        self._started = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            logger.warning("wandb: the worker is stuck; the run is left unfinished")
            return
        self._worker.join(timeout)
        if self._worker.is_alive():
            logger.warning("wandb: the run did not finish within %.0fs; left unfinished", timeout)

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:  # once: the figures are in the metrics endpoint and the next logs
                logger.warning("wandb: logging falls behind; dropping figures until it catches up")

    def _work(self) -> None:
        run = None
        while (item := self._queue.get()) is not None:
            kind, value = item
            if self.failed is not None:
                continue
            try:
                if kind == "init":
                    # console="off": wandb leaves the node's stdout and stderr (its live panel) alone
                    run = self._wandb.init(**value, settings=self._wandb.Settings(console="off"))
                    logger.info("wandb: logging to run %s of project %r at %s", run.id, self.project,
                                run.url or run.dir)  # fmt: skip
                elif run is not None:
                    figures, step = value
                    run.log(figures, step=step)
                    self.logged += 1
            except Exception as e:  # wandb's own errors: logged, the node trains on
                if kind == "init":
                    self.failed = _one_line(e)
                    logger.warning("wandb: cannot start the run in project %r (%s); not logging", self.project,
                                   self.failed)  # fmt: skip
                else:
                    logger.warning("wandb: a log at step %s failed: %s", value[1], _one_line(e))
        if run is not None:
            try:
                run.finish()
            except Exception as e:
                logger.warning("wandb: finishing the run failed: %s", _one_line(e))


def samples(metrics: NodeMetrics) -> dict[str, float]:
    """The registry's samples as wandb keys: `name` or `name/label value/...`; a histogram's
    buckets and the info family are left out (its labels are the run's config)."""
    out: dict[str, float] = {}
    for family in metrics.registry.collect():
        if family.type == "info":
            continue
        for s in family.samples:
            if s.name.endswith("_bucket"):
                continue
            key = "/".join([s.name, *(str(v) for _, v in sorted(s.labels.items()))])
            out[key] = float(s.value)
    return out


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:400]


def _init_args(project: str, start: dict[str, Any]) -> dict[str, Any]:
    run_id, peer = str(start.get("run_id", "")), str(start.get("peer_id", ""))
    digest = hashlib.sha256(f"{run_id}\0{peer}".encode()).hexdigest()[:24]
    config = {k: start.get(k) for k in ("run_id", "peer_id", "model", "device", "parameters", "client_mode")}
    return {"project": project, "group": run_id, "name": peer, "id": f"swarm-{digest}", "resume": "allow",
            "config": config, "reinit": "create_new"}  # fmt: skip
