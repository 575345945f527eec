"""What every swarm command shares: one-line errors, logging, and running a network operation.

Every failure a user can cause (a bad argument, an unreachable peer, a missing key, a refused
record, a timeout) ends the command with one line on stderr and a non-zero exit: 2 for a bad
command line, 1 for everything else. A traceback means a bug.

The shared options are in options.py, the DHT client of the asking commands in dht_client.py,
JSON and tables in output.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click

from swarm.dht.errors import DHTError, RecordError
from swarm.p2p.errors import P2PError
from swarm.utils import eventloop

T = TypeVar("T")


class CliError(click.ClickException):
    """A failure the command explains in one line (exit 1)."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        ctx = click.get_current_context(silent=True)
        self.command_path = ctx.command_path if ctx is not None else ""
        super().__init__(one_line(message))


_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


class _OneLineMain:
    """Errors print as one line on stderr, usage errors included (click's default prints the
    usage and a hint over four lines)."""

    name: str | None

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except _NO_ARGS_IS_HELP as e:  # `swarm-dht` alone: the help, as click prints it
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else self.name
            click.echo(f"{where}: error: {one_line(e.format_message())} (see '{where} --help')", err=True)
            sys.exit(e.exit_code)
        except CliError as e:
            click.echo(f"{e.command_path or self.name}: error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            click.echo(f"{self.name}: error: {one_line(e.format_message())}", err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo(f"{self.name}: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # `swarm-dht peers | head`: stop quietly, as other tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


class OneLineErrors(_OneLineMain, click.Group):
    """A command group with one-line errors."""


class OneLineCommand(_OneLineMain, click.Command):
    """A single command with one-line errors (use as `@click.command(cls=OneLineCommand)`)."""


def one_line(message: str) -> str:
    return " ".join(str(message).split())


def setup_logging(verbose: int, quiet_level: int = logging.WARNING) -> None:
    """Log to stderr at quiet_level, INFO with -v, DEBUG with -vv."""
    level = quiet_level if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# --- running a network operation ----------------------------------------------------------


def run_network(main: Callable[[], Coroutine[Any, Any, T]], timeout: float | None = None) -> T:
    """Run main() on a fresh (uv)loop; the errors a network or a peer can cause become CliError."""
    try:
        return eventloop.run(main())
    except (asyncio.TimeoutError, TimeoutError) as e:
        if isinstance(e, P2PError) and str(e):
            raise CliError(str(e)) from None
        after = f" within {timeout:g}s (see --timeout)" if timeout is not None else ""
        raise CliError(f"no answer{after}") from None
    except RecordError as e:
        raise CliError(f"record refused [{e.code}]: {e.message}") from None
    except (P2PError, DHTError) as e:
        raise CliError(str(e) or type(e).__name__) from None
    except ValueError as e:  # a malformed multiaddr or config value
        raise CliError(str(e)) from None
    except OSError as e:  # listening: address in use, permission denied
        raise CliError(f"{e.strerror or e}") from None
