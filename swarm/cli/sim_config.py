"""What one swarm-sim run is: its settings, checked before any process starts, and the demo's defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from swarm.model.schedule import DEFAULT_DECAY_FRACTION, DEFAULT_WARMUP_STEPS, schedule_problem
from swarm.netlab import NAT_KINDS, Rate

# swarm.model.presets.PRESETS and swarm.averaging.config.CODECS, written out: importing either pulls in
# torch, seconds before a bad flag can be answered (tests/cli/test_sim.py checks that they match)
MODELS = ("debug", "tiny", "small", "150m", "1b")
CODECS = ("int8", "int4", "int2", "fp16", "none")

# The demo (`swarm-sim` with no options), sized to finish in about a minute on a 2-core laptop CPU.
DEFAULT_NODES = 3
DEFAULT_OUTER_STEPS = 10
DEFAULT_INNER_STEPS = 20
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 64


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """One simulation; the click options map 1:1 onto it."""

    nodes: int  # started at once
    model: str
    outer_steps: int  # every node runs with --max-outer-steps this
    inner_steps: int
    batch_size: int
    seq_len: int
    compression: str
    seed: int  # the model's init seed (the same on every node) and the churn's random choices
    lr: float | None  # None: swarm-node's default
    warmup_steps: int | None  # None: swarm-node's default
    matchmaking_time: float | None  # None: swarm-node's default
    max_group_size: int | None
    part_timeout: float | None  # None: swarm-node's default
    kill_every: float | None  # seconds between SIGKILLs of a random running node; None: never
    join_every: float | None  # seconds between newcomers; None: never
    threads: int  # torch threads per node
    run_dir: Path  # node logs and metrics files
    metrics_out: Path
    plot_out: Path
    timeout: float | None  # the whole run; None: until the nodes finish
    verbose: int
    lr_schedule: str = "constant"  # swarm-node's default; cosine / wsd end at total_steps
    total_steps: int | None = None  # None with a decaying schedule: the whole run, outer_steps x inner_steps
    decay_fraction: float | None = None  # None: swarm-node's default
    link: Rate | None = None  # every node (newcomers too) and the bootstrap on a link of this rate
    links: tuple[Rate, ...] | None = None  # one rate per starting node; the bootstrap gets the fastest
    dashboard: int | None = None  # --dashboard [PORT]: serve the run's dashboard on 127.0.0.1 (0: any port)
    overlap: str = "none"  # swarm-node's --overlap: none (blocking), eager, delayed
    data: str = "stdlib"  # swarm-node's --data: the built-in corpus, or a prepared folder (its URL)
    # --nat cone:2,symmetric:2: home networks (NAT kind, nodes behind it), the nodes in that order;
    # the bootstrap (which relays) is the one public endpoint. None: no NAT
    nat: tuple[tuple[str, int], ...] | None = None

    def __post_init__(self) -> None:
        self._check_nat()
        if min(self.nodes, self.outer_steps, self.inner_steps, self.batch_size, self.seq_len, self.threads) < 1:
            raise ValueError("nodes, steps, batch size, sequence length and threads must be >= 1")
        if self.link is not None and self.links is not None:
            raise ValueError("give --link (one rate for all) or --links (one per node), not both")
        if self.links is not None and len(self.links) != self.nodes:
            raise ValueError(
                f"--links has {len(self.links)} rate(s) for {self.nodes} nodes: give one per node (--nodes), "
                "or one rate for all with --link"
            )
        if self.dashboard is not None and (self.link is not None or self.links is not None):
            raise ValueError("--dashboard reads the swarm from 127.0.0.1: it cannot reach nodes behind --link/--links")
        if self.links is not None and self.join_every is not None:
            raise ValueError(
                "--links gives the starting nodes their rates, not newcomers: use --link with --join-every"
            )
        total = (
            self.total_steps
            if self.lr_schedule == "constant"
            else self.total_steps or self.outer_steps * self.inner_steps
        )
        warmup = DEFAULT_WARMUP_STEPS if self.warmup_steps is None else self.warmup_steps
        fraction = DEFAULT_DECAY_FRACTION if self.decay_fraction is None else self.decay_fraction
        problem = schedule_problem(self.lr_schedule, warmup, total, fraction)
        if problem is not None:  # before any node starts (each would refuse it alone)
            if self.total_steps is None and total is not None:
                problem += f" (--total-steps defaults to the whole run: --outer-steps x --inner-steps = {total})"
            raise ValueError(problem)

    def _check_nat(self) -> None:
        if self.nat is None:
            return
        if sum(n for _, n in self.nat) != self.nodes:
            raise ValueError(f"--nat puts {sum(n for _, n in self.nat)} node(s) in homes, --nodes says {self.nodes}")
        others = (("--links", self.links), ("--dashboard", self.dashboard))
        for flag, value in others:
            if value is not None:
                raise ValueError(f"--nat places every node in a home network: not with {flag}")

    def home_of(self, index: int) -> int:
        """--nat: the home network (its index in `nat`) of the index-th node; newcomers
        (--join-every, beyond --nodes) go to the homes in turn."""
        assert self.nat is not None
        if index < 0:
            raise IndexError(f"no node {index}")
        if index >= self.nodes:
            return (index - self.nodes) % len(self.nat)
        end = 0
        for home, (_, count) in enumerate(self.nat):
            end += count
            if index < end:
                return home
        raise AssertionError("the homes hold --nodes nodes (checked when built)")

    def rate(self, index: int | None) -> Rate | None:
        """The link of the index-th node (None: the bootstrap); None on 127.0.0.1."""
        if self.links is not None:
            return max(self.links) if index is None else self.links[index]
        return self.link


PUBLIC = "public"  # --nat public:N: N nodes on the lab's internet, reachable by everyone


def parse_nat(text: str) -> tuple[tuple[str, int], ...]:
    """`cone:2,cone:2,symmetric:2` -> (("cone", 2), ("cone", 2), ("symmetric", 2)): one home
    network per item, its NAT's kind and the nodes behind it (`public`: nodes on the internet
    side, no NAT). ValueError with the reason."""
    homes = []
    for item in text.replace(" ", "").split(","):
        kind, _, count = item.partition(":")
        if kind not in (*NAT_KINDS, PUBLIC):
            raise ValueError(f"--nat {item!r}: the kind is one of {', '.join((*NAT_KINDS, PUBLIC))} (e.g. cone:2)")
        if not count.isdigit() or not 1 <= int(count) <= 64:
            raise ValueError(f"--nat {item!r}: give 1 to 64 nodes behind each NAT, as KIND:N")
        homes.append((kind, int(count)))
    if not 1 <= len(homes) <= 32:
        raise ValueError("--nat lists 1 to 32 home networks")
    return tuple(homes)
