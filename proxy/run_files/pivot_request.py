"""`.pivot.request.json`: a polish pivot asked of the run (docs/pivots.md), the durable state of
the pivot's state machine. The only module that reads or writes the file, the live one and the
one archived in archive/pivot-B/. Its two writers, the `pivot` command and the live proxy, each
read, decide and write under `.pivot.request.lock` (`request_lock`), so neither acts on a state
the other has just changed (docs/pivots.md#withdrawing-a-pivot).

What it is not: the state machine's moves (proxy/supervision/pivots.py) or the `pivot` command
(proxy/commands/pivot.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from filelock import FileLock, Timeout

from shared.atomic_io import atomic_write_json, fsync_dir, read_json
from shared.run.layout import RunLayout

ARCHIVED_REQUEST = "pivot.request.json"  # the finished request, inside archive/pivot-B/
PENDING = ("requested", "boundary", "archived", "recorded")
LOCK_TIMEOUT_S = 30.0  # the proxy holds the lock for a handshake update at most


class RequestLockTimeout(RuntimeError):
    """`.pivot.request.lock` was not acquired in time: another process holds it."""


@contextmanager
def request_lock(layout: RunLayout, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold `.pivot.request.lock` for one read-decide-write of the request. The live proxy takes
    it for each move of the state machine (proxy/supervision/pivots.py), the `pivot` command to
    write a request or withdraw one; the proxy takes the handshake's lock inside it, never the
    other way round. Reentrant in a process (one FileLock per path), so a move may call another.
    Raises RequestLockTimeout naming the lock after `timeout` seconds."""
    lock = FileLock(str(layout.pivot_request_lock), is_singleton=True)  # one per path: the
    try:  # same arguments every time (a singleton refuses others), the timeout per acquire
        lock.acquire(timeout=timeout)
    except Timeout:
        raise RequestLockTimeout(
            f"{layout.pivot_request_lock}: not acquired in {timeout:.0f} s; another process "
            "holds it (a stuck proxy or `pivot` command?)"
        ) from None
    try:
        yield
    finally:
        lock.release()


def read_request(layout: RunLayout) -> dict | None:
    """The request, or None when there is none (or it is being replaced: atomic writes)."""
    return read_json(layout.pivot_request, garbage="default", expect=dict)


def write_request(layout: RunLayout, req: dict) -> None:
    """Replace the request atomically (fsynced: it is what a restart reads)."""
    atomic_write_json(layout.pivot_request, req)


def remove_request(layout: RunLayout) -> None:
    """Delete the request (a withdrawal), durably. Call it under `request_lock`."""
    layout.pivot_request.unlink(missing_ok=True)
    fsync_dir(layout.root)


def pending_request(layout: RunLayout) -> dict | None:
    """The request when it is still pending (state requested .. recorded), else None."""
    req = read_request(layout)
    return req if req and req.get("state") in PENDING else None


def read_archived_request(layout: RunLayout, step: int) -> dict | None:
    """The finished request of the pivot at `step`, moved into archive/pivot-<step>/ once the
    new phase was in force; None when it is not there (yet)."""
    return read_json(layout.pivot_archive(step) / ARCHIVED_REQUEST, garbage="default", expect=dict)


def archive_request(layout: RunLayout, step: int) -> None:
    """Move the finished request into archive/pivot-<step>/ (the record of what was asked)."""
    dest = layout.pivot_archive(step)
    dest.mkdir(parents=True, exist_ok=True)
    layout.pivot_request.replace(dest / ARCHIVED_REQUEST)
