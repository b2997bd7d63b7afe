"""`.pivot.request.json`: a polish pivot asked of the run (docs/pivots.md), the durable state of
the pivot's state machine. The only module that reads or writes the file, the live one and the
one archived in archive/pivot-B/.

What it is not: the state machine's moves (proxy/supervision/pivots.py) or the `pivot` command
(proxy/commands/pivot.py).
"""

from __future__ import annotations

from pathlib import Path

from proxy.run_files.json_file import read_json
from shared.atomic_io import atomic_write_json
from shared.run_layout import RunLayout

ARCHIVED_REQUEST = "pivot.request.json"  # the finished request, inside archive/pivot-B/
PENDING = ("requested", "boundary", "archived", "recorded")


def request_path(layout: RunLayout) -> Path:
    """`.pivot.request.json` of the run."""
    return layout.pivot_request


def read_request(layout: RunLayout) -> dict | None:
    """The request, or None when there is none (or it is being replaced: atomic writes)."""
    d = read_json(request_path(layout), None)
    return d if isinstance(d, dict) else None


def write_request(layout: RunLayout, req: dict) -> None:
    """Replace the request atomically (fsynced: it is what a restart reads)."""
    atomic_write_json(request_path(layout), req)


def pending_request(layout: RunLayout) -> dict | None:
    """The request when it is still pending (state requested .. recorded), else None."""
    req = read_request(layout)
    return req if req and req.get("state") in PENDING else None


def read_archived_request(layout: RunLayout, step: int) -> dict | None:
    """The finished request of the pivot at `step`, moved into archive/pivot-<step>/ once the
    new phase was in force; None when it is not there (yet)."""
    d = read_json(layout.pivot_archive(step) / ARCHIVED_REQUEST, None)
    return d if isinstance(d, dict) else None


def archive_request(layout: RunLayout, step: int) -> None:
    """Move the finished request into archive/pivot-<step>/ (the record of what was asked)."""
    dest = layout.pivot_archive(step)
    dest.mkdir(parents=True, exist_ok=True)
    request_path(layout).replace(dest / ARCHIVED_REQUEST)
