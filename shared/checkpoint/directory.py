"""The run directory's checkpoints: listing, stale temporaries, the newest valid file,
quarantine (docs/checkpoint-format.md#validity, #atomic-write).

What it is: the policy over a directory of ``step_NNNNNN.bin`` files, one function for each of
the four duties above.

What it is not: the layout or validation of one file (``shared/checkpoint/file_format.py``), writing
one (``shared/checkpoint/write.py``), the manifest or retention (``shared/checkpoint/manifest.py``).
Standard library only (and the format module).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pathlib

from shared.atomic_io import fsync_dir
from shared.checkpoint.file_format import (
    CheckpointError,
    CheckpointInfo,
    check_n_params,
    is_temporary_name,
    parse_checkpoint_name,
)
from shared.checkpoint.read import validate_checkpoint
from shared.run.layout import RunLayout

# ---------------------------------------------------------------------------- directories


def _scan(directory: pathlib.Path):
    try:
        return list(os.scandir(directory))
    except OSError as exc:
        raise CheckpointError(
            f"{directory}: cannot list the checkpoint directory ({exc.strerror or exc}): "
            f"check the --run-dir path",
            path=directory,
            rule="io",
        ) from exc


def clean_stale_temporaries(directory: os.PathLike | str) -> list[pathlib.Path]:
    """Delete leftover checkpoint temporaries (``.step_*.bin.tmp-*``) in ``directory``.

    Call at start, before this process's writer runs (docs/checkpoint-format.md#atomic-write;
    one owner per run directory, docs/architecture.md#one-proxy-per-run-directory). Only regular
    files and links whose name matches are removed; ``step_*.bin`` files are never touched.
    Returns the removed paths, sorted. Raises CheckpointError (rule "io") if the directory
    cannot be listed; a temporary that vanished meanwhile is ignored.
    """
    directory = pathlib.Path(directory)
    removed = []
    for entry in _scan(directory):
        if not is_temporary_name(entry.name) or entry.is_dir(follow_symlinks=False):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(directory / entry.name)
    return sorted(removed)


def list_checkpoints(directory: os.PathLike | str) -> list[tuple[int, pathlib.Path]]:
    """All checkpoint files in ``directory`` as (step, path), ascending by integer step.

    Sorted by the parsed integer, never by text, so ``step_1000000.bin`` follows
    ``step_999999.bin`` (docs/checkpoint-format.md#name). Names that do not parse (``step_latest.bin``,
    ``*.bak``, temporaries, ...) and directories are ignored. Contents are not checked.
    Raises CheckpointError (rule "io") if the directory cannot be listed.
    """
    directory = pathlib.Path(directory)
    return sorted(  # one name per step: by step
        (step, directory / entry.name)
        for entry in _scan(directory)
        if (step := parse_checkpoint_name(entry.name)) is not None and not entry.is_dir()
    )


def scan_for_resume(
    directory: os.PathLike | str,
    n_params: int | None,
    checksums: dict[int, str] | None = None,
    *,
    values: bool = False,
) -> tuple[CheckpointInfo | None, list[CheckpointError]]:
    """The newest valid checkpoint in ``directory`` and the newer ones rejected
    (docs/checkpoint-format.md#validity). Deletes nothing.

    n_params: the model's parameter count (None: not checked). checksums: step -> the
    manifest's "crc32:%08x" for the steps it knows; files without an entry are checked
    without a checksum (another writer's file still loads). values: a file without one is also
    read and checked against rule 8 (finite values, v >= 0; ``validate_checkpoint(values=True)``):
    what a resume does, so that a file no checksum vouches for is never trained from with NaN.

    Walks newest-first by integer step; returns (info, rejected): info is the first file passing
    validate_checkpoint (None if none does), rejected lists, newest first, one CheckpointError
    per newer file that failed, with ``.path`` (the file), ``.rule`` (the rule it broke: "size",
    "step", "n_params", "checksum", ...) and the operator message as ``str(err)``. Raises
    CheckpointError if n_params is outside 1..INT32_MAX or the directory cannot be listed.
    """
    n_params = check_n_params(n_params)
    checksums = checksums or {}
    rejected: list[CheckpointError] = []
    for step, path in reversed(list_checkpoints(directory)):
        try:
            return validate_checkpoint(path, n_params, checksums.get(step), values=values), rejected
        except CheckpointError as exc:
            if exc.path is None:
                exc.path = path
            rejected.append(exc)
    return None, rejected


def quarantine_checkpoint(path: os.PathLike | str) -> pathlib.Path:
    """Move a rejected checkpoint into its run directory's ``rejected/`` (shared/run/layout.py),
    out of reach of the next write of its step, of retention and of ``list_checkpoints``
    (docs/checkpoint-format.md#validity). The name is kept; if the folder already holds that
    name, ``.1``, ``.2``, ... is appended. Same filesystem, so it is a rename (no copy);
    the directories are fsynced. Returns the new path.
    Raises CheckpointError (rule "io") if the folder cannot be created or the rename fails
    (the file then stays where it was).
    """
    path = pathlib.Path(path)
    dest_dir = RunLayout(path.parent).rejected
    try:
        dest_dir.mkdir(exist_ok=True)
        names = itertools.chain([path.name], (f"{path.name}.{k}" for k in itertools.count(1)))
        dest = next(dest_dir / name for name in names if not (dest_dir / name).exists())
        os.rename(path, dest)
        fsync_dir(dest_dir)
        fsync_dir(path.parent)
    except OSError as exc:
        raise CheckpointError(
            f"{path.name}: cannot move it to {dest_dir} ({exc.strerror or exc}): it stays "
            f"where it is; move it aside by hand before training reaches its step",
            path=path,
            rule="io",
        ) from exc
    return dest
