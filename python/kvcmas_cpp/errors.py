"""Errors the command line reports as one line (``kvcmas: error: ...``) instead of a traceback."""

from __future__ import annotations


class CommandError(RuntimeError):
    """A process a command started (a benchmark worker, a server it launched) failed; the message says why."""
