"""`swarm-node --data DIR|URL|hf-prepared:REPO`: a prepared dataset (swarm-data prepare) opened
before the node is built.

The folder's path is this machine's business; what the run agrees on is its tokens. So the node's
`data` setting becomes `tokens:<the manifest's digest>` (swarm/model/data.py), and the run's
settings check refuses, by name, a node whose folder holds other tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import click

from swarm.cli.common import CliError
from swarm.node.config import NodeConfig

if TYPE_CHECKING:
    from swarm.model.data import TokenData


def refuse_with_ranks(config: NodeConfig, several_ranks: bool) -> None:
    """Before anything slow: the ranks of a node load their data by its setting, not a folder."""
    if not several_ranks:
        return
    from swarm.model.remote_tokens import is_remote
    from swarm.model.tokens import is_prepared_folder  # numpy: not for a plain node's flag errors

    if is_prepared_folder(config.data) or is_remote(config.data):
        raise click.UsageError(
            "--data DIR, URL or hf-prepared: (a prepared folder) is not yet supported with --nproc-per-node"
        )


def open_prepared(config: NodeConfig) -> tuple[NodeConfig, TokenData | None]:
    """(config with data = tokens:<digest>, the data) for a prepared folder, local, at an http(s)
    URL or in a Hugging Face repo (its manifest and eval split fetched and verified first, each
    train shard as a chunk in it is claimed); (config, None) else."""
    from swarm.model.data import DataUnavailableError, prepared_corpus, remote_corpus
    from swarm.model.remote_tokens import is_remote
    from swarm.model.tokens import is_prepared_folder

    remote = is_remote(config.data)
    if not remote and not is_prepared_folder(config.data):
        return config, None
    try:
        data = remote_corpus(config.data) if remote else prepared_corpus(Path(config.data))
    except DataUnavailableError as e:
        raise CliError(str(e)) from None
    if len(data.train) <= config.seq_len + 1 or len(data.eval) < config.seq_len + 1:
        raise CliError(f"--data {config.data}: {len(data.train)} train and {len(data.eval)} eval tokens are too few "
                       f"for windows of --seq-len {config.seq_len} + 1")  # fmt: skip
    return dataclasses.replace(config, data=data.name), data
