"""`.state.snapshots.jsonl`: the mixture controller's state at every durable checkpoint, a cache
so a resume from checkpoint S replays only the history after the newest snapshot at or before S
instead of the whole phase (same state: Bandit.from_dict is exact; docs/bandit.md#determinism).

One JSON object per line, appended: {"step", "phase_index", "phase_start", "next", "policies",
"bandit"} (MixtureController.to_snapshot), or {"rewound_to": S} when the history was cut back to
S, which invalidates every earlier line with a step past S.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from shared.atomic_io import atomic_write_bytes, named
from shared.checkpoint.directory import list_checkpoints
from shared.run.layout import RunLayout

SNAPSHOT_FORMAT = 6  # the snapshot layout (docs/bandit.md#state); `find_snapshot` skips others


def _append(layout: RunLayout, obj: dict) -> None:
    line = (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()
    fd = os.open(layout.state_snapshots, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)  # a torn line (disk full) is dropped by every reader
    except OSError as e:
        raise named(e, layout.state_snapshots) from e
    finally:
        os.close(fd)


COMPACT_AT = 64  # lines; past this the file is compacted to the checkpoints still on disk


def append_snapshot(layout: RunLayout, snap: dict) -> None:
    """Record the controller state of a durable checkpoint (MixtureController.to_snapshot()), then
    `compact` the file past COMPACT_AT lines, so its size follows retention, not steps."""
    _append(layout, snap)
    compact(layout)


def compact(layout: RunLayout, at: int = COMPACT_AT) -> None:
    """Rewrite the file when it holds more than `at` lines: rewind markers applied (the lines
    they invalidate dropped), then only the snapshots whose checkpoint file still exists, plus
    the newest one. Torn lines are dropped. A resume from a checkpoint whose snapshot is gone
    replays from the phase start instead (same state, slower)."""
    lines = _lines(layout)
    if len(lines) <= at:
        return
    on_disk = {s for s, _ in list_checkpoints(layout.root)}
    keep = [
        raw
        for i, (obj, raw) in enumerate(_newest_first(lines, None))
        if i == 0 or int(obj["step"]) in on_disk
    ]
    atomic_write_bytes(layout.state_snapshots, b"".join(r + b"\n" for r in reversed(keep)))


def _lines(layout: RunLayout) -> list[bytes]:
    try:
        return layout.state_snapshots.read_bytes().split(b"\n")
    except FileNotFoundError:
        return []


def _newest_first(lines: list[bytes], limit: int | None) -> Iterator[tuple[dict, bytes]]:
    """(snapshot, its line) newest first, torn lines skipped; a rewind marker invalidates the
    older lines past it, as `limit` (a step, or None) does from the start."""
    for raw in reversed(lines):
        try:
            obj = json.loads(raw)
            if "rewound_to" in obj:
                at = int(obj["rewound_to"])
                limit = at if limit is None else min(limit, at)
                continue
            step = int(obj["step"])
        except (ValueError, TypeError, KeyError):
            continue
        if limit is None or step <= limit:
            yield obj, raw


def mark_rewound(layout: RunLayout, step: int) -> None:
    """The history was cut back to `step`: snapshots past it no longer describe the run."""
    if layout.state_snapshots.exists():
        _append(layout, {"rewound_to": int(step)})


def find_snapshot(
    layout: RunLayout, phase_index: int, phase_start: int, upto_step: int
) -> dict | None:
    """The newest valid snapshot of this phase with phase_start <= step <= upto_step, or None.
    Torn or garbage lines (a kill mid-append) are skipped, and so are snapshots of another format
    than SNAPSHOT_FORMAT (an older version's): the history is replayed over them instead."""
    for obj, _ in _newest_first(_lines(layout), upto_step):
        try:
            if (
                obj.get("format") == SNAPSHOT_FORMAT
                and obj["phase_index"] == phase_index
                and obj["phase_start"] == phase_start
                and phase_start <= obj["step"]
            ):
                return obj
        except (KeyError, TypeError):
            continue
    return None
