"""A stop asked for while the proxy is busy with long work of its own, before any worker exists:
tokenizing an arm, checking or copying token files (docs/signals.md#during-creation).

What it is: one process-wide flag. The proxy's early signal handlers (proxy/supervision/proc_tree.py
EarlySignals) set it on SIGTERM/SIGINT/SIGHUP; the data pipeline (shared/data/tokenization.py) looks
at it between pieces of a source and raises StopRequested. What it is not: the supervisor's
handling of stops once a worker runs (proxy/supervision/supervisor.py), nor a signal handler
itself (no signal module here).
"""

from __future__ import annotations

_requested: str | None = None


class StopRequested(Exception):
    """Raised by long work that saw a stop request; `signal` is the request's name (SIGTERM)."""

    def __init__(self, signal: str, during: str) -> None:
        super().__init__(f"stopped by {signal} during {during}")
        self.signal = signal
        self.during = during


def request(name: str) -> None:
    """Ask long work to stop at its next check; the first request's name is kept."""
    global _requested
    _requested = _requested or name


def check(during: str) -> None:
    """Raise StopRequested if a stop was asked for; `during` says what was interrupted."""
    if _requested is not None:
        raise StopRequested(_requested, during)
