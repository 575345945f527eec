"""The model layer's configs, with no torch import, so that the presets and the command line's
checks load in a moment: ModelConfig (the Llama-style decoder's shape, llama.py), DiLoCoConfig
(diloco.py) and the state's default shard size (checkpoint.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarm.model.schedule import DEFAULT_DECAY_FRACTION, DEFAULT_WARMUP_STEPS, schedule_problem

DEFAULT_SHARD_BYTES = 64 << 20  # the state's shards (checkpoint.py)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    vocab_size: int = 256  # 256: byte-level tokens (the built-in corpus)
    dim: int  # width of the residual stream
    n_layers: int
    n_heads: int  # query heads; head_dim = dim // n_heads (must be even for rotary embeddings)
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: = n_heads
    ffn_dim: int | None = None  # SwiGLU hidden width; None: 8/3 * dim rounded up to multiple_of
    multiple_of: int = 64
    max_seq_len: int = 512  # longest sequence the rotary tables cover
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # the output projection reuses the token embedding matrix
    init_std: float = 0.02  # residual output projections are further scaled by 1/sqrt(2 * n_layers)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim // n_heads must be even for rotary embeddings, got {self.head_dim}")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must be positive and divide n_heads ({self.n_heads})")
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            raise ValueError(f"ModelConfig.ffn_dim must be positive, got {self.ffn_dim}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return self.multiple_of * math.ceil(8 * self.dim / 3 / self.multiple_of)


@dataclass(frozen=True, kw_only=True, slots=True)
class DiLoCoConfig:
    inner_steps: int = 100  # H: inner steps per outer step
    # inner AdamW; the schedule runs on the swarm's clock: outer_step * H + inner steps done
    lr: float = 1e-3  # peak inner learning rate
    warmup_steps: int = DEFAULT_WARMUP_STEPS  # linear warmup from lr / warmup_steps to lr
    lr_schedule: str = "constant"  # after warmup: one of SCHEDULES (schedule.inner_lr)
    total_steps: int | None = None  # cosine / wsd: lr * min_lr_ratio from this step on
    decay_fraction: float = DEFAULT_DECAY_FRACTION  # wsd: the decay takes this last fraction of total_steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1  # on matrices only (not norms)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0  # max global gradient norm; None: no clipping
    # outer SGD (the DiLoCo paper's defaults)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    offload_outer: bool = False  # keep θ_outer and momentum in CPU memory (saves accelerator memory)
    # Streaming DiLoCo: outer step s syncs fragment s mod P of the parameters alone (fragments.py)
    fragments: int = 1

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ValueError(f"DiLoCoConfig.inner_steps must be >= 1, got {self.inner_steps}")
        for name in ("lr", "outer_lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"DiLoCoConfig.{name} must be a positive number, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"DiLoCoConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        problem = schedule_problem(self.lr_schedule, self.warmup_steps, self.total_steps, self.decay_fraction)
        if problem is not None:
            raise ValueError(problem)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"DiLoCoConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0 or not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError("need weight_decay >= 0 and two betas in [0, 1)")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"DiLoCoConfig.grad_clip must be positive or None, got {self.grad_clip}")
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"DiLoCoConfig.fragments must be an int >= 1, got {self.fragments!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"DiLoCoConfig.outer_momentum must be in [0, 1), got {self.outer_momentum}")
