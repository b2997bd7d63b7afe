"""The checkpoint manifest ``checkpoints.json`` and the retention plan
(docs/checkpoint-format.md#manifest, docs/checkpoint-format.md#retention).

What it is: a small JSON file beside the ``.bin`` files recording, per checkpoint, its step,
file name, byte size, checksum, why it was written and whether it is pinned; plus the pure
function that decides which checkpoints retention may delete.

What it is not: the checkpoint format (``shared/checkpoint/file_format.py``); the ``.bin`` stays
byte-exact and a ``.bin`` without an entry still loads. It deletes no checkpoint itself.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from filelock import FileLock

from shared.atomic_io import atomic_write_bytes
from shared.checkpoint.file_format import INT32_MAX
from shared.run.layout import RunLayout

MANIFEST_FORMAT = "andrea-checkpoints/1"
REASONS = frozenset({"cadence", "sigusr1", "sigterm", "pivot", "final", "alarm"})


@dataclass
class ManifestEntry:
    """One checkpoint's manifest record (docs/checkpoint-format.md#manifest).

    step: optimizer updates completed (= the file's header step), 0..INT32_MAX.
    file: bare file name, e.g. "step_000100.bin". nbytes: file size in bytes.
    checksum: "crc32:%08x" as returned by write_checkpoint.
    reason: why it was written, one of REASONS. pinned: retention never deletes it.
    time: when it became durable, seconds since the epoch (time.time()).
    Raises ValueError from __post_init__ on a wrong type or value.
    """

    step: int
    file: str
    nbytes: int
    checksum: str
    reason: str
    pinned: bool
    time: float

    def __post_init__(self):
        for name in ("step", "nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"manifest entry {name} = {value!r}: must be an int >= 0")
        if self.step > INT32_MAX:
            raise ValueError(f"manifest entry step = {self.step:,}: exceeds int32")
        if not isinstance(self.file, str) or not self.file or "/" in self.file:
            raise ValueError(f"manifest entry file = {self.file!r}: must be a bare file name")
        if not isinstance(self.checksum, str):
            raise ValueError(f"manifest entry checksum = {self.checksum!r}: must be a str")
        if self.reason not in REASONS:
            raise ValueError(
                f"manifest entry reason = {self.reason!r}: must be one of "
                f"{', '.join(sorted(REASONS))}"
            )
        if not isinstance(self.pinned, bool):
            raise ValueError(f"manifest entry pinned = {self.pinned!r}: must be true/false")
        if isinstance(self.time, bool) or not isinstance(self.time, (int, float)):
            raise ValueError(f"manifest entry time = {self.time!r}: must be a number")
        self.time = float(self.time)


def read_manifest(directory: os.PathLike | str) -> dict[int, ManifestEntry]:
    """The manifest of ``directory`` as {step: ManifestEntry} (docs/checkpoint-format.md#manifest,
    docs/checkpoint-format.md#validity).

    A missing manifest gives {}. An unreadable or garbage file gives {} and a
    warnings.warn (UserWarning) naming the file and what is wrong; a single bad entry is
    skipped with a warning naming its index. Never raises for bad content.
    """
    path = RunLayout(directory).manifest
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        warnings.warn(
            f"{path}: cannot read the checkpoint manifest ({exc}); checkpoints "
            f"are validated without checksums",
            stacklevel=2,
        )
        return {}
    try:
        doc = json.loads(text)
    except ValueError as exc:
        warnings.warn(
            f"{path}: not valid JSON ({exc}); ignoring the manifest, checkpoints "
            f"are validated without checksums; it is rewritten at the next save",
            stacklevel=2,
        )
        return {}
    records = doc.get("checkpoints") if isinstance(doc, dict) else None
    if not isinstance(records, list):
        warnings.warn(
            f"{path}: no 'checkpoints' list (format {MANIFEST_FORMAT} expected); "
            f"ignoring the manifest, it is rewritten at the next save",
            stacklevel=2,
        )
        return {}
    entries: dict[int, ManifestEntry] = {}
    for index, record in enumerate(records):
        try:
            if not isinstance(record, dict):
                raise ValueError(f"expected an object, got {type(record).__name__}")
            entry = ManifestEntry(**{k: record[k] for k in ManifestEntry.__dataclass_fields__})
            entries[entry.step] = entry
        except (KeyError, TypeError, ValueError) as exc:
            warnings.warn(f"{path}: entry {index} skipped ({exc!s})", stacklevel=2)
    return entries


@contextlib.contextmanager
def editing_manifest(directory: os.PathLike | str) -> Iterator[dict[int, ManifestEntry]]:
    """Hold the manifest's lock and yield its entries ({step: ManifestEntry}) to change in
    place; on leaving, write them back atomically if they changed (nothing is written after an
    exception). The worker's writer thread records and retires checkpoints while the proxy may
    pin one (collapse watch), in two processes. Raises filelock.Timeout after 30 s, OSError if
    the manifest cannot be written (the old one stays intact)."""
    layout = RunLayout(directory)
    with FileLock(str(layout.manifest_lock), timeout=30):
        entries = read_manifest(directory)
        before = copy.deepcopy(entries)
        yield entries
        if entries != before:
            records = [asdict(entries[s]) for s in sorted(entries)]
            doc = {"format": MANIFEST_FORMAT, "checkpoints": records}
            atomic_write_bytes(layout.manifest, (json.dumps(doc, indent=1) + "\n").encode("utf-8"))


def set_pinned(directory: os.PathLike | str, step: int, pinned: bool = True) -> bool | None:
    """Pin (or with pinned=False release) the entry of `step`, so retention never deletes it;
    returns its state before, or None if it has no entry (already retired)."""
    with editing_manifest(directory) as entries:
        if step not in entries:
            return None
        was = entries[step].pinned
        entries[step].pinned = pinned
        return was


def record_checkpoint(directory: os.PathLike | str, entry: ManifestEntry) -> None:
    """Add or replace the entry for ``entry.step`` in the manifest, atomically (docs/checkpoint-format.md#atomic-write).

    Read-modify-write under the lock (``editing_manifest``), written with ``atomic_write_bytes``.
    Call after the checkpoint itself is durable. Raises OSError if the manifest cannot be
    written (the old manifest stays intact).
    """
    with editing_manifest(directory) as entries:
        entries[entry.step] = entry


def manifest_checksums(entries: dict[int, ManifestEntry]) -> dict[int, str]:
    """{step: "crc32:%08x"} from read_manifest's result, for scan_for_resume (docs/checkpoint-format.md#validity)."""
    return {step: entry.checksum for step, entry in entries.items()}


DEFAULT_KEEP_LAST = 3  # newest checkpoints kept (>= 2: the newest may still be being written)
DEFAULT_KEEP_EVERY = 10000  # also keep every step that is a multiple of this (0 = off)


def plan_retention(
    steps: list[int], pinned: set[int], keep_last: int, keep_every: int
) -> list[int]:
    """Steps retention may delete, ascending (docs/checkpoint-format.md#retention). Pure: touches no file.

    steps: the checkpoints present (duplicates ignored). Keeps the newest ``keep_last`` (>= 2:
    the newest may still be being written), every step with ``step % keep_every == 0`` when
    keep_every > 0 (0 disables), and every pinned step; returns all the others. Raises
    ValueError if keep_last < 2 or keep_every < 0.
    """
    if keep_last < 2:
        raise ValueError(
            f"keep_last = {keep_last}: must be >= 2 (the newest checkpoint may "
            f"still be being written, docs/checkpoint-format.md#retention)"
        )
    if keep_every < 0:
        raise ValueError(f"keep_every = {keep_every}: must be >= 0 (0 disables it)")
    ordered = sorted(set(steps))
    kept = set(ordered[-keep_last:]) | set(pinned)
    return [s for s in ordered if s not in kept and not (keep_every > 0 and s % keep_every == 0)]
