"""The node's own error: raised where it cannot start or go on, caught by the CLI and swarm.join."""


class NodeError(RuntimeError):
    """The node cannot start or go on; the message says why and what to do."""
