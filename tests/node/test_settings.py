"""The run's settings (swarm/node/settings.py): whose settings are the run's, what a node of
other settings is told, the join line's flags, bounded decoding of peers' maps, one canonical
form for the digest and every comparison, and the run's end."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.model.checkpoint import IncompatibleState, Manifest, RunInfo
from swarm.node.config import NodeConfig
from swarm.node.settings import (
    RunSettings,
    adoptable_settings,
    disagreement,
    join_flags,
    run_end_to_adopt,
    run_has_ended,
    run_settings,
    stop_step,
    training_settings,
)


def settings_digest(settings: dict) -> bytes:
    return RunSettings.of(settings).digest


def decode_settings(value: object) -> dict | None:
    decoded = RunSettings.decode(value)
    return None if decoded is None else decoded.wire()


OURS = training_settings(NodeConfig())
COSINE = training_settings(NodeConfig(lr_schedule="cosine", total_steps=1000))
WSD = training_settings(NodeConfig(lr_schedule="wsd", total_steps=1000))


@pytest.mark.parametrize(
    ("peers", "vouched", "refused"),
    [
        ([], set(), False),  # nobody publishes yet: nothing to disagree with
        ([("a", None), ("b", None)], set(), False),  # records without settings (older nodes)
        ([("a", OURS), ("b", OURS)], set(), False),
        ([("a", COSINE)], set(), True),
        ([("a", COSINE), ("b", COSINE), ("c", OURS)], set(), True),  # most records: the run's
        ([("a", OURS), ("b", OURS), ("x", COSINE)], set(), False),  # a minority is not the run
        ([("a", COSINE), ("b", OURS)], set(), False),  # a tie: no run settings known
        ([("a", COSINE), ("x", OURS), ("y", OURS)], {"a"}, True),  # our --initial-peers decide
        ([("a", OURS), ("x", COSINE), ("y", COSINE)], {"a"}, False),  # even against a majority
        ([("a", None), ("x", COSINE)], {"a"}, True),  # a vouched peer that says nothing: the records
    ],
)
def test_whose_settings_are_the_runs(peers: list, vouched: set, refused: bool) -> None:
    assert (disagreement(OURS, peers, vouched) is not None) == refused


def test_the_refusal_names_both_values_of_each_field_that_differs() -> None:
    problem = disagreement(OURS, [("a", WSD)], set())
    assert problem is not None
    assert "--lr-schedule 'wsd' (this node: 'constant')" in problem
    assert "--total-steps 1000 (this node: None)" in problem
    assert "--lr " not in problem  # equal fields are not named


def test_the_run_settings_are_those_most_records_carry() -> None:
    assert run_settings([("a", COSINE), ("b", COSINE), ("c", OURS), ("d", None)], set()) == COSINE


def test_numbers_that_msgpack_hands_back_as_another_type_still_agree() -> None:
    assert disagreement({"lr": 1.0, "seed": 0}, [("a", {"lr": 1, "seed": 0.0})], set()) is None


def test_the_join_line_carries_every_setting_that_is_not_the_default() -> None:
    flags = join_flags(NodeConfig(inner_steps=10, batch_size=4, lr_schedule="cosine", total_steps=500), NodeConfig())
    # the run's end is where the cosine schedule ends (500 inner steps of 10): joiners stop there too
    assert (
        flags == "--model tiny --inner-steps 10 --batch-size 4 --lr-schedule cosine --total-steps 500 "
        "--max-outer-steps 50 "
    )
    assert join_flags(NodeConfig(), NodeConfig()) == "--model tiny "


def test_equal_settings_have_one_digest() -> None:
    assert settings_digest(OURS) == settings_digest(dict(reversed(list(OURS.items()))))
    assert settings_digest(OURS) != settings_digest(COSINE)


@pytest.mark.parametrize(
    "value",
    [None, "cosine", [1], {"a": [1]}, {"a": {"b": 1}}, {"a": float("inf")}, {"a": "x" * 200},
     {str(i): i for i in range(33)}, {1: 2}],
)  # fmt: skip
def test_malformed_settings_from_a_peer_are_none(value: object) -> None:
    assert decode_settings(value) is None


def test_well_formed_settings_decode() -> None:
    assert decode_settings(COSINE.wire()) == COSINE


@pytest.mark.parametrize(
    ("theirs", "given", "adopted"),
    [
        (None, set(), {}),  # the run says nothing: our own settings
        (OURS, set(), {}),  # the same: nothing to adopt
        (COSINE, set(), {"lr_schedule": "cosine", "total_steps": 1000, "max_outer_steps": 20}),
        # a given flag is never overridden (it is refused later)
        (COSINE, {"lr_schedule", "max_outer_steps"}, {"total_steps": 1000}),
        ({**COSINE, "unknown": 1}, set(), {"lr_schedule": "cosine", "total_steps": 1000, "max_outer_steps": 20}),
    ],
)
def test_a_joining_node_adopts_every_setting_it_was_not_given(theirs: dict | None, given: set, adopted: dict) -> None:
    assert adoptable_settings(theirs, given, OURS) == adopted


def _manifest_refuses(ours: dict, theirs: dict) -> bool:
    """Does a node of settings `ours` refuse a state whose manifest says `theirs`?"""
    run = RunInfo(run_id="r", model="tiny", model_config={})
    manifest = Manifest(dataclasses.replace(run, settings=theirs), 0, ())
    try:
        manifest.check_usable_by(dataclasses.replace(run, settings=ours))
    except IncompatibleState:
        return True
    return False


@pytest.mark.parametrize(
    ("ours", "theirs", "equal"),
    [
        ({"outer_lr": 1}, {"outer_lr": 1.0}, True),  # swarm.join(outer_lr=1) against the CLI's 1.0
        ({"seed": 0}, {"seed": 0.0}, True),  # msgpack may hand back 0.0 for 0
        ({"outer_momentum": 0}, {"outer_momentum": 0.0}, True),
        ({"max_outer_steps": 10}, {"max_outer_steps": 10.0}, True),
        ({"outer_lr": 0.7}, {"outer_lr": 0.7000001}, False),
        ({"lr": 1e-3}, {"lr": 0.001}, True),
        ({"total_steps": None}, {"total_steps": 0}, False),
        ({"max_outer_steps": None}, {"max_outer_steps": 10}, False),
        ({"fragments": True}, {"fragments": 1}, False),  # a bool is not the number 1
        ({"fragments": 1.0}, {"fragments": True}, False),
        ({"inner_steps": 2**60 + 1}, {"inner_steps": 2**60}, False),  # ints past a float's precision
        ({"model": "tiny"}, {"model": "tiny "}, False),
    ],
)
def test_one_comparison_for_the_digest_the_join_check_adoption_and_the_manifest(
    ours: dict, theirs: dict, equal: bool
) -> None:
    """The digest (matchmaking, receipts), the join check, adoption and the state manifest compare
    settings one way: two nodes the join check lets into one run share a digest (or they never
    group), adopt nothing from each other and use each other's states."""
    assert (settings_digest(ours) == settings_digest(theirs)) == equal
    assert (RunSettings.of(ours) == RunSettings.of(theirs)) == equal
    assert (disagreement(ours, [("a", theirs)], set()) is None) == equal
    assert (adoptable_settings(theirs, set(), ours) == {}) == equal
    assert _manifest_refuses(ours, theirs) != equal
    decoded = RunSettings.decode(theirs)  # as a peer's record hands it over
    assert decoded is not None and (decoded.digest == RunSettings.of(ours).digest) == equal


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (dict(outer_lr=1), dict(outer_lr=1.0)),
        (dict(outer_momentum=0), dict(outer_momentum=0.0)),
        (dict(lr=1), dict(lr=1.0)),
        (dict(min_lr_ratio=0, lr_schedule="cosine", total_steps=500), dict(min_lr_ratio=0.0, lr_schedule="cosine",
                                                                           total_steps=500)),
    ],
)  # fmt: skip
def test_nodes_built_with_an_int_or_its_float_are_one_run(ours: dict, theirs: dict) -> None:
    a, b = training_settings(NodeConfig(**ours)), training_settings(NodeConfig(**theirs))
    assert a.digest == b.digest
    assert NodeConfig(**ours).averaging_config(False).settings == NodeConfig(**theirs).averaging_config(False).settings
    assert disagreement(a, [("peer", b.wire())], {"peer"}) is None


