"""`.state.snapshots.jsonl`: the mixture controller's state at every durable checkpoint.

Why: a resume from checkpoint S must rebuild the bandit exactly as it was after update S
(docs/bandit.md#determinism). Replaying `.loss.json` from the phase start does that but costs seconds at
200,000 records; starting from the newest snapshot at or before S and replaying only the records
after it gives the same state (Bandit.from_dict is exact) in milliseconds. Snapshots are a cache:
when none fits, the supervisor replays from the phase start.

One JSON object per line, appended: {"step", "phase_index", "phase_start", "next", "policies",
"bandit"} (MixtureController.to_snapshot), or {"rewound_to": S} when the history was cut back to
S, which invalidates every earlier line with a step past S.
"""

from __future__ import annotations

import json
import os

from shared.atomic_io import atomic_write_bytes, named
from shared.checkpoint.directory import list_checkpoints
from shared.run.layout import RunLayout

# the snapshot layout: 3 since the bandit state carries the default policy's fits
# (docs/bandit.md#state); only snapshots of this format are used, older ones are replayed instead
SNAPSHOT_FORMAT = 3


def _path(layout: RunLayout):
    return layout.state_snapshots


def _append(layout: RunLayout, obj: dict) -> None:
    line = (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()
    fd = os.open(_path(layout), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)  # a torn line (disk full) is dropped by every reader
    except OSError as e:
        raise named(e, _path(layout)) from e
    finally:
        os.close(fd)


COMPACT_AT = 64  # lines; past this the file is compacted to the checkpoints still on disk


def append_snapshot(layout: RunLayout, snap: dict) -> None:
    """Record the controller state of a durable checkpoint (MixtureController.to_snapshot()).
    The file stays bounded: past COMPACT_AT lines it is rewritten (atomically) with only the
    valid snapshots of checkpoints still on disk, so its size follows retention, not steps."""
    _append(layout, snap)
    compact(layout)


def compact(layout: RunLayout, at: int = COMPACT_AT) -> int:
    """Rewrite the file when it holds more than `at` lines: rewind markers applied (the lines
    they invalidate dropped), then only the snapshots whose checkpoint file still exists, plus
    the newest one. Torn lines are dropped. A resume from a checkpoint whose snapshot is gone
    replays from the phase start instead (same state, slower). Returns the lines kept, or 0
    when nothing was rewritten."""
    try:
        lines = _path(layout).read_bytes().split(b"\n")
    except FileNotFoundError:
        return 0
    if len(lines) <= at:
        return 0
    valid, limit = [], None
    for raw in reversed(lines):  # newest first: a marker invalidates the older lines past it
        try:
            obj = json.loads(raw)
            if "rewound_to" in obj:
                limit = (
                    int(obj["rewound_to"]) if limit is None else min(limit, int(obj["rewound_to"]))
                )
                continue
            step = int(obj["step"])
        except (ValueError, TypeError, KeyError):
            continue
        if limit is None or step <= limit:
            valid.append((step, raw))
    on_disk = {s for s, _ in list_checkpoints(layout.root)}
    keep = [raw for i, (step, raw) in enumerate(valid) if i == 0 or step in on_disk]
    atomic_write_bytes(_path(layout), b"".join(r + b"\n" for r in reversed(keep)))
    return len(keep)


def mark_rewound(layout: RunLayout, step: int) -> None:
    """The history was cut back to `step`: snapshots past it no longer describe the run."""
    if _path(layout).exists():
        _append(layout, {"rewound_to": int(step)})


def find_snapshot(
    layout: RunLayout, phase_index: int, phase_start: int, upto_step: int
) -> dict | None:
    """The newest valid snapshot of this phase with phase_start <= step <= upto_step, or None.
    Torn or garbage lines (a kill mid-append) are skipped, and so are snapshots of another
    format than SNAPSHOT_FORMAT (written by an older version, whose bandit
    state lacks fields this one keeps): the history is replayed over them instead."""
    try:
        lines = _path(layout).read_bytes().split(b"\n")
    except FileNotFoundError:
        return None
    limit = upto_step
    for raw in reversed(lines):
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "rewound_to" in obj:
            limit = min(limit, int(obj["rewound_to"]))
            continue
        try:
            if (
                obj.get("format") == SNAPSHOT_FORMAT
                and obj["phase_index"] == phase_index
                and obj["phase_start"] == phase_start
                and phase_start <= obj["step"] <= limit
            ):
                return obj
        except (KeyError, TypeError):
            continue
    return None
