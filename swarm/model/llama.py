"""A Llama-style decoder, written plainly in torch (after nanoGPT and torchtitan's llama3/model.py).

    model = build_model(ModelConfig(dim=128, n_layers=6, n_heads=4), seed=1234)
    logits = model(tokens)  # tokens: int64 [batch, seq] -> logits: [batch, seq, vocab]

Pre-norm blocks: x + Attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)). Rotary position
embeddings (Su et al. 2021, the "rotate half" form used by Llama and Hugging Face), optional
grouped-query attention (Ainslie et al. 2023: `n_kv_heads` < `n_heads`, each key/value head
shared by n_heads / n_kv_heads query heads), causal attention through
`F.scaled_dot_product_attention`, no biases, tied or untied input/output embeddings.

Initial weights are a pure function of the run's seed (`build_model`): the model is built on the
meta device, so the global RNG is never touched, and every parameter is drawn on the CPU from its
own `torch.Generator`, seeded from (seed, parameter name). Every node that starts a run from
scratch therefore holds bit-identical weights, whatever its device, dtype or thread count.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from swarm.model.configs import ModelConfig

__all__ = ["Llama", "ModelConfig", "build_model", "count_parameters"]


def count_parameters(config: ModelConfig) -> int:
    """The number of distinct parameters `build_model(config, ...)` has, without building it."""
    d, kv = config.dim, config.kv_heads * config.head_dim
    attention = 2 * d * d + 2 * d * kv  # wq, wo; wk, wv
    ffn = 3 * d * config.hidden_dim  # w1 (gate), w3 (up), w2 (down)
    block = attention + ffn + 2 * d  # two RMSNorm weights
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return config.n_layers * block + embeddings + d  # + the final RMSNorm


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich 2019), computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_seq_len, head_dim], for `apply_rotary` (fp32, computed on the CPU)."""
    cpu = torch.device("cpu")  # explicit: these ops under the meta device cost seconds of imports
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=cpu) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=cpu), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + head_dim/2]) of x [batch, heads, seq, head_dim] by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:  # grouped-query attention: share each kv head
            repeats = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The decoder. Build it with `build_model` (seeded weights); the constructor leaves the
    weights to `init_weights` so that it can run on the meta device."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # _weight skips nn.Embedding's own init: normal_ under the meta device costs seconds of imports
        self.tok_embeddings = nn.Embedding(
            config.vocab_size, config.dim, _weight=torch.empty(config.vocab_size, config.dim)
        )
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # derived, so not in the state dict
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection (again: materializing the meta model unties it)."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens is longer than max_seq_len={self.config.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Set every parameter and buffer from `seed` alone (see the module docstring)."""
        residual_std = self.config.init_std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():  # a tied weight appears once
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            residual = name.endswith(("attention.wo.weight", "feed_forward.w2.weight"))
            values = torch.empty(param.shape, dtype=torch.float32)  # drawn on the CPU, in fp32, always
            values.normal_(0.0, residual_std if residual else self.config.init_std, generator=_generator(seed, name))
            param.copy_(values)
        cos, sin = rotary_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)


def build_model(
    config: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Llama:
    """A Llama whose weights depend only on (config, seed). Pass device="meta" for a shape-only
    model (no memory, no init), to count or plan a large preset."""
    with torch.device("meta"):
        model = Llama(config)
    if torch.device(device).type == "meta":
        return model.to(dtype=dtype)
    # torch.empty per tensor, not Module.to_empty: its empty_like of a meta tensor goes through
    # torch's Python decompositions, whose first use imports sympy (0.45 s of every node's start)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.tie_weights()
    model.init_weights(seed)
    return model.to(dtype=dtype)


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"swarm.model.init:{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