# --- the run's end ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "end"),
    [
        (NodeConfig(), None),  # until its nodes stop
        (NodeConfig(max_outer_steps=7), 7),
        (NodeConfig(lr_schedule="cosine", total_steps=1000, inner_steps=30), 34),  # where the schedule ends
        (NodeConfig(lr_schedule="wsd", total_steps=1000, inner_steps=30, max_outer_steps=5), 5),  # given: kept
        (NodeConfig(leave_after_steps=3), None),  # a volunteer's own stay is not the run's end
    ],
)
def test_the_runs_end_is_a_run_setting(config: NodeConfig, end: int | None) -> None:
    settings = training_settings(config)
    assert settings.run_end == end == settings["max_outer_steps"]
    assert "leave_after_steps" not in settings


@pytest.mark.parametrize(
    ("ours", "theirs", "adopted"),
    [
        (NodeConfig(), NodeConfig(max_outer_steps=12), 12),  # a joiner without one takes the run's
        (NodeConfig(), None, None),  # nobody publishes: until stopped
        (NodeConfig(), NodeConfig(), None),  # the run has no end
        (NodeConfig(max_outer_steps=12), NodeConfig(max_outer_steps=12), None),
        (NodeConfig(max_outer_steps=5), NodeConfig(max_outer_steps=12), None),  # given: kept (and refused)
        (NodeConfig(leave_after_steps=2), NodeConfig(max_outer_steps=12), 12),  # its own stay does not matter
    ],
)
def test_a_joiner_not_given_the_runs_end_adopts_it(ours: NodeConfig, theirs: NodeConfig | None, adopted: int) -> None:
    assert run_end_to_adopt(training_settings(ours), None if theirs is None else training_settings(theirs)) == adopted


