"""Applying retention to a run directory (docs/checkpoint-format.md#retention).

What it is: ``apply_retention``, which retires the checkpoints ``plan_retention`` dooms. The
worker's writer calls it after each durable checkpoint; the kill -9 test's writer child too.

What it is not: the plan (``shared.checkpoint.manifest.plan_retention``, a pure function), the
write engine (``shared/checkpoint/write.py``) or the writer thread (``worker/checkpointer.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib

from shared.checkpoint.directory import list_checkpoints
from shared.checkpoint.file_format import expected_size
from shared.checkpoint.manifest import editing_manifest, plan_retention
from shared.checkpoint.write import recycle_checkpoint, reusable

log = logging.getLogger("shared.checkpoint.retention")


def apply_retention(
    directory: os.PathLike | str, n_params: int, keep_last: int, keep_every: int
) -> list[int]:
    """Retire what retention allows in ``directory`` (docs/checkpoint-format.md#retention):
    never a pinned checkpoint, never a file without a manifest entry (another writer's).

    n_params: the run's parameter count (a doomed file of exactly ``8 + 12 * n_params`` bytes
    can be reused). keep_last, keep_every: as ``plan_retention``. The oldest doomed file, if a
    regular file with no other name (``reusable``: never a symlink's target, never an operator's
    hard link), is renamed to ``RECYCLED_NAME``, overwritten in place by the next write (on a
    virtual disk that costs training less than a new file plus a delete); the others are
    deleted; then their entries leave the manifest. A kill at any point leaves each doomed file
    under its name, retired, or gone, and an entry without a file is ignored by every reader.
    Returns the doomed steps, ascending. Raises OSError (other than a file already gone) from
    the rename or delete.
    """
    directory = pathlib.Path(directory)
    with editing_manifest(directory) as entries:  # a pin made meanwhile waits, or is seen
        known = [s for s, _ in list_checkpoints(directory) if s in entries]
        pinned = {s for s, e in entries.items() if e.pinned}
        doomed = plan_retention(known, pinned, keep_last, keep_every)  # ascending
        for i, s in enumerate(doomed):
            _retire(directory / entries[s].file, n_params, reuse=i == 0)
        for s in doomed:
            del entries[s]
    return doomed


def _retire(path: pathlib.Path, n_params: int, reuse: bool) -> None:
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)  # a symlink is a link: removed, its target never reused
        if reuse and st.st_size == expected_size(n_params) and reusable(st):
            try:
                recycle_checkpoint(path)
                log.info("retention: retired %s (its file is the next write's)", path.name)
                return
            except OSError as exc:
                if isinstance(exc, FileNotFoundError):
                    raise
                log.warning("retention: cannot retire %s (%s): deleted", path.name, exc)
        path.unlink()
        log.info("retention: deleted %s", path.name)
