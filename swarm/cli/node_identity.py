"""Where a node's key lives: the identity of `swarm-node` and `swarm-dht serve` persists by default.

A restarted node comes back under the same PeerID, so the join line it printed (its address
and PeerID) still works. The key file, created on first start with mode 0600 and then reused:

    --identity FILE         that file
    --identity ephemeral    a new key at every start, kept nowhere (tests, throwaway nodes)
    (neither)               node.key in --checkpoint-dir when one is given (the key travels with
                            the state it resumes); else $XDG_CONFIG_HOME/swarm/identity/NAME.key
                            (~/.config/swarm/... without XDG_CONFIG_HOME)

NAME is the run id (`dht` for `swarm-dht serve`), followed by `-tcpPORT` when the node listens on
one fixed port: a fixed port is what keeps a join line valid across restarts, and two nodes of
one run on one machine listen on different ports, so each gets back its own key whatever order
they restart in. With a free port (tcp/0) the address changes at each start anyway; nodes of
one run then take the first key file no other process holds: NAME.key, NAME.2.key, ...

A node holds its key file locked while it runs (Identity.claim), so two processes of one
machine never share a PeerID: a given --identity or --checkpoint-dir that another process
holds is refused in one line; a default one is passed over for the next.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from swarm.cli.common import CliError
from swarm.p2p.errors import IdentityError, IdentityInUse
from swarm.p2p.identity import Identity
from swarm.p2p.maddr import parse_maddrs

EPHEMERAL = "ephemeral"  # --identity ephemeral: a throwaway key
IDENTITY_FILE = "node.key"  # in --checkpoint-dir
MAX_DEFAULT_KEYS = 64  # NAME.key .. NAME.64.key: nodes of one name on one machine


def config_dir() -> Path:
    """$XDG_CONFIG_HOME/swarm, or ~/.config/swarm."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "swarm"


def default_key_name(name: str, host_maddrs: tuple[str, ...]) -> str:
    """NAME, with -tcpPORT when every listen address has the same fixed port (pure). Characters
    a file name should not hold become '_'."""
    ports = {a.port for a in parse_maddrs(list(host_maddrs))} if host_maddrs else {0}
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"
    return f"{safe}-tcp{ports.pop()}" if len(ports) == 1 and 0 not in ports else safe


def node_identity(
    given: Path | None, *, checkpoint_dir: str | None, name: str, host_maddrs: tuple[str, ...]
) -> tuple[Identity, Path | None]:
    """The node's identity and its key file (None: ephemeral), claimed for this process's life.
    CliError, in one line with the fix, when the file is not a private key or is in use."""
    if given is not None and str(given) == EPHEMERAL:
        return Identity.generate(), None
    if given is not None:
        return _claim(given, "another --identity FILE, or --identity ephemeral"), given
    if checkpoint_dir:
        path = Path(checkpoint_dir) / IDENTITY_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where the folder should be, no permission: one line, not a traceback
            raise CliError(f"cannot create --checkpoint-dir {path.parent}: {e.strerror or e}") from None
        return _claim(path, "give each node its own --checkpoint-dir"), path
    folder, stem = config_dir() / "identity", default_key_name(name, host_maddrs)
    for i in range(1, MAX_DEFAULT_KEYS + 1):
        path = folder / (f"{stem}.key" if i == 1 else f"{stem}.{i}.key")
        try:
            return _claim(path, "pass --identity FILE", taken_is_error=False), path
        except IdentityInUse:
            continue
    raise CliError(f"{MAX_DEFAULT_KEYS} nodes named {stem!r} already run on this machine (their keys are in "
                   f"{folder}): pass --identity FILE")  # fmt: skip


def _claim(path: Path, fix: str, *, taken_is_error: bool = True) -> Identity:
    try:
        return Identity.claim(path)
    except IdentityInUse as e:
        if not taken_is_error:
            raise
        raise CliError(f"{e}: two nodes must not share a PeerID; {fix}") from None
    except IdentityError as e:  # a file that is not a key, or others may read it: say how to go on
        raise CliError(f"{e} (move it away to make a new one, or {fix})") from None
    except OSError as e:
        raise CliError(f"cannot create identity file {path}: {e.strerror or e}") from None
