"""swarm-data: prepare a training dataset from local text files, and inspect one.

    swarm-data prepare corpus/ extra.jsonl --tokenizer tokenizer.json --out data
    swarm-data info data                  # the manifest as a table; every shard's size and SHA-256 checked

`prepare` (swarm/model/prepare.py) writes token shards and manifest.json; run again after a kill,
it continues from the last whole shard. Exit status: 0 done; 2 for a bad command line or input
(a missing path, a malformed file, a damaged or inconsistent dataset), with one line on stderr.
"""

from __future__ import annotations

from pathlib import Path

import click

from swarm.cli.common import CliError, OneLineErrors
from swarm.cli.output import cell, echo_json, new_table, print_table
from swarm.model.tokens import TokensError

CONTEXT = {"help_option_names": ["-h", "--help"]}


class InputError(CliError):
    """Inputs or a dataset that cannot be used: as a bad argument, exit 2."""

    exit_code = 2


@click.group(cls=OneLineErrors, name="swarm-data", context_settings=CONTEXT)
def main() -> None:
    """Prepare token shards from local text files (prepare), or show a prepared folder (info)."""


@main.command(context_settings=CONTEXT)
@click.argument("inputs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--tokenizer", required=True, help="A tokenizer.json, or a Hugging Face tokenizer name (transformers).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The folder to write.")
@click.option("--eos-token", default=None, help="The token appended after each document [default: the tokenizer's].")
@click.option("--shard-tokens", type=click.IntRange(1, 1 << 31), default=1 << 26, show_default=True,
              help="Tokens per shard file.")  # fmt: skip
@click.option("--eval-every", type=click.IntRange(1), default=100, show_default=True,
              help="Document 0, then every N-th, goes to the eval split ...")  # fmt: skip
@click.option("--eval-tokens", type=click.IntRange(1, 1 << 31), default=1 << 20, show_default=True,
              help="... until it holds this many tokens.")  # fmt: skip
@click.option("--text-field", default="text", show_default=True, help="The text of a .jsonl object or .parquet row.")
@click.option("--force", is_flag=True, help="Start over in a folder that holds another or a finished prepare.")
def prepare(inputs: tuple[Path, ...], tokenizer: str, out: Path, eos_token: str | None, shard_tokens: int,
            eval_every: int, eval_tokens: int, text_field: str, force: bool) -> None:  # fmt: skip
    """Tokenize INPUTS (.txt: a document per file; .jsonl: per line; .parquet) into token shards."""
    from swarm.model.prepare import PrepareConfig, load_tokenizer
    from swarm.model.prepare import prepare as run_prepare

    try:
        config = PrepareConfig(shard_tokens=shard_tokens, eval_every=eval_every, eval_tokens=eval_tokens,
                               text_field=text_field, force=force)  # fmt: skip
        result = run_prepare(list(inputs), load_tokenizer(tokenizer, eos_token), out, config)
    except TokensError as e:
        raise InputError(str(e)) from None
    except OSError as e:
        raise CliError(f"{e.filename or out}: {e.strerror or e}") from None
    m = result.manifest
    resumed = f", resumed after {result.resumed_shards} shard(s)" if result.resumed_shards else ""
    click.echo(f"wrote {out}: {m.tokens('train'):,} train and {m.tokens('eval'):,} eval tokens in "
               f"{len(m.train) + len(m.eval)} shard(s), {result.tokens / max(result.seconds, 1e-9):,.0f} tokens/s"
               f"{resumed}; digest {m.sha256[:16]}")  # fmt: skip


@main.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(path_type=Path))
@click.option("--no-verify", is_flag=True, help="Check the shards' sizes only, not their SHA-256.")
@click.option("--json", "as_json", is_flag=True, help="The manifest as one JSON line.")
def info(folder: Path, no_verify: bool, as_json: bool) -> None:
    """Show a prepared FOLDER's manifest, after checking its shards."""
    import json

    from swarm.model.tokens import read_manifest, verify

    try:
        manifest = read_manifest(folder)
        verify(folder, manifest, hashes=not no_verify)
    except TokensError as e:
        raise InputError(str(e)) from None
    if as_json:
        echo_json({"digest": manifest.sha256, **json.loads(manifest.to_json())})
        return
    tok = manifest.tokenizer
    # the digest on a line of its own, never cut by a narrow terminal: it is what a run's settings name
    click.echo(f"{folder}: digest {manifest.sha256} ({'sizes' if no_verify else 'sizes and SHA-256'} checked)")
    summary = new_table("", "")
    for key, value in (
        ("tokenizer", f"{tok.name} ({tok.vocab_size:,} tokens, vocabulary {tok.vocab_sha256[:16]})"),
        ("end of document", f"token {tok.eos_id}"),
        ("stored as", f"{manifest.dtype}, {manifest.shard_tokens:,} tokens a shard"),
        ("train", f"{manifest.tokens('train'):,} tokens, {manifest.documents['train']:,} documents"),
        ("eval", f"{manifest.tokens('eval'):,} tokens, {manifest.documents['eval']:,} documents "
                 f"(document 0, then every {manifest.eval_every})"),
        ("sources", f"{manifest.sources.get('files')} file(s), {manifest.sources.get('bytes')} bytes"),
    ):  # fmt: skip
        summary.add_row(key, cell(value))
    print_table(summary)
    shards = new_table("shard", "tokens", "sha256")
    for entry in (*manifest.train, *manifest.eval):
        shards.add_row(entry.name, f"{entry.tokens:,}", entry.sha256)
    print_table(shards)
