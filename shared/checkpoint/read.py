"""Reading a checkpoint file: its header, the validity rules, loading it, its checksum
(docs/checkpoint-format.md#validity).

What it is: ``read_header``, ``validate_checkpoint`` (rules 1-8), ``load_checkpoint`` (weights, m
and v, read once straight into the caller's arrays) and ``load_weights`` (the weights only).

What it is not: the layout and names (``shared/checkpoint/file_format.py``), the directory's
policy (``shared/checkpoint/directory.py``: listing, the newest valid file, quarantine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import re
import stat
import sys

import numpy as np

from shared.checkpoint.file_format import (
    CHECKSUM_CHUNK,
    F32,
    HEADER,
    HEADER_BYTES,
    BackgroundCrc,
    CheckpointError,
    CheckpointInfo,
    check_n_params,
    checkpoint_name,
    crc32,
    expected_size,
    format_crc,
    parse_checkpoint_name,
)

VALUE_CHUNK = 8 * 1024 * 1024  # bytes per piece when rule 8 reads a file
READ_ALIGN = 64  # bytes: a copy from the page cache is fastest when source and destination agree


def _header_from(f, path: pathlib.Path, size: int) -> tuple[int, int]:
    name = path.name
    if size == 0:
        raise CheckpointError(
            f"{name}: 0 bytes (zero-length file), expected at least {HEADER_BYTES} header "
            f"bytes: the write never completed; the file is kept, resume from an older "
            f"checkpoint",
            path=path,
            rule="empty",
        )
    head = f.read(HEADER_BYTES)
    if size < HEADER_BYTES or len(head) < HEADER_BYTES:
        raise CheckpointError(
            f"{name}: {max(size, len(head)):,} bytes, shorter than the {HEADER_BYTES}-byte "
            f"header: truncated write? the file is kept, resume from an older checkpoint",
            path=path,
            rule="short-header",
        )
    return HEADER.unpack(head)


@contextlib.contextmanager
def _open_regular(path: pathlib.Path):
    """`path` open for unbuffered binary reading, refusing anything but a regular file before
    a read can block: a FIFO or a device named like a checkpoint would hang its reader (opened
    with O_NONBLOCK, checked with fstat). Raises CheckpointError (rule "io") for such a file,
    and for an OSError opening or reading it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kinds = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO"}
                raise CheckpointError(
                    f"{path.name}: {kinds.get(stat.S_IFMT(mode), 'not a regular file')}, not a "
                    f"checkpoint file: move it out of the run directory or give a checkpoint file",
                    path=path,
                    rule="io",
                )
            os.set_blocking(fd, True)
            f = os.fdopen(fd, "rb", buffering=0)
        except BaseException:
            os.close(fd)
            raise
        with f:
            yield f
    except OSError as exc:
        raise CheckpointError(
            f"{path.name}: cannot read ({exc.strerror or exc}): check that {path} is a readable "
            f"regular file",
            path=path,
            rule="io",
        ) from exc


def read_header(path: os.PathLike | str) -> tuple[int, int]:
    """The header of a checkpoint file: (step, n_params), two Python ints (docs/checkpoint-format.md).

    Reads only the first 8 bytes (little-endian int32, int32); does not check the name or size.
    Raises CheckpointError (rule "empty"/"short-header") if the file has fewer than 8 bytes,
    (rule "io") if it cannot be opened.
    """
    path = pathlib.Path(path)
    with _open_regular(path) as f:
        return _header_from(f, path, os.fstat(f.fileno()).st_size)


def _check_structure(f, path: pathlib.Path, n_params: int | None) -> CheckpointInfo:
    """Rules 1-6 of validate_checkpoint on an open file positioned at 0."""
    name = path.name
    name_step = parse_checkpoint_name(name)
    if name_step is None:
        raise CheckpointError(
            f"{name}: not a checkpoint name (expected step_NNNNNN.bin with at least six "
            f"digits, e.g. {checkpoint_name(100)}): rename it or move it out of the run "
            f"directory",
            path=path,
            rule="name",
        )
    size = os.fstat(f.fileno()).st_size
    step, n = _header_from(f, path, size)
    if n <= 0:
        raise CheckpointError(
            f"{name}: header n_params = {n:,}, must be >= 1: corrupt header or not a "
            f"checkpoint file; the file is kept, resume from an older checkpoint",
            path=path,
            rule="header-n",
        )
    if size != (want := expected_size(n)):
        hint = (
            "truncated write? (killed mid-write or disk full)"
            if size < want
            else "trailing bytes: not written by this format's writer, or appended to"
        )
        raise CheckpointError(
            f"{name}: {size:,} bytes, expected {want:,} (8 + 12 x {n:,}): {hint}; the file "
            "is kept, resume from an older checkpoint",
            path=path,
            rule="size",
        )
    if step != name_step:
        fix = (
            f"rename it to {checkpoint_name(step)} if the header is right"
            if step >= 0
            else "the header is corrupt"
        )
        raise CheckpointError(
            f"{name}: header step {step:,} differs from the name's step {name_step:,}: "
            f"renamed or copied by hand? {fix}; the file is kept",
            path=path,
            rule="step",
        )
    if n_params is not None and n != n_params:
        raise CheckpointError(
            f"{name}: the model has {n_params:,} parameters, the file has {n:,}; the "
            f"architecture differs: resume with the architecture in run.json, or start a "
            f"new run directory",
            path=path,
            rule="n_params",
        )
    return CheckpointInfo(path=path, step=step, n_params=n, nbytes=size)


