"""Entry points whose issue has not landed yet: they say so in one line and exit non-zero."""

from __future__ import annotations

import click


def pending_command(name: str, what: str, issue: int) -> click.Command:
    @click.command(name=name, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def command() -> None:
        click.echo(f"{name}: not available yet: {what} lands with issue #{issue}.", err=True)
        raise SystemExit(2)

    return command
