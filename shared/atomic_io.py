"""Atomic small-file I/O for the run directory: write-to-temporary, fsync, rename, fsync dir.

What it is: the one way `shared/`, `proxy/` and `worker/` write sidecar JSONs and other small
files so that a reader never sees a half-written file, even after a kill or a power cut, and
the one reader of small JSON files (`read_json`), with the error policy chosen by the caller.
What it is not: an appender or the reader of `.loss.json` (`shared/run/loss_history.py`), or a
checkpoint writer.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Collection
from typing import Any, Literal

log = logging.getLogger("shared.atomic_io")

# errno of a write that failed for the storage, not the program: the disk or the quota is full,
# the file system went read-only or failed, the file hit a size limit
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def named(e: OSError, path) -> OSError:
    """`e` with `path` as its file name (an fd write or a temporary's error names no run file);
    the same subclass (OSError picks it from the errno)."""
    if e.errno is None:
        return e
    out = OSError(e.errno, e.strerror, os.fspath(path))
    out.__cause__ = e
    return out


def storage_failure(e: BaseException) -> str | None:
    """The one line for a write that failed for the storage (STORAGE_ERRNOS): the file, the
    cause, that what the file held before this write is intact, and what to do; None for any
    other error (docs/operations.md#a-full-disk)."""
    if not isinstance(e, OSError) or e.errno not in STORAGE_ERRNOS:
        return None
    where = e.filename or "a run file"
    return (
        f"{where}: {e.strerror} ({errno.errorcode.get(e.errno, e.errno)}) while writing it; what "
        "it held before this write is intact. Free space on its file system (or make it "
        "writable), then run the same command again: the run resumes from its newest checkpoint"
    )


# errno of a file system that cannot fsync a directory at all (procfs, some FUSE and network
# file systems): the rename is still atomic, only its durability rests on the file system.
DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})


def fsync_dir(path) -> None:
    """fsync directory `path` so that a rename or a create inside it survives a power cut
    (docs/checkpoint-format.md#atomic-write). The one policy for every writer: a file system
    that cannot fsync a directory (errno in DIR_FSYNC_UNSUPPORTED) is tolerated; any other
    OSError propagates (ENOENT, ENOTDIR: not a directory; EIO: the data may not be on disk)."""
    fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def current_umask() -> int:
    """This process's umask, read without changing it (os.umask can only set it, which is not
    thread-safe): /proc/self/status's "Umask:" line on Linux, else 0o022."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def atomic_write_bytes(path, data: bytes, durable: bool = True) -> None:
    """Replace `path` with `data` atomically: a temporary in the same directory, fsync, rename.
    The file gets the mode a plain open() would give it (0o666 less the umask; a temporary of
    tempfile.mkstemp alone would leave it 0o600, unreadable to the group). `durable=False`
    leaves out both fsyncs: readers still see the old or the new file whole, but a power cut
    may lose the write; for files rebuilt at every start (the handshake, `.status.json`),
    written many times a second at high step rates.

    On any error the temporary is removed and the previous file (if any) is left intact.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(
        prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory
    )
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename in (None, tmp):
            raise named(e, path) from e
        raise
    if durable:
        fsync_dir(directory)


def atomic_write_json(path, obj: Any, durable: bool = True) -> None:
    """Write `obj` as compact JSON plus a newline, atomically (`durable`: atomic_write_bytes)."""
    text = json.dumps(obj, indent=None, separators=(",", ":")) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"), durable)


Garbage = Literal["raise", "default", "aside"]


class JSONFileError(ValueError):
    """A small JSON file that cannot be used: not UTF-8, not JSON, or not the value expected.
    str(): the file, `reason` and what to do; `path`: the file; `reason`: what is wrong, with
    the byte offset of the first bad byte where there is one."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}; restore it from a backup or move it aside")
        self.path, self.reason = path, reason


def read_json(
    path,
    default: Any = None,
    *,
    garbage: Garbage = "raise",
    expect: type | None = None,
    missing_ok: bool = True,
) -> Any:
    """The JSON content of the file at `path`, the project's one reader of small JSON files;
    `default` when the file does not exist (FileNotFoundError instead with missing_ok=False).
    A file that is not UTF-8 JSON, cannot be read, or whose top-level value is not an `expect`
    (dict, list, ...; None: anything) is handled by the caller's `garbage` policy
    (docs/architecture.md#bad-input-and-faults):

    - "raise": a JSONFileError (a ValueError naming the file and the byte offset of the first
      bad byte, or what the value is), or the OSError;
    - "default": return `default` (a reader that must never disturb a live run: `status`);
    - "aside": move it to `<name>.corrupt-<time>` (`aside_name`) with a warning naming it and
      return `default` (a file its owner rebuilds: `.samples.json`, `.state.json`); an OSError
      returns `default`.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            value = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise JSONFileError(
                path, f"not UTF-8 at byte {e.start} ({len(raw)} bytes in file)"
            ) from None
        except json.JSONDecodeError as e:
            offset = len(e.doc[: e.pos].encode("utf-8"))
            raise JSONFileError(
                path, f"invalid JSON at byte {offset} of {len(raw)} ({e.msg})"
            ) from None
        if expect is not None and not isinstance(value, expect):
            raise JSONFileError(
                path, f"a JSON {type(value).__name__}, not the {expect.__name__} expected"
            )
        return value
    except FileNotFoundError:
        if missing_ok:
            return default
        raise
    except (ValueError, OSError) as e:
        if garbage == "raise":
            raise
        if garbage == "aside" and isinstance(e, ValueError):
            aside = aside_name(path, "corrupt")
            os.replace(path, aside)
            log.warning(
                "%s: unreadable (%s); moved aside to %s and starting it afresh",
                path,
                e,
                os.path.basename(aside),
            )
        return default


def aside_name(path: str, kind: str) -> str:
    """`<path>.<kind>-<unix time>`, with `.1`, `.2`, ... appended while that name exists, so a
    second file moved aside in the same second never overwrites the first one's bytes."""
    base = f"{path}.{kind}-{int(time.time())}"
    names = itertools.chain([base], (f"{base}.{k}" for k in itertools.count(1)))
    return next(name for name in names if not os.path.exists(name))


_TEMP_NAME = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")  # tempfile.mkstemp in atomic_write_bytes
STALE_WRITE_S = 60.0


def clean_stale_writes(
    directory, older_than_s: float = STALE_WRITE_S, targets: Collection[str] = ()
) -> list[str]:
    """Delete temporaries of `atomic_write_bytes` (`.NAME.XXXXXXXX.tmp`) in `directory` that
    were last touched more than `older_than_s` seconds ago: a writer killed with SIGKILL between
    the write and the rename leaves one (the target file is intact). Younger ones may belong to
    a writer at work (a `status` or `pivot` command) and are left; `older_than_s` <= 0 removes
    them whatever their age (a directory no one else writes into), and so does a NAME in
    `targets` (files whose every writer the caller has excluded by its locks). Call it with the
    run lock held. Returns the names removed, sorted; a missing directory gives []."""
    now, out = time.time(), []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    for e in entries:
        if not _TEMP_NAME.match(e.name) or not e.is_file(follow_symlinks=False):
            continue
        with contextlib.suppress(FileNotFoundError):
            if (
                older_than_s <= 0
                or e.name[1:-13] in targets  # "." NAME ".XXXXXXXX.tmp"
                or now - e.stat(follow_symlinks=False).st_mtime > older_than_s
            ):
                os.unlink(e.path)
                out.append(e.name)
    return sorted(out)