def _check_crc(path: pathlib.Path, crc: int, want: str | None) -> str:
    """The file's "crc32:%08x" from its running crc32; CheckpointError (rule "checksum") when it
    is not `want` (None: nothing to compare with)."""
    got = format_crc(crc)
    if want is not None and got != want:
        raise CheckpointError(
            f"{path.name}: checksum {got}, the manifest records {want}: the file changed after "
            f"it was written (bit rot, partial copy, another writer); the file is kept, resume "
            f"from an older checkpoint",
            path=path,
            rule="checksum",
        )
    return got


@contextlib.contextmanager
def _opened(path: os.PathLike | str, n_params: int | None, checksum: str | None):
    """The open file, its CheckpointInfo (rules 1-6) and the normalised `checksum` (or None),
    for the loaders' shared preamble; an OSError inside becomes CheckpointError (rule "io")."""
    path = pathlib.Path(path)
    n_params = check_n_params(n_params)
    want = None if checksum is None else str(checksum).strip().lower()
    if want is not None and re.fullmatch(r"crc32:[0-9a-f]{8}", want) is None:
        raise CheckpointError(
            f"{path.name}: expected checksum {checksum!r} is not of the form crc32:xxxxxxxx: "
            f"the manifest entry is damaged; drop it to load the file unchecked",
            path=path,
            rule="checksum",
        )
    with _open_regular(path) as f:
        yield f, _check_structure(f, path, n_params), want


def validate_checkpoint(
    path: os.PathLike | str,
    n_params: int | None,
    checksum: str | None = None,
    *,
    values: bool = False,
) -> CheckpointInfo:
    """Check one checkpoint file against the rules of docs/checkpoint-format.md#validity.

    path: the ``step_NNNNNN.bin`` file. n_params: the model's parameter count, or None to
    skip that rule. checksum: ``"crc32:%08x"`` from the manifest, or None to skip (with it
    the whole file is read once). values: where no checksum is given, also read the file
    (once, in pieces of VALUE_CHUNK bytes: no buffer of the file's size) and check rule 8
    (``check_values``), computing the file's checksum in the same pass
    (``CheckpointInfo.checksum``); without it no weights are read.
    Returns CheckpointInfo. Raises CheckpointError for the FIRST failing rule, in order:
    name unparseable ("name"); zero-length ("empty") or < 8 bytes ("short-header"); header
    n_params <= 0 ("header-n"); size != 8 + 12*header_n ("size"); header step != name's
    ("step"); header n_params != n_params ("n_params", naming both counts); checksum
    mismatch ("checksum"); a non-finite value or a negative v ("values"); unreadable file
    ("io"). Never modifies or deletes the file.
    """
    with _opened(path, n_params, checksum) as (f, info, want):
        if want is not None or values:
            crc = _stream_regions(f, info, ("weights", "m", "v"), _header_crc(info), want is None)
            got = _check_crc(info.path, crc, want)
            if want is None:
                info = dataclasses.replace(info, checksum=got)
    return info


def check_values(
    path: os.PathLike | str, weights: np.ndarray, m: np.ndarray, v: np.ndarray
) -> None:
    """Rule 8 of docs/checkpoint-format.md#validity, for a checkpoint no checksum vouches for:
    every weight and every m is finite, every v is finite and >= 0 (AdamW's second moment is
    an average of squared gradients: Kingma & Ba 2015, Loshchilov & Hutter 2019).

    weights, m, v: float32 1-D arrays (any length, equal or not). Scans with min/max (no
    temporary of the arrays' size; about 0.05 s for andrea-12m's 115 M floats). Raises
    CheckpointError (rule "values") naming the file, the region, the first bad element's index
    and its value.
    """
    for name, arr in (("weights", weights), ("m", m), ("v", v)):
        _check_piece(pathlib.Path(path), name, arr, 0)


