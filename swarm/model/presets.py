"""Named model sizes for `--model`. Counts are for the byte-level vocabulary (256 tokens); a
Hugging Face tokenizer changes only `vocab_size` (`preset(name, vocab_size=...)`).

    name    params   shape                                         meant for
    debug   0.12M    dim 64, 2 layers, 2 heads, ffn 192            the swarm's mechanics (tests, demos on a busy
                                                                   machine): an inner step 4x cheaper than tiny's
    tiny    1.31M    dim 128, 6 layers, 4 heads, ffn 384           a laptop CPU: loss falls in minutes
    small   25.8M    dim 512, 8 layers, 8 heads, ffn 1408          a CPU overnight, or any GPU
    150m    154M     dim 1024, 12 layers, 16 heads, ffn 2816       one GPU
    1b      0.97B    dim 2048, 16 layers, 32 heads / 8 kv, ffn 8192  a large GPU (Llama 3.2 1B's shape)

`tests/model/test_presets.py` pins each count to its range.
"""

from __future__ import annotations

import dataclasses

from swarm.model.configs import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # torchtitan's "debugmodel" has the same job: every code path of a real model at the least CPU
    "debug": ModelConfig(dim=64, n_layers=2, n_heads=2, max_seq_len=512),
    "tiny": ModelConfig(dim=128, n_layers=6, n_heads=4, max_seq_len=512),
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, max_seq_len=1024),
    "150m": ModelConfig(dim=1024, n_layers=12, n_heads=16, ffn_dim=2816, max_seq_len=2048),
    "1b": ModelConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, max_seq_len=2048, rope_theta=500_000.0
    ),
}


def preset(name: str, **overrides: object) -> ModelConfig:
    """The preset `name`, with any ModelConfig field replaced (e.g. vocab_size for a tokenizer)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)
