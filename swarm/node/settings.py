"""The run's settings: what every node of a run must agree on, as one value with one digest and
one comparison, and how a node checks, adopts and ends with them.

    settings = training_settings(config)         # RunSettings: {"inner_steps": 50, ...}, canonical
    settings.digest                              # 32 bytes, the same on every node of equal settings
    problem = disagreement(settings, peers, vouched)   # None, or the line that refuses to start
    adopted = adoptable_settings(theirs, given={"lr"}, ours=settings)   # what a joiner takes from the run

Values are canonical (model/setting_values.py): `outer_lr=1` (swarm.join) and `1.0` (the CLI)
are one setting with one digest, and a bool is never the number 1. Every check compares
through RunSettings: the join check (`disagreement`), adoption (`adoptable_settings`), the
ready records and receipts (`digest`) and the state manifest (checkpoint.py, with the same
model-layer comparison).

Three places carry them, so that a node of other settings can neither train into the run nor
pull the run into its own:
- progress records (`<run>/nodes`, progress.py) carry the whole map: a node that joins compares
  its own with the run's before it trains, and refuses to start with one line that names both
  values of every field that differs;
- matchmaking records and round receipts carry the digest: nodes of other settings that start at
  the same moment (so that neither saw the other's record) never form a group together;
- the state manifest (`RunInfo.settings`): a state made under other settings is refused.

Whose settings are "the run's": those of the peers this node joined through (its
--initial-peers), when they publish a record; else those most of the run's records carry. A
minority of records with other settings does not stop a node that agrees with the run.

The run's end (`max_outer_steps`, RUN_END) is a run setting like the others: the number of outer
steps the swarm trains (steps 0 .. N-1; the run has ended once N are done), published, adopted by
a joiner that was not given it, shown in the join line. How long one volunteer stays is its own,
local `leave_after_steps` (NodeConfig), never a run setting.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from swarm.model import setting_values

# the fields whose values must be equal on every node of a run (NodeConfig names)
FIELDS = (
    "model", "seed", "data", "tokenizer", "inner_steps", "batch_size", "seq_len", "lr", "warmup_steps",
    "lr_schedule", "total_steps", "decay_fraction", "min_lr_ratio", "outer_lr", "outer_momentum", "fragments",
    "compression", "max_outer_steps",
)  # fmt: skip
RUN_END = "max_outer_steps"  # the run's length in outer steps of the swarm (None: until stopped)
FLAGS = {name: "--" + name.replace("_", "-") for name in FIELDS}

CUSTOM_MODEL = "custom"  # NodeConfig.model of a node that trains the caller's own model (swarm.join)
# what every node of a custom-model run must agree on: the rest of FIELDS belong to the caller's
# loop (data, batches, inner optimizer and its schedule), which the swarm does not see
CUSTOM_FIELDS = (
    "model", "inner_steps", "batch_size", "seq_len", "outer_lr", "outer_momentum", "fragments", "compression",
    "max_outer_steps",
)  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)
class RunSettings(Mapping[str, Any]):
    """A run's settings: a read-only map of canonical values, and its digest. Two are equal when
    their digests are (the one comparison: the join check, adoption and matchmaking agree)."""

    canonical: Mapping[str, Any]  # the values, in setting_values.canonical form
    digest: bytes

    @staticmethod
    def of(values: Mapping[str, Any]) -> RunSettings:
        canonical = setting_values.canonical(values)
        return RunSettings(canonical, setting_values.digest(canonical))

    @staticmethod
    def decode(value: Any) -> RunSettings | None:
        """A peer's settings map, or None when it is malformed (bounded: peers' input)."""
        decoded = setting_values.decode_settings(value)
        return None if decoded is None else RunSettings.of(decoded)

    def wire(self) -> dict[str, Any]:
        """The plain map that records and manifests carry."""
        return dict(self.canonical)

    def differences(self, theirs: Mapping[str, Any]) -> list[str]:
        """`--flag their value (this node: ours)` for each setting that differs, in FIELDS order."""
        return setting_values.differences(self.canonical, theirs, FIELDS, lambda n: FLAGS.get(n, n))

    @property
    def run_end(self) -> int | None:
        """The outer steps the run trains (None: until its nodes stop)."""
        end = self.canonical.get(RUN_END)
        return end if isinstance(end, int) and not isinstance(end, bool) and end >= 1 else None

    def __getitem__(self, name: str) -> Any:
        return self.canonical[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.canonical)

    def __len__(self) -> int:
        return len(self.canonical)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunSettings):
            return self.digest == other.digest
        if isinstance(other, Mapping):
            return self.digest == setting_values.digest(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"RunSettings({dict(self.canonical)!r})"


def training_settings(config: Any) -> RunSettings:
    """The run settings of a NodeConfig (or anything with those attributes)."""
    return RunSettings.of({name: _setting(config, name) for name in FIELDS})


def custom_settings(config: Any, *, architecture: str, initial_state: str) -> RunSettings:
    """The run settings of a node that trains a caller's model: CUSTOM_FIELDS, the model's
    architecture (parameter names, shapes, dtypes) and its initial weights, both as digests:
    nodes that would average tensors of other shapes, or start from other weights, never train
    together."""
    return RunSettings.of({**{n: _setting(config, n) for n in CUSTOM_FIELDS}, "architecture": architecture,
                           "initial_state": initial_state})  # fmt: skip


def _setting(config: Any, name: str) -> Any:
    """A field's value; the run's end as the config derives it (NodeConfig.run_end)."""
    if name == RUN_END:
        return getattr(config, "run_end", getattr(config, RUN_END, None))
    return getattr(config, name)


def join_flags(config: Any, defaults: Any) -> str:
    """The flags a joining node needs to train with config's settings: `--model` and every
    setting that differs from `defaults` (a NodeConfig()), each followed by a space."""
    settings, usual = training_settings(config), training_settings(defaults)
    names = ["model"] + [n for n in FIELDS if n != "model" and not same_value(settings[n], usual[n])]
    return "".join(f"{FLAGS[n]} {settings[n]} " for n in names if settings[n] is not None)


same_value = setting_values.same_value


def run_settings(
    peers: Iterable[tuple[Any, Mapping[str, Any] | None]], vouched: frozenset[Any] | set[Any]
) -> RunSettings | None:
    """The run's settings as this node sees them: those of the peers in `vouched` (our
    --initial-peers) when any of them publishes some; else those most records carry (a tie, or
    no settings at all: None)."""
    known = [(peer, _settings(s)) for peer, s in peers if s is not None]
    pool = [s for peer, s in known if peer in vouched] or [s for _, s in known]
    if not pool:
        return None
    (best, n), *rest = Counter(s.digest for s in pool).most_common()
    if rest and rest[0][1] == n:
        return None
    return next(s for s in pool if s.digest == best)


def _settings(value: Mapping[str, Any]) -> RunSettings:
    return value if isinstance(value, RunSettings) else RunSettings.of(value)


CLI_REMEDY = ("Leave these flags out (a joining node adopts the run's settings it is not given), pass the run's "
              "values, or pick another --run-id")  # fmt: skip
API_REMEDY = ("Build the same model from the same seed on every process (torch.manual_seed before building it), "
              "pass the run's values, or pick another run_id")  # fmt: skip
# the run's end differs: a volunteer who means "I stay this long" has its own, local limit
LEAVE_HINT = " To leave the run earlier than its end, use --leave-after-steps (swarm.join: leave_after_steps)"


def disagreement(
    ours: Mapping[str, Any],
    peers: Iterable[tuple[Any, Mapping[str, Any] | None]],
    vouched: frozenset[Any] | set[Any],
    remedy: str = CLI_REMEDY,
) -> str | None:
    """Why this node must not train in this run (None: it may): the line to print. Pure."""
    theirs = run_settings(peers, vouched)
    if theirs is None:
        return None
    diff = _settings(ours).differences(theirs)
    if not diff:
        return None
    hint = LEAVE_HINT if not same_value(ours.get(RUN_END), theirs.get(RUN_END)) else ""
    return "this run trains with other settings: " + "; ".join(diff) + ". " + remedy + hint


def adoptable_settings(
    theirs: Mapping[str, Any] | None, given: set[str] | frozenset[str], ours: Mapping[str, Any]
) -> dict[str, Any]:
    """The settings to take from the run (pure): each known setting not `given` (on the command
    line, in --config, as a swarm.join argument) whose value differs from ours."""
    if theirs is None:
        return {}
    return {n: theirs[n] for n in FIELDS if n in theirs and n not in given and not same_value(theirs[n], ours.get(n))}


def run_end_to_adopt(ours: RunSettings, theirs: RunSettings | None) -> int | None:
    """The run's end for a node that was given none (pure): the run's, when it has one. A node
    with an end of its own keeps it (the join check refuses it when the run's differs)."""
    if ours.run_end is not None or theirs is None:
        return None
    return theirs.run_end


def run_has_ended(
    run_end: int | None, our_step: int, record_steps: Iterable[int], advertised_steps: Iterable[int] = ()
) -> bool:
    """Has the run ended for a node that arrives now (pure)? Its own state (fetched, resumed:
    checked) is at the end, or most of the run's records (of its settings) say they are. With no
    record left (every node has gone), the states its holders still advertise tell, when every
    one is at the end (a joiner that could not fetch such a state trained a lineage of its own
    from step 0 instead, and said "finished"); one behind it may be a live holder that publishes
    no record (a seeder), and the run goes on from it."""
    if run_end is None:
        return False
    if our_step >= run_end:
        return True
    steps = list(record_steps)
    if not steps:
        advertised = list(advertised_steps)
        return bool(advertised) and all(step >= run_end for step in advertised)
    return 2 * sum(step >= run_end for step in steps) > len(steps)


def stop_step(run_end: int | None, leave_after_steps: int | None, joined_at: int) -> int | None:
    """The outer steps done at which this node stops (pure): the run's end, or sooner its own
    `leave_after_steps` counted from the swarm's step at which it joined; None: until stopped."""
    ends = [s for s in (run_end, None if leave_after_steps is None else joined_at + leave_after_steps) if s is not None]
    return min(ends) if ends else None


# names that swarm.model.run_settings had, whose one implementation is now model/setting_values.py
_OLD_NAMES = {"settings_digest": "digest", "decode_settings": "decode_settings", "canonical_value": "canonical_value",
              "canonical": "canonical", "differences": "differences", "MAX_FIELDS": "MAX_FIELDS",
              "MAX_TEXT": "MAX_TEXT"}  # fmt: skip


def __getattr__(name: str) -> Any:
    """The old module's names, for one release, with a DeprecationWarning."""
    if name in _OLD_NAMES:
        import warnings

        warnings.warn(f"swarm.node.settings.{name} is swarm.model.setting_values.{_OLD_NAMES[name]}; the old name goes "
                      "in the next release", DeprecationWarning, stacklevel=2)  # fmt: skip
        return getattr(setting_values, _OLD_NAMES[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
