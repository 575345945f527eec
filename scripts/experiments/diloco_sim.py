"""The one-process DiLoCo simulator every sweep and the GPU efficacy run share.

K workers (swarm nodes), each a `swarm.model.diloco.DiLoCo` over its own copy of
`build_model(preset(model), seed)`, run H inner steps on their own windows (worker i samples
with `node_generator(peer_i, global_inner_step)`, as a `swarm-node` with identity i does), then
average their pseudo-gradients exactly (fp32, weighted by tokens, in worker order; through a codec
of swarm_kernels when the setting names one, as the butterfly all-reduce carries them) and each
applies the average (`apply_outer`). Two baselines see the same windows:

    ddp     one model, the same AdamW, global batch = the K workers' batches concatenated
    alone   one model, the same AdamW, worker 0's batches only

gap_closed = (L_alone - L_diloco) / (L_alone - L_ddp), on `eval_windows(data.eval, seq_len)`.
The baselines run through `DiLoCo.inner_step` with H = the whole run (no outer step ever), so all
three use one optimizer, schedule and clipping.

Where they run is a `Runtime`: the CPU (the sweeps: deterministic with one torch thread) or a GPU
(scripts/experiments/gpu_efficacy.py: DiLoCo's bf16 autocast there, torch.compile optionally).
The data is any `TokenData` (the stdlib corpus, or a `swarm-data prepare` folder); the model's
vocabulary follows it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.model.data import TokenData, eval_windows, node_generator, sample_batch, stdlib_corpus
from swarm.model.diloco import DiLoCo, DiLoCoConfig
from swarm.model.error_feedback import ErrorFeedback
from swarm.model.llama import Llama, build_model
from swarm.model.loss import eval_loss
from swarm.model.presets import preset
from swarm.model.sparse_blocks import BlockSelection, step_seed
from swarm.model.state_hash import tensors_sha256
from swarm.p2p.identity import Identity

IDENTITY_TAG = "swarm.bench_diloco"
CODEC_BLOCK = 64  # the all-reduce's block size (AveragingConfig.block_size)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What every run of one comparison shares: model, data windows, batch and length."""

    model: str = "tiny"
    workers: int = 4  # K: DiLoCo workers (swarm nodes); DDP's global batch is K per-node batches
    steps: int = 1000  # inner steps per worker (= optimizer steps of the baselines)
    batch_size: int = 2  # sequences per worker per inner step
    seq_len: int = 256
    seed: int = 0  # model weights and worker identities
    eval_windows: int = 64
    # the inner schedule every run of the comparison uses (DiLoCo and both baselines): the DiLoCo
    # benchmark's stated protocol is warmup then cosine to 10% at the run's end (steps)
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd only

    def __post_init__(self) -> None:
        for name in ("workers", "steps", "batch_size", "seq_len", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")

    def schedule(self) -> dict[str, Any]:
        """The DiLoCoConfig schedule fields of this workload: a decaying one ends at `steps`."""
        total = None if self.lr_schedule == "constant" else self.steps
        return {"lr_schedule": self.lr_schedule, "total_steps": total, "min_lr_ratio": self.min_lr_ratio,
                "decay_fraction": self.decay_fraction}  # fmt: skip

    def schedule_label(self) -> str:
        if self.lr_schedule == "constant":
            return "constant inner lr after warmup"
        end = f"{self.min_lr_ratio:g}x at step {self.steps}"
        if self.lr_schedule == "wsd":
            return f"wsd inner lr (decay over the last {self.decay_fraction:g}, to {end})"
        return f"cosine inner lr to {end}"

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class HSchedule:
    """Inner steps per outer step: H_k = min(target, start * factor**k); start == target: constant."""

    target: int
    start: int | None = None  # None: constant H = target
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.target < 1 or (self.start is not None and not 1 <= self.start <= self.target) or self.factor < 1:
            raise ValueError(f"bad H schedule {self}: need 1 <= start <= target and factor >= 1")

    @property
    def constant(self) -> bool:
        return self.start is None or self.start == self.target

    def at(self, outer_step: int) -> int:
        if self.start is None:
            return self.target
        return min(self.target, math.floor(self.start * self.factor**outer_step))

    def label(self) -> str:
        return str(self.target) if self.constant else f"{self.start}x{self.factor:g}->{self.target}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One DiLoCo configuration of the sweep."""

    name: str
    h: HSchedule
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    lr: float = 1e-3  # inner AdamW peak learning rate
    warmup_steps: int = 100
    # how pseudo-gradients travel: "none" averages them exactly; a codec ("int8", ...) carries
    # each worker's and the average (as a part owner's result), with error feedback of this
    # decay when > 0 (swarm/model/error_feedback.py)
    codec: str = "none"
    error_feedback: float = 0.0
    density: float = 1.0  # the share of blocks each round carries (swarm/model/sparse_blocks.py)

    def diloco_config(self, workload: Workload) -> DiLoCoConfig:
        return DiLoCoConfig(
            inner_steps=self.h.target, lr=self.lr, warmup_steps=self.warmup_steps, outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum, nesterov=self.nesterov, **workload.schedule(),
        )  # fmt: skip

    def inner_key(self) -> tuple[float, int]:
        """The inner optimizer's settings: the baselines to compare with depend on these alone."""
        return (self.lr, self.warmup_steps)

    def row(self) -> dict[str, Any]:
        return {
            "setting": self.name, "H": self.h.label(), "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "nesterov": self.nesterov, "lr": self.lr,
            "warmup_steps": self.warmup_steps, "codec": self.codec, "error_feedback": self.error_feedback,
            "density": self.density,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class RunResult:
    eval_loss: float
    train_loss: float  # mean training loss over the last 10% of inner steps (worker 0 for DiLoCo)
    seconds: float
    outer_steps: int  # 0 for the baselines
    sha256: str  # θ at the end: equal across reruns with one seed (and across DiLoCo workers)


@dataclass(frozen=True, kw_only=True, slots=True)
class Runtime:
    """Where the models of a comparison train: never part of a result's cache key, since a run's
    figures are the same computation on any device (up to its arithmetic)."""

    device: str = "cpu"
    compile: bool = False  # torch.compile each model in place (what swarm-node --compile does)

    def build(self, workload: Workload, data: TokenData) -> Llama:
        """The workload's model at its seed, on this device, with the data's vocabulary."""
        model = build_model(preset(workload.model, vocab_size=data.vocab_size), seed=workload.seed,
                            device=self.device)  # fmt: skip
        if self.compile:
            model.compile()  # in place: the parameters keep their names
        return model


CPU = Runtime()


# --- the workload's pieces (scripts/bench/diloco.py replays them) ------------------------------------------------


def node_identity(index: int, seed: int = 0) -> Identity:
    """The fixed identity of worker (node) `index`: its PeerID chooses its training windows."""
    return Identity.from_seed(hashlib.sha256(f"{IDENTITY_TAG}:{seed}:{index}".encode()).digest())


def worker_peers(workload: Workload) -> list[bytes]:
    return [node_identity(i, workload.seed).peer_id.to_bytes() for i in range(workload.workers)]


@functools.lru_cache(maxsize=1)
def load_corpus() -> TokenData:
    return stdlib_corpus()


def worker_batch(data: TokenData, workload: Workload, peer: bytes, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch a node with PeerID bytes `peer` trains on at global inner step `step`."""
    return sample_batch(data.train, workload.batch_size, workload.seq_len, node_generator(peer, step))


def inner_config(workload: Workload, lr: float = 1e-3, warmup_steps: int = 100, **overrides: Any) -> DiLoCoConfig:
    """The baselines' inner optimizer: the workload's schedule, as every DiLoCo setting uses."""
    return DiLoCoConfig(lr=lr, warmup_steps=warmup_steps, **{**workload.schedule(), **overrides})


def train_data_parallel(
    data: TokenData, workload: Workload, peers: Sequence[bytes], config: DiLoCoConfig, runtime: Runtime = CPU
) -> RunResult:
    """One model trained for workload.steps AdamW steps on the concatenated batches of `peers`
    (all K: the DDP equivalent; one: a node alone). `config` gives the inner optimizer; its H is
    ignored (the run never takes an outer step)."""
    model = runtime.build(workload, data)
    trainer = DiLoCo(model, dataclasses.replace(config, inner_steps=workload.steps))
    started, losses = time.perf_counter(), []
    for step in range(workload.steps):
        batches = [worker_batch(data, workload, peer, step) for peer in peers]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        losses.append(trainer.inner_step(inputs, targets).loss)
    seconds = time.perf_counter() - started
    windows = eval_windows(data.eval, workload.seq_len, workload.eval_windows)
    return RunResult(eval_loss(model, windows), _tail_mean(losses), seconds, 0, tensors_sha256(trainer.params))


class _ScheduledDiLoCo(DiLoCo):
    """DiLoCo whose H changes between outer steps: its clock counts the inner steps done, not
    outer_step * H. The driver sets `config` (H of this round) and `steps_before` per round."""

    steps_before = 0

    @property
    def global_inner_step(self) -> int:
        return self.steps_before + self.inner_done


def average_deltas(deltas: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """The exact weighted mean of the workers' pseudo-gradients, fp32, summed in worker order."""
    total = float(sum(weights))
    out = [torch.zeros_like(t) for t in deltas[0]]
    for worker, weight in zip(deltas, weights, strict=True):
        scale = weight / total
        for acc, t in zip(out, worker, strict=True):
            acc.add_(t * scale)
    return out


def train_diloco(
    data: TokenData,
    workload: Workload,
    setting: Setting,
    on_outer: Callable[[int, float], None] | None = None,
    runtime: Runtime = CPU,
) -> RunResult:
    """K DiLoCo workers from one initialization, averaging exactly after every round."""
    peers = worker_peers(workload)
    config = setting.diloco_config(workload)
    workers = [_ScheduledDiLoCo(runtime.build(workload, data), config) for _ in peers]
    feedback = [] if setting.codec == "none" else [
        ErrorFeedback(setting.codec, CODEC_BLOCK, setting.error_feedback or 1.0) for _ in peers]  # fmt: skip
    started, losses, done = time.perf_counter(), [], 0
    while done < workload.steps:
        h = min(setting.h.at(workers[0].outer_step), workload.steps - done)
        for worker in workers:
            worker.config = dataclasses.replace(config, inner_steps=h)
            worker.steps_before = done
        for index, (worker, peer) in enumerate(zip(workers, peers, strict=True)):
            for step in range(done, done + h):
                stats = worker.inner_step(*worker_batch(data, workload, peer, step))
                if index == 0:
                    losses.append(stats.loss)
        selection = None
        if setting.density < 1:  # the same blocks for every worker of the round, as in a swarm
            numel = sum(p.numel() for p in workers[0].params)
            selection = BlockSelection.choose(
                numel, CODEC_BLOCK, setting.density, step_seed("sweep", workers[0].outer_step)
            )
        deltas = carry(feedback, [w.pseudo_gradients() for w in workers], keep=setting.error_feedback > 0,
                       selection=selection)  # fmt: skip
        averaged = average_deltas(deltas, [w.tokens_since_outer for w in workers])
        if feedback:  # the owners' results travel through the codec too
            averaged = ErrorFeedback(setting.codec, CODEC_BLOCK).compensate(averaged).sent
        for worker in workers:
            worker.apply_outer(averaged)
        done += h
        if on_outer is not None:
            on_outer(workers[0].outer_step, losses[-1])
    seconds = time.perf_counter() - started
    hashes = {w.outer_sha256() for w in workers}
    if len(hashes) != 1:
        raise AssertionError("DiLoCo workers ended with different θ_outer")
    windows = eval_windows(data.eval, workload.seq_len, workload.eval_windows)
    return RunResult(eval_loss(workers[0].model, windows), _tail_mean(losses), seconds, workers[0].outer_step, *hashes)


def carry(
    feedback: Sequence[ErrorFeedback],
    deltas: list[list[torch.Tensor]],
    *,
    keep: bool,
    selection: BlockSelection | None = None,
) -> list[list[torch.Tensor]]:
    """Each worker's pseudo-gradients as its codec carries them (only the `selection`'s blocks,
    zeros elsewhere, when given), keeping what it drops for the next round when `keep` (error
    feedback); unchanged without a codec."""
    if not feedback:
        return deltas
    sent = []
    for ef, worker in zip(feedback, deltas, strict=True):
        compensated = ef.compensate(worker, selection)
        if keep:
            ef.commit(compensated)
        sent.append(compensated.sent)
    return sent


def gap_closed(alone: float, ddp: float, diloco: float) -> float:
    """(L_alone - L_diloco) / (L_alone - L_ddp): 0 = no better than one node, 1 = as good as DDP."""
    return (alone - diloco) / (alone - ddp) if alone != ddp else float("nan")


def _tail_mean(losses: Sequence[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)
