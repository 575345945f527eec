"""The run's settings (swarm/model/run_settings.py): whose settings are the run's, what a node of
other settings is told, the join line's flags, and bounded decoding of peers' maps."""

from __future__ import annotations

import pytest

from swarm.model.run_settings import (
    decode_settings,
    disagreement,
    join_flags,
    run_settings,
    settings_digest,
    training_settings,
)
from swarm.node.config import NodeConfig

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
    assert flags == "--model tiny --inner-steps 10 --batch-size 4 --lr-schedule cosine --total-steps 500 "
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
    assert decode_settings(COSINE) == COSINE


@pytest.mark.parametrize(
    ("theirs", "given", "adopted"),
    [
        (None, set(), {}),  # the run says nothing: our own settings
        (OURS, set(), {}),  # the same: nothing to adopt
        (COSINE, set(), {"lr_schedule": "cosine", "total_steps": 1000}),
        (COSINE, {"lr_schedule"}, {"total_steps": 1000}),  # a given flag is never overridden (it is refused later)
        ({**COSINE, "unknown": 1}, set(), {"lr_schedule": "cosine", "total_steps": 1000}),  # only known settings
    ],
)
def test_a_joining_node_adopts_every_setting_it_was_not_given(theirs: dict | None, given: set, adopted: dict) -> None:
    from swarm.node.run_lookup import adoptable_settings

    assert adoptable_settings(theirs, given, OURS) == adopted


@pytest.mark.parametrize(
    ("ours", "theirs", "equal"),
    [
        ({"outer_lr": 1}, {"outer_lr": 1.0}, True),  # swarm.join(outer_lr=1) against the CLI's 1.0
        ({"seed": 0}, {"seed": 0.0}, True),  # msgpack may hand back 0.0 for 0
        ({"outer_lr": 0.7}, {"outer_lr": 0.7000001}, False),
        ({"lr": 1e-3}, {"lr": 0.001}, True),
        ({"total_steps": None}, {"total_steps": 0}, False),
        ({"fragments": True}, {"fragments": 1}, False),  # a bool is not the number 1
        ({"inner_steps": 2**60 + 1}, {"inner_steps": 2**60}, False),  # ints past a float's precision
        ({"model": "tiny"}, {"model": "tiny "}, False),
    ],
)
def test_equal_settings_have_one_digest_and_the_join_check_agrees_with_it(
    ours: dict, theirs: dict, equal: bool
) -> None:
    """The digest (matchmaking, the manifest) and the join check compare settings the same way:
    two nodes the join check lets into one run must have one digest, or they never group."""
    assert (settings_digest(ours) == settings_digest(theirs)) == equal
    assert (disagreement(ours, [("a", theirs)], set()) is None) == equal


def test_a_node_built_with_outer_lr_1_groups_with_one_built_with_1_0() -> None:
    assert settings_digest(training_settings(NodeConfig(outer_lr=1))) == settings_digest(
        training_settings(NodeConfig(outer_lr=1.0))
    )