def test_a_node_whose_end_is_not_the_runs_is_refused_and_told_how_to_leave_earlier() -> None:
    problem = disagreement(training_settings(NodeConfig(max_outer_steps=5)),
                           [("a", training_settings(NodeConfig(max_outer_steps=12)))], set())  # fmt: skip
    assert problem is not None
    assert "--max-outer-steps 12 (this node: 5)" in problem and "--leave-after-steps" in problem


@pytest.mark.parametrize(
    ("run_end", "our_step", "records", "advertised", "ended"),
    [
        (None, 50, [50, 50], [50], False),  # no end: never over
        (10, 10, [], [], True),  # the state we fetched (or resumed) is the run's last
        (10, 12, [], [], True),
        (10, 0, [10, 10, 9], [], True),  # most of the run's records are done (its holders left)
        (10, 0, [10, 9, 9], [], False),  # one record does not end the run for us
        (10, 0, [], [], False),  # nobody there: a run starting
        (10, 9, [9, 9], [], False),  # one step left: trained
        (2, 0, [], [2], True),  # every node gone; the only state left is the last step's (unreachable)
        (10, 0, [], [4, 10], False),  # gone too, one state behind the end: the run may go on from it
        (6, 0, [], [6, 6, 5], False),  # two dead holders of the end, a live seeder behind it
        (10, 0, [4, 4], [10, 10, 10], False),  # live records say otherwise: they decide
    ],
)
def test_a_node_arriving_after_the_runs_end_trains_nothing(
    run_end: int | None, our_step: int, records: list[int], advertised: list[int], ended: bool
) -> None:
    assert run_has_ended(run_end, our_step, records, advertised) is ended


@pytest.mark.parametrize(
    ("run_end", "leave_after", "joined_at", "stop"),
    [
        (None, None, 0, None),
        (10, None, 4, 10),
        (None, 3, 4, 7),  # three steps of the swarm after it joined at step 4
        (10, 3, 4, 7),
        (10, 30, 4, 10),  # never past the run's end
    ],
)
def test_a_node_stops_at_the_runs_end_or_when_it_leaves(
    run_end: int | None, leave_after: int | None, joined_at: int, stop: int | None
) -> None:
    assert stop_step(run_end, leave_after, joined_at) == stop
