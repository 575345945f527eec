"""Where swarm-node's settings come from beside its flags: a TOML --config file (flags override
it), and the run it joins (every setting it was not given, from the run's records)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from swarm.cli.common import CliError, run_network
from swarm.cli.options import OpenNetworkLimits
from swarm.node.config import NodeConfig
from swarm.node.run_lookup import (
    RunChoiceError,
    RunLookup,
    initial_peer_ids,
    look_up_run,
    run_to_join,
)
from swarm.node.settings import CLI_REMEDY, FIELDS, FLAGS, adoptable_settings, disagreement, training_settings
from swarm.p2p.identity import Identity

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_config_file(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """--config: load TOML into click's default_map, so that flags override it."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror or e}", ctx, param) from None
    except tomllib.TOMLDecodeError as e:
        raise click.BadParameter(f"{path} is not valid TOML: {e}", ctx, param) from None
    options = {p.name: p for p in ctx.command.params if p.name and p.name != "config" and isinstance(p, click.Option)}
    written = {key.replace("-", "_"): key for key in table}  # reported as the file spells them
    values = {key.replace("-", "_"): value for key, value in table.items()}
    unknown = sorted(written[k] for k in set(values) - set(options))
    if unknown:
        valid = ", ".join(sorted(n.replace("_", "-") for n in options))
        raise click.BadParameter(f"{path}: unknown option(s) {', '.join(unknown)}; valid: {valid}", ctx, param)
    for key in ("initial_peers", "host_maddrs", "announce_maddrs"):
        if isinstance(values.get(key), str):
            values[key] = [values[key]]
    for key, value in values.items():  # typed here, so that a bad value names the file, not a flag
        try:
            options[key].type_cast_value(ctx, value)
        except click.BadParameter as e:
            raise click.BadParameter(f"{path}: {written[key]} = {value!r}: {e.message}", ctx, param) from None
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def adopt_run_settings(
    config: NodeConfig, initial_peers: tuple[str, ...], limits: OpenNetworkLimits, identity: Identity,
    proof_path: Path | None,
) -> tuple[NodeConfig, Mapping[str, Any] | None]:  # fmt: skip
    """The run to join (without --run-id: the DHT's one run) and every run setting not given on
    the command line or in --config, from the run's records (swarm/node/run_lookup.py); each said in
    one line. A --run-id nobody trains, where others are trained, is warned about. Returns the
    config and the run's settings as its records say (None: none found)."""
    ctx = click.get_current_context()
    given = {n for n in FIELDS if ctx.get_parameter_source(n) not in (ParameterSource.DEFAULT, None)}
    dial_out = limits.p2p(host_maddrs=("/ip4/127.0.0.1/tcp/0",))  # it only dials out

    def look_up(run_id: str) -> RunLookup | None:
        return run_network(lambda: look_up_run(run_id, initial_peers, dial_out, limits.dht(),
                                               initial_peer_ids(initial_peers), identity, proof_path))  # fmt: skip

    lookup = look_up(config.run_id)
    if lookup is None:
        return config, None
    run_given = ctx.get_parameter_source("run_id") not in (ParameterSource.DEFAULT, None)
    try:
        run_id, said = run_to_join(config.run_id, run_given, lookup)
    except RunChoiceError as e:
        raise CliError(str(e)) from None
    if said is not None:
        click.echo(said if run_id != config.run_id else f"warning: {said}", err=True)
    if run_id != config.run_id:
        config = dataclasses.replace(config, run_id=run_id)
        lookup = look_up(run_id)
        if lookup is None:
            return config, None
    adopted = adoptable_settings(lookup.settings, given, training_settings(config))
    if not adopted:
        return config, lookup.settings
    try:
        config = dataclasses.replace(config, **adopted)
    except ValueError as e:  # the run publishes settings this node cannot run: say whose
        raise CliError(f"run {config.run_id!r} publishes settings this node cannot use: {e}") from None
    flags = " ".join(f"{FLAGS[n]} {v}" for n, v in adopted.items())
    click.echo(f"run {config.run_id!r}: adopting its settings {flags}", err=True)
    return config, lookup.settings


def refuse_other_settings(config: NodeConfig, theirs: Mapping[str, Any] | None) -> None:
    """CliError naming both values of every setting of ours that contradicts the run's: the first
    thing a refused node prints, before torch, the data or the model load. A --data folder or URL
    is compared once open (its setting is the digest of its tokens): call again then."""
    if theirs is None:
        return
    skip = () if _settled_data(config.data) else ("data",)
    ours = {n: v for n, v in training_settings(config).items() if n not in skip}
    run = {n: v for n, v in theirs.items() if n not in skip}
    problem = disagreement(ours, [(None, run)], frozenset(), CLI_REMEDY)
    if problem is not None:
        raise CliError(problem)


def _settled_data(data: str) -> bool:
    """--data in the form the run's settings carry (not a folder or URL still to open)."""
    return data == "stdlib" or data.startswith(("hf:", "tokens:"))