def _check_piece(path: pathlib.Path, name: str, arr: np.ndarray, at: int) -> None:
    if arr.size == 0:
        return
    lo, hi = float(arr.min()), float(arr.max())  # NaN propagates through both
    if math.isfinite(lo) and math.isfinite(hi) and (name != "v" or lo >= 0.0):
        return
    bad = ~np.isfinite(arr)
    if name == "v":
        bad |= arr < 0
    i = int(np.flatnonzero(bad)[0])
    raise CheckpointError(
        f"{path.name}: {name}[{at + i:,}] = {str(arr[i])}"
        + (" (v must be >= 0: an average of squared gradients)" if name == "v" else "")
        + ": the file holds a non-finite or impossible value and no manifest checksum "
        "vouches for it (diverged training copied in, or a corrupt file); the file is "
        "kept, resume from an older checkpoint",
        path=path,
        rule="values",
    )


def empty_for_read(count: int, file_offset: int) -> np.ndarray:
    """An uninitialised little-endian float32 array of ``count`` elements whose address is
    congruent to ``file_offset`` modulo READ_ALIGN, to read the file's bytes from that offset
    into. The kernel's copy from the page cache runs at a third of its speed when the two
    addresses disagree (measured on x86-64: 154 MB from file offset 8 into a buffer at offset
    16 of a page took 0.050 s, into one at offset 8 + 64k 0.012 s: scripts/bench_checkpoint.py's
    load figure); a plain ``np.empty`` sits at an arbitrary 16-byte boundary."""
    raw = np.empty(4 * count + READ_ALIGN, dtype=np.uint8)
    shift = (file_offset - raw.ctypes.data) % READ_ALIGN
    return raw[shift : shift + 4 * count].view(F32)


def _read_exact(
    f, view: memoryview, path: pathlib.Path, at: int, total: int, crc: BackgroundCrc | None = None
) -> None:
    """Fill ``view`` from the open file's position (byte ``at`` of ``total``), the one read loop:
    raw reads may be short (Linux caps one at about 2 GiB), so it loops until the view is full.
    With ``crc``, reads in CHECKSUM_CHUNK pieces, each fed to the helper thread while the next is
    read. Raises CheckpointError (rule "size") naming the offset where the file ended: it shrank
    while read."""
    done, n = 0, len(view)
    while done < n:
        end = n if crc is None else min(n, done + CHECKSUM_CHUNK)
        got = f.readinto(view[done:end])
        if not got:
            raise CheckpointError(
                f"{path.name}: ended after {at + done:,} of {total:,} bytes while it was read: "
                f"the file shrank during the read (another writer?); the file is kept, retry or "
                f"resume from an older checkpoint",
                path=path,
                rule="size",
            )
        if crc is not None:
            crc.feed(view[done : done + got])
        done += got


def _bytes_of(a: np.ndarray) -> memoryview:
    return memoryview(a).cast("B")  # type: ignore[arg-type]  # numpy's stubs omit the buffer protocol


