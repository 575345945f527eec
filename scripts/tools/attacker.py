"""A malicious swarm-node: `python -m scripts.tools.attacker ATTACK [swarm-node options...]`.

The real node (swarm/cli/node.py) with the methods of one attack of scripts/tools/attacks.py changed
in this process only. Test and benchmark use only: it attacks the swarm it joins.
"""

from __future__ import annotations

import sys

from scripts.tools.attacks import ATTACKS


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ATTACKS:
        usage = f"usage: python -m scripts.tools.attacker {{{','.join(ATTACKS)}}} [swarm-node options...]"
        print(usage, file=sys.stderr)
        return 2
    ATTACKS[argv[0]]()
    from swarm.cli.node import main as node_main

    return node_main(args=argv[1:], prog_name="swarm-node (attacker)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
