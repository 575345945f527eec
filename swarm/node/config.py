"""NodeConfig: everything a training node is told (swarm-node's flags), checked when built.
No torch import at load (only to check an explicit --device): swarm-node's flag errors come in a
moment."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.averaging.config import CODECS, AveragingConfig
from swarm.dht.run_keys import check_run_id
from swarm.model.compression_spec import CompressionSpec
from swarm.model.configs import DEFAULT_SHARD_BYTES, DiLoCoConfig
from swarm.model.presets import PRESETS
from swarm.model.schedule import DEFAULT_DECAY_FRACTION, DEFAULT_WARMUP_STEPS
from swarm.node.settings import CUSTOM_MODEL, training_settings
from swarm.state.config import FetchConfig, KeeperConfig

if TYPE_CHECKING:
    import torch

OVERLAP_MODES = ("none", "eager", "delayed")
CATCH_UP_MODES = ("update", "state")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    run_id: str = "swarm"
    model: str = "tiny"
    data: str = "stdlib"
    tokenizer: str | None = None
    seed: int = 0  # the run's initial weights are a function of this alone
    # DiLoCo
    # H; 50 closed more of the gap to DDP than 100 in short runs (scripts/experiments/diloco_sweep.py)
    inner_steps: int = 50
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    # constant: a volunteer run has no planned end, and a decaying schedule needs one (total_steps)
    lr_schedule: str = "constant"
    total_steps: int | None = None  # cosine / wsd: the run's length in inner steps (the swarm's clock)
    decay_fraction: float = DEFAULT_DECAY_FRACTION  # wsd: the cool-down's share of total_steps
    min_lr_ratio: float = 0.1  # cosine / wsd: the rate at total_steps, as a fraction of lr
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1  # Streaming DiLoCo: outer step s syncs fragment s mod P alone (model/fragments.py)
    # averaging
    compression: str = "int8"
    # error feedback (model/error_feedback.py): what the codec dropped from our pseudo-gradient is
    # added to the next one, the residual decayed by this factor each step; 0: off
    error_feedback: float = 0.0
    max_group_size: int = 64  # largest flat all-reduce; beyond it the one group averages hierarchically
    matchmaking_time: float = 5.0
    part_timeout: float = 60.0  # longest wait for a member's slice (a member that died before sending)
    # MB/s announced for the all-reduce's split; None (the default): measured in our rounds, and
    # our uploads paced by it (averaging/rounds/bandwidth.py): rounds on unequal links end sooner
    bandwidth: float | None = None
    max_wait: float = 30.0  # longest a node that finished waits for slower peers of its step
    # the outer step's round while the next inner steps train (node/loop.py): "none" (blocking),
    # "eager" (the next steps start from our own Δ's outer step) or "delayed" (from where we
    # ended). Local: members of any mode agree bit for bit (DiLoCo.apply_outer)
    overlap: str = "none"
    # with overlap: the next step trains from the end of our inner steps, while the wait for
    # slower peers and the matchmaking go on (once the swarm is together: plan.swarm_together),
    # not only from the moment our group has formed. Off by default: the evidence for it is six
    # pairs of runs of one tiny model on one machine (docs, "Overlapping the wait for the group")
    overlap_matchmaking: bool = False
    # nodes (this one included) that start a new run together: at the run's first step the node
    # waits for this many live ones before it trains (at most START_WAIT_S; 1: no wait). Local
    start_with: int = 1
    # how a node one outer step behind catches up: "update" (the step's update from its holders,
    # swarm/state/update.py, then the whole state if that fails) or "state" (always the whole state)
    catch_up: str = "update"
    client_mode: bool = False
    # run
    # the run's length, a run setting: the outer steps the swarm trains (steps 0 .. N-1), the
    # same on every node (a joiner not given it takes the run's); None: until its nodes stop, or
    # where a decaying schedule sets total_steps, as many as it spans (run_end)
    max_outer_steps: int | None = None
    # local: this node leaves once the swarm has done this many outer steps since it joined (or
    # resumed); the run goes on without it. None: it stays until the run's end
    leave_after_steps: int | None = None
    device: str = "auto"  # "auto": cuda when present
    offload_outer: bool = False
    # torch.compile the model (inner steps and evals): on an H200 about twice the tokens/s of
    # eager bf16 for 150m (scripts/experiments/gpu_check.py), after a compile at the start. Local: not a run
    # setting (members of one group may differ), like device
    compile: bool = False
    eval_every: int = 1  # outer steps between eval losses (and always at the last one)
    eval_windows: int = 32
    publish_interval: float = 3.0  # seconds between progress records in the DHT
    # state
    checkpoint_dir: str | None = None  # local checkpoints (resume after a crash); None: none
    checkpoint_every: int = 1  # outer steps between local checkpoints
    shard_bytes: int = DEFAULT_SHARD_BYTES
    fetch_timeout: float = 120.0  # one shard's wait, and the manifest's
    max_uploads: int = 4  # shards served at once

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.model not in PRESETS and self.model != CUSTOM_MODEL:
            raise ValueError(f"unknown model {self.model!r}: choose one of {', '.join(PRESETS)}")
        self.compression_spec()  # raises on an unknown codec or a bad density
        positive = ("inner_steps", "batch_size", "seq_len", "eval_every", "eval_windows", "max_group_size",
                    "checkpoint_every", "shard_bytes", "max_uploads", "fragments", "start_with")  # fmt: skip
        for name in positive:
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.model in PRESETS and self.seq_len > PRESETS[self.model].max_seq_len:
            limit = PRESETS[self.model].max_seq_len
            raise ValueError(f"seq_len {self.seq_len} exceeds the {self.model} model's {limit}")
        for name in ("max_outer_steps", "leave_after_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 (or None), got {value!r}")
        for name in ("matchmaking_time", "publish_interval", "fetch_timeout", "part_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.bandwidth is not None and not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"bandwidth must be a positive number of MB/s (or None: measured), got {self.bandwidth}")
        if self.catch_up not in CATCH_UP_MODES:
            raise ValueError(f"catch_up must be one of {', '.join(CATCH_UP_MODES)}, got {self.catch_up!r}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap!r}")
        if self.overlap_matchmaking and self.overlap == "none":
            raise ValueError("overlap_matchmaking overlaps the wait for a group with the next step: "
                             "it needs overlap eager or delayed")  # fmt: skip
        if not 0.0 <= self.error_feedback <= 1.0:
            raise ValueError(f"error_feedback is a decay in [0, 1] (0: off), got {self.error_feedback}")
        if self.error_feedback > 0 and self.fragments > 1:  # its residual is of the whole model's Δ
            raise ValueError("error feedback keeps one residual of the whole model: not yet with fragments > 1")
        if not (math.isfinite(self.max_wait) and self.max_wait >= 0):
            raise ValueError("max_wait must be a number of seconds >= 0")
        if self.device != "auto":
            import torch

            torch.device(self.device)  # raises on nonsense
        self.diloco_config()  # checks lr, outer lr and momentum, warmup, the schedule

    def compression_spec(self) -> CompressionSpec:
        """`compression` as CODEC[:DENSITY] (model/compression.py)."""
        return CompressionSpec.parse(self.compression, CODECS)

    def diloco_config(self) -> DiLoCoConfig:
        return DiLoCoConfig(
            inner_steps=self.inner_steps,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            lr_schedule=self.lr_schedule,
            total_steps=self.total_steps,
            decay_fraction=self.decay_fraction,
            min_lr_ratio=self.min_lr_ratio,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            fragments=self.fragments,
            offload_outer=self.offload_outer,
        )

    def averaging_config(self, client_mode: bool, settings: bytes | None = None) -> AveragingConfig:
        """`settings`: the digest of the node's run settings (default: this config's own; a
        custom model's node hands in its own, settings.custom_settings)."""
        return AveragingConfig(
            settings=settings if settings is not None else training_settings(self).digest,
            max_group_size=self.max_group_size,
            matchmaking_time=self.matchmaking_time,
            part_timeout=self.part_timeout,
            codec=self.compression_spec().codec,
            client_mode=client_mode,
            max_weight=self.max_weight,
            measure_bandwidth=self.bandwidth is None,
            **({} if self.bandwidth is None else {"bandwidth": self.bandwidth}),
        )

    def keeper_config(self) -> KeeperConfig:
        """The state keeper's tunables (swarm/state/config.py) from these flags."""
        return KeeperConfig(
            shard_bytes=self.shard_bytes,
            checkpoint_every=self.checkpoint_every,
            max_uploads=self.max_uploads,
            fetch=FetchConfig(timeout=self.fetch_timeout),
            by_update=self.catch_up == "update",
        )

    @property
    def run_end(self) -> int | None:
        """The outer steps the run trains: max_outer_steps, or where a decaying schedule ends
        (total_steps inner steps, rounded up to whole outer steps); None: until its nodes stop."""
        if self.max_outer_steps is not None:
            return self.max_outer_steps
        if self.lr_schedule != "constant" and self.total_steps is not None:
            return math.ceil(self.total_steps / self.inner_steps)
        return None

    @property
    def max_weight(self) -> float:
        """The most a member may contribute to one outer step: the tokens of H inner steps at the
        run's batch size and sequence length: a peer announcing more would own the average."""
        return float(self.inner_steps * self.batch_size * self.seq_len)

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