def _stream_regions(f, info: CheckpointInfo, names: tuple[str, ...], crc: int, check: bool) -> int:
    """Read the regions ``names`` (of "weights", "m", "v", in file order, the file positioned at
    the first) in VALUE_CHUNK pieces into one reused buffer: each piece continues the running
    crc32 ``crc`` and, with ``check``, meets rule 8. Returns the running crc32. Memory: one
    piece, whatever the file's size."""
    n = info.n_params
    at = HEADER_BYTES + 4 * n * ("weights", "m", "v").index(names[0])
    piece = empty_for_read(min(n, VALUE_CHUNK // 4), at)  # every piece starts at at + k x 8 MiB
    view = _bytes_of(piece)
    for name in names:
        done = 0
        while done < n:
            k = min(n - done, piece.shape[0])
            _read_exact(f, view[: 4 * k], info.path, at, info.nbytes)
            crc = crc32(view[: 4 * k], crc)
            if check:
                _check_piece(info.path, name, piece[:k], done)
            done, at = done + k, at + 4 * k
    return crc


def _header_crc(info: CheckpointInfo) -> int:
    return crc32(HEADER.pack(info.step, info.n_params))


def load_checkpoint(
    path: os.PathLike | str,
    n_params: int | None,
    checksum: str | None = None,
    out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    *,
    values: bool | None = None,
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Validate and read a checkpoint: (step, weights, m, v) (docs/checkpoint-format.md#validity).

    Same arguments and CheckpointError rules as ``validate_checkpoint``, checked on the same
    open file that is then read. The three arrays are float32, 1-D, length n_params,
    contiguous and writable: views of ONE preallocated buffer of 3*n_params, or, with
    ``out``, the three arrays given (each float32, C-contiguous, writable, n_params long;
    a resume passes the model's and the optimizer's own memory, so the file is read straight
    into where it is used: no second buffer, no copy). Either way the file is read once; the
    checksum, when given, is computed in a helper thread over each 8 MiB piece already read
    while the next piece is read. With ``out``, a CheckpointError raised after the read began
    leaves them partly overwritten. Raises ValueError (before reading) when ``out`` does not
    fit, or on a big-endian host (the file is little-endian: no ``out`` there).
    values: check rule 8 (``check_values``: finite, v >= 0) on what was read; None (the
    default) checks it exactly when no checksum is given, so a file that nothing vouches for
    is never trained from with NaN in it; False leaves it to the caller (``inspect`` reports
    the non-finite counts itself).
    """
    with _opened(path, n_params, checksum) as (f, info, want):
        n = info.n_params
        if out is None:
            buf = empty_for_read(3 * n, HEADER_BYTES)
            parts = (buf[:n], buf[n : 2 * n], buf[2 * n :])
        else:
            _check_out("load_checkpoint", n, out, ("weights", "m", "v"))
            parts = out
        crc = BackgroundCrc(_header_crc(info)) if want is not None else None
        try:
            at = HEADER_BYTES
            for part in parts if out is not None else (buf,):
                view = _bytes_of(part)
                _read_exact(f, view, info.path, at, info.nbytes, crc)
                at += len(view)
        finally:
            if crc is not None:
                crc.close()
    if crc is not None:  # there is a checksum to compare with
        _check_crc(info.path, crc.result(), want)
    if values if values is not None else want is None:
        check_values(info.path, *parts)  # "<f4" views: numpy reads them right on any host
    w, m, v = parts
    if sys.byteorder != "little" and out is None:  # big-endian host: native order for callers
        w, m, v = (p.astype(np.float32) for p in parts)
    return info.step, w, m, v


def load_weights(
    path: os.PathLike | str,
    n_params: int | None,
    checksum: str | None = None,
    out: np.ndarray | None = None,
    *,
    values: bool | None = None,
) -> tuple[int, np.ndarray]:
    """(step, weights) of a checkpoint, the file opened and read once (docs/checkpoint-format.md#validity).

    Same arguments, rules and CheckpointError as ``load_checkpoint``, checked on the same open
    file that is then read; only the weights region is kept: m and v are read in
    CHECKSUM_CHUNK pieces through the checksum (and rule 8) and dropped, so memory is the
    weights' 4 x n_params bytes and one piece. The checksum covers exactly the bytes returned:
    a file replaced by name, or retired and overwritten in place by the run's next checkpoint
    (docs/checkpoint-format.md#retention), while it is read gives a CheckpointError, never
    weights the checksum did not vouch for. Returns float32 (n_params,) weights: ``out`` (a
    writable C-contiguous float32 array of n_params elements, e.g. a model's flat weights;
    ValueError before reading otherwise, or on a big-endian host) or a new array. values: as
    ``load_checkpoint`` (None: rule 8 exactly when no checksum is given).
    """
    with _opened(path, n_params, checksum) as (f, info, want):
        check = values if values is not None else want is None
        n = info.n_params
        if out is not None:
            _check_out("load_weights", n, (out,), ("weights",))
        weights = empty_for_read(n, HEADER_BYTES) if out is None else out
        view = _bytes_of(weights)
        _read_exact(f, view, info.path, HEADER_BYTES, info.nbytes)
        if check:
            _check_piece(info.path, "weights", weights, 0)
        crc = _stream_regions(f, info, ("m", "v"), crc32(view, _header_crc(info)), check)
    _check_crc(info.path, crc, want)
    if sys.byteorder != "little" and out is None:
        weights = weights.astype(np.float32)  # native order for callers
    return info.step, weights


def _check_out(caller: str, n: int, out: tuple, names: tuple[str, ...]) -> None:
    """ValueError naming `caller` unless `out` holds one array per name of `names`, each a
    writable C-contiguous float32 array of `n` elements, on a little-endian host."""
    if sys.byteorder != "little":
        raise ValueError(f"{caller}(out=...) needs a little-endian host (the file's order)")
    if len(out) != len(names):
        raise ValueError(f"{caller}(out=...) takes ({', '.join(names)}), got {len(out)} arrays")
    for name, a in zip(names, out):
        if (
            a.dtype != np.float32
            or a.shape != (n,)
            or not a.flags.c_contiguous
            or not a.flags.writeable
        ):
            raise ValueError(
                f"{caller}(out=...): {name} must be a writable C-contiguous float32 "
                f"array of {n:,} elements (the file's n_params), got {a.dtype} {a.shape}"
            )
