"""The pure half of swarm.netlab: rate parsing and the plan of a lab (names, addresses, commands)."""

from __future__ import annotations

import pytest

from swarm.netlab.plan import (
    IFNAMSIZ,
    address,
    lab_name,
    owner_pid,
    plan_endpoint,
    plan_lab,
    stale_namespaces,
    teardown_commands,
)
from swarm.netlab.rates import Rate, parse_rate, parse_rates


@pytest.mark.parametrize(
    ("text", "bits", "canonical"),
    [
        ("100mbit", 100_000_000, "100mbit"),
        ("20mbit", 20_000_000, "20mbit"),
        ("1gbit", 1_000_000_000, "1gbit"),
        (" 1GBit ", 1_000_000_000, "1gbit"),
        ("1.5mbit", 1_500_000, "1500kbit"),
        ("1.1mbit", 1_100_000, "1100kbit"),  # exact: no float rounding
        ("500kbit", 500_000, "500kbit"),
        ("250000bit", 250_000, "250kbit"),
        ("100gbit", 100_000_000_000, "100gbit"),
    ],
)
def test_rates_parse_to_bits_per_second(text: str, bits: int, canonical: str) -> None:
    rate = parse_rate(text)
    assert rate == Rate(bits) and str(rate) == canonical and rate.tc == f"{bits}bit"
    assert parse_rate(str(rate)) == rate


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("20mbps", "megabytes/s"),  # tc's bps is bytes: refused, never guessed
        ("20MBps", "megabytes/s"),
        ("20", "not a rate"),
        ("mbit", "not a rate"),
        ("fast", "not a rate"),
        ("-5mbit", "not a rate"),
        ("20 mbit", "not a rate"),
        ("20tbit", "not a rate"),
        ("1.5bit", "whole number"),
        ("50kbit", "between 100kbit and 100gbit"),
        ("101gbit", "between 100kbit and 100gbit"),
        ("0mbit", "between"),
    ],
)
def test_bad_rates_are_refused_with_the_reason(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_rate(text)


def test_rate_lists() -> None:
    assert parse_rates("100mbit,100mbit, 20mbit") == (Rate(10**8), Rate(10**8), Rate(2 * 10**7))
    assert parse_rates("1gbit") == (Rate(10**9),)
    for bad in ("100mbit,", ",20mbit", "100mbit,,20mbit", ""):
        with pytest.raises(ValueError, match="separated by commas"):
            parse_rates(bad)
    with pytest.raises(ValueError, match="'x' is not a rate"):
        parse_rates("100mbit,x")


@pytest.mark.parametrize(
    ("rate", "burst", "limit"),
    [
        ("20mbit", 32 * 1024, 32 * 1024 + 125_000),  # the floor: a few frames, a GSO packet in two
        ("50mbit", 62_500, 62_500 + 312_500),  # 10 ms of traffic, then 50 ms of queue
        ("1gbit", 1_250_000, 1_250_000 + 6_250_000),
    ],
)
def test_the_token_bucket_is_sized_by_the_rate(rate: str, burst: int, limit: int) -> None:
    parsed = parse_rate(rate)
    assert (parsed.burst_bytes, parsed.limit_bytes) == (burst, limit)


def test_a_lab_plan_names_addresses_and_shapes_both_directions() -> None:
    fast, slow = parse_rate("100mbit"), parse_rate("20mbit")
    plan = plan_lab("sim-1a2b", 4242, [("bootstrap", fast), ("node0", slow)])
    lab = "swarmlab-4242-sim-1a2b"
    assert plan.name == lab
    assert plan.namespaces == (lab, f"{lab}-bootstrap", f"{lab}-node0")
    boot, node = plan.endpoints
    assert (boot.address, node.address) == ("10.77.0.1", "10.77.0.2")
    assert (node.netns, node.port, node.rate, node.index) == (f"{lab}-node0", "v-node0", slow, 1)
    commands = [" ".join(c) for c in plan.commands]
    assert commands[:3] == [
        f"ip netns add {lab}",
        f"ip -n {lab} link add name br0 type bridge",
        f"ip -n {lab} link set br0 up",
    ]
    assert commands[-9:] == [
        f"ip netns add {lab}-node0",
        f"ip -n {lab}-node0 link set lo up",
        f"ip -n {lab} link add name v-node0 type veth peer name eth0 netns {lab}-node0",
        f"ip -n {lab} link set v-node0 master br0",
        f"ip -n {lab} link set v-node0 up",
        f"ip -n {lab}-node0 addr add 10.77.0.2/16 dev eth0",
        f"ip -n {lab}-node0 link set eth0 up",
        f"tc -n {lab}-node0 qdisc add dev eth0 root tbf rate 20000000bit burst 32768 limit 157768",  # it sends
        f"tc -n {lab} qdisc add dev v-node0 root tbf rate 20000000bit burst 32768 limit 157768",  # it receives
    ]
    # nothing is made in the host's namespace: every ip/tc command names one of the lab's
    for command in plan.commands:
        target = command[3] if command[1:3] == ("netns", "add") else command[2]
        assert command[1] in ("-n", "netns") and target in plan.namespaces, command
    assert teardown_commands(plan.namespaces) == tuple(("ip", "netns", "del", ns) for ns in plan.namespaces[::-1])


def test_names_fit_the_kernels_limits() -> None:
    rate = parse_rate("1gbit")
    endpoint, _ = plan_endpoint(lab_name("r", 1), 0, "a" * (IFNAMSIZ - 2), rate)
    assert len(endpoint.port) == IFNAMSIZ
    assert address(0) == "10.77.0.1" and address(254) == "10.77.0.255" and address(999) == "10.77.3.232"


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: lab_name("", 1), "run name"),
        (lambda: lab_name("a b", 1), "run name"),
        (lambda: lab_name("x" * 41, 1), "run name"),
        (lambda: lab_name("-x", 1), "run name"),
        (lambda: lab_name("ok", 0), "PID"),
        (lambda: plan_endpoint("lab", 0, "a" * 14, parse_rate("1gbit")), "endpoint name"),
        (lambda: plan_endpoint("lab", 0, "a/b", parse_rate("1gbit")), "endpoint name"),
        (lambda: plan_endpoint("lab", 1000, "a", parse_rate("1gbit")), "at most 1000"),
        (lambda: plan_lab("r", 1, [("a", parse_rate("1gbit")), ("a", parse_rate("1gbit"))]), "must differ"),
    ],
)
def test_bad_names_are_refused(call: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        call()  # type: ignore[operator]


def test_leftovers_are_the_labs_of_dead_owners() -> None:
    names = [
        "swarmlab-10-sim-a",  # dead owner: its bridge
        "swarmlab-10-sim-a-node0",  # and an endpoint
        "swarmlab-20-sim-b",  # live owner: another run, left alone
        "swarmlab-20-sim-b-node0",
        "swarmlab-x-sim-c",  # not a PID: not ours
        "swarmlab-0-sim-c",
        "swarmlab-30",  # no run
        "other-10-sim-a",  # someone else's namespace
    ]
    assert [owner_pid(n) for n in names] == [10, 10, 20, 20, None, None, None, None]
    # endpoints before their bridge
    assert stale_namespaces(names, alive=lambda pid: pid == 20) == ["swarmlab-10-sim-a-node0", "swarmlab-10-sim-a"]
    assert stale_namespaces(names, alive=lambda pid: True) == []
