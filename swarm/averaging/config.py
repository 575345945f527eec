"""AveragingConfig: group formation and all-reduce parameters, checked when built."""

from __future__ import annotations

import math
from dataclasses import dataclass

CODECS = ("int8", "int4", "int2", "fp16", "none")
# int4 / int2 pack 2 / 4 codes a byte, so their block_size must be a multiple of that (this module
# stays free of torch: swarm_kernels.lowbit_reference.FORMATS says the same, a test checks it)
CODES_PER_BYTE = {"int4": 2, "int2": 4}
AGGREGATORS = ("robust", "mean")


@dataclass(frozen=True, kw_only=True, slots=True)
class AveragingConfig:
    # matchmaking
    # Every node ready for a step averages in one group (one swarm, one state). A group larger than
    # max_group_size averages through the hierarchical butterfly (rows of at most this many
    # members, then columns): the same bytes per member, about 2*sqrt(n) peers each.
    max_group_size: int = 64
    min_group_size: int = 2  # fewer members (after failures too): the round fails cleanly
    matchmaking_time: float = 5.0  # how long nodes gather for a step before groups are formed
    request_timeout: float = 5.0  # one matchmaking request; also how long a leader waits for joins
    # all-reduce
    codec: str = "int8"
    # int8 / int4 / int2 codecs: elements per scale (int8 at 64: 1/4 of hivemind's error for 6% more bytes)
    block_size: int = 64
    # elements per chunk on the wire (256 KiB of int8), the grain at which an owner answers as
    # slices arrive (stream_parts): at 2M, a part of a few million elements was one or two chunks,
    # and a 10 Mbit/s member's slow slice held back the whole part (4M elements at 100,100,100,10
    # Mbit/s split by the links' rates: 6.41 s, against 4.49-4.61 s at 256K)
    chunk_elements: int = 1 << 18
    # an owner answers each chunk of its part as soon as every sender's bytes of it are in, while
    # the rest still arrives (rounds/reduction.py); False: only once the whole part is reduced
    stream_parts: bool = True
    bandwidth: float = 100.0  # MB/s this node announces; parts are split in proportion to it
    # announce what our rounds measured instead (rounds/bandwidth.py), `bandwidth` until one has
    measure_bandwidth: bool = False
    client_mode: bool = False  # accepts no inbound connections: owns no part, still contributes
    # how a part owner reduces the contributions: "robust" (robust.py: non-finite and absurd
    # ones dropped, far ones clipped, the mean when nobody is an outlier) or "mean" (the exact
    # weighted mean: one bad member moves the result anywhere)
    aggregator: str = "robust"
    # the owner audit (audit/flat.py, audit/grid.py): members check every part owner's robust
    # reduction after each round; only with the robust aggregator
    audit: bool = True
    part_timeout: float = 60.0  # bound on each wait of the all-reduce (a chunk, a peer's result)
    max_elements: int = 1 << 33  # largest vector a peer may ask us to reduce
    # the largest weight a member may announce: what the run allows one step (the tokens of H inner
    # steps at the run's batch size and sequence length; the node sets it). Announcements above it are
    # ignored, groups listing one are refused, and weights count at most this much.
    max_weight: float = math.inf
    # the digest of the run's settings (model/run_settings.py) ready records must carry to count;
    # b"": not checked (the averaging used alone, in tests and benchmarks)
    settings: bytes = b""

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"AveragingConfig.codec must be one of {CODECS}, got {self.codec!r}")
        if self.aggregator not in AGGREGATORS:
            raise ValueError(f"AveragingConfig.aggregator must be one of {AGGREGATORS}, got {self.aggregator!r}")
        if not 1 <= self.min_group_size <= self.max_group_size:
            raise ValueError("need 1 <= min_group_size <= max_group_size")
        if self.max_group_size < 2:
            raise ValueError("AveragingConfig.max_group_size must be >= 2")
        for name in ("matchmaking_time", "request_timeout", "part_timeout", "bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AveragingConfig.{name} must be positive")
        if not self.max_weight > 0:
            raise ValueError("AveragingConfig.max_weight must be positive")
        if self.block_size <= 0 or self.chunk_elements <= 0 or self.chunk_elements % self.block_size:
            raise ValueError("chunk_elements must be a positive multiple of block_size")
        if self.block_size % CODES_PER_BYTE.get(self.codec, 1):
            raise ValueError(
                f"AveragingConfig.block_size must be a multiple of {CODES_PER_BYTE[self.codec]} for {self.codec}"
            )
