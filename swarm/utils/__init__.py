"""Helpers every layer may use and that import no layer: the event loop, supervised tasks,
once-per-key logging, child processes, process memory, atomic file writes."""
