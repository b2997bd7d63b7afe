"""The flat checkpoint file: names, layout, limits, validation, loading, checksums (docs/checkpoint-format.md).

What it is: the one place that knows the byte layout of ``step_NNNNNN.bin``

    offset 0       int32    step      optimizer updates completed
    offset 4       int32    n_params  length of each array below
    offset 8       float32[n_params]  weights
    offset 8+4n    float32[n_params]  m  (AdamW exp_avg)
    offset 8+8n    float32[n_params]  v  (AdamW exp_avg_sq)
    total          8 + 12 * n_params bytes, little-endian, no padding

and how to name one, check one, load one and checksum one (``BackgroundCrc``: the crc32 in a
helper thread, overlapping a read or a write).

What it is not: writing a file (``shared/checkpoint_write.py``: the atomic write engine, file
images, O_DIRECT), the run directory's policy (``shared/checkpoint_dir.py``: listing, stale
temporaries, the newest valid file, quarantine), the manifest (``shared/checkpoint_manifest.py``),
the background writer thread or the torch side (``worker/``). numpy and the standard library
only, so the proxy can import it without torch. The writing and directory functions are also
reachable here under their names (``write_checkpoint``, ``list_checkpoints``, ...; resolved on
first use) for callers written before the split; new code imports them from their modules.

Every error is a ``CheckpointError`` whose message names the file, the offending value, the
rule and what to do next; it is meant to be printed to an operator as is.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import pathlib
import queue
import re
import stat
import struct
import sys
import threading
from dataclasses import dataclass

import numpy as np

HEADER_BYTES = 8  # int32 step + int32 n_params
INT32_MAX = 2**31 - 1  # largest step / n_params the header can hold
CHECKSUM_CHUNK = 8 * 1024 * 1024  # bytes per crc32 call in file_checksum

try:  # ISA-L's crc32: the same CRC-32 as zlib.crc32 (value for value, running value included),
    # about 3.6x less CPU (0.016 s instead of 0.058 s per 154 MB andrea-12m checkpoint, thread
    # CPU time), CPU a background checkpoint takes from training (docs/checkpoint-format.md#writing-without-stalling)
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same checksums
    from zlib import crc32
_HEADER = struct.Struct("<ii")  # little-endian step, n_params
_F32 = np.dtype("<f4")  # on-disk element type
_NAME_RE = re.compile(r"step_([0-9]{6,})\.bin")  # ASCII digits only
_TEMP_RE = re.compile(r"\.step_[^/]*\.bin\.tmp-[^/]*")  # the glob ".step_*.bin.tmp-*"


class CheckpointError(ValueError):
    """A checkpoint cannot be named, written, read or trusted (docs/checkpoint-format.md#validity).

    The message is operator-facing: file, value, rule, what to do. ``path`` is the file
    concerned (or None) and ``rule`` a short machine-readable key: "name", "limits",
    "empty", "short-header", "header-n", "size", "step", "n_params", "checksum", "values",
    "dtype", "shape", "io", "disk".
    """

    def __init__(
        self, message: str, *, path: os.PathLike | str | None = None, rule: str | None = None
    ):
        super().__init__(message)
        self.path = pathlib.Path(path) if path is not None else None
        self.rule = rule


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that passed ``validate_checkpoint`` (docs/checkpoint-format.md#validity).

    path: the file; step: header step (= the name's); n_params: header count;
    nbytes: file size in bytes (= 8 + 12 * n_params); checksum: the file's "crc32:%08x" when
    validation read the whole file for rule 8 (``values=True`` without a manifest checksum), so
    a later reader can check it has the same bytes; None otherwise.
    """

    path: pathlib.Path
    step: int
    n_params: int
    nbytes: int
    checksum: str | None = None


# ---------------------------------------------------------------------------- names, limits


def _as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise CheckpointError(f"{what} {value!r} is a bool, not an integer", rule="limits")
    try:
        return operator.index(value)
    except TypeError:
        raise CheckpointError(
            f"{what} {value!r} is not an integer ({type(value).__name__})", rule="limits"
        ) from None


def check_int32_limits(step: int, n_params: int) -> None:
    """Refuse a step or parameter count the int32 header cannot hold (docs/checkpoint-format.md#limits).

    step: int in [0, INT32_MAX]; n_params: int in [1, INT32_MAX] (numpy integers accepted,
    bools and floats refused). Returns None.
    Raises CheckpointError (rule "limits") naming the value; call it before training starts.
    """
    step = _as_int(step, "step")
    n_params = _as_int(n_params, "n_params")
    if not 0 <= step <= INT32_MAX:
        raise CheckpointError(
            f"step {step:,} does not fit the checkpoint header (int32, 0..{INT32_MAX:,}): "
            f"a step count this large means a bad resume or a runaway counter; check the "
            f"run's history",
            rule="limits",
        )
    if not 1 <= n_params <= INT32_MAX:
        raise CheckpointError(
            f"n_params {n_params:,} is outside 1..{INT32_MAX:,} (the header stores it as "
            f"int32, docs/checkpoint-format.md#limits): choose an architecture with at most {INT32_MAX:,} "
            f"parameters",
            rule="limits",
        )


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint for ``step``: ``f"step_{step:06d}.bin"`` (docs/checkpoint-format.md#name).

    step: int in [0, INT32_MAX]; past 999,999 the number widens (``step_1000000.bin``).
    Raises CheckpointError (rule "limits") for a negative, non-integer or > INT32_MAX step.
    """
    step = _as_int(step, "step")
    if not 0 <= step <= INT32_MAX:
        raise CheckpointError(
            f"step {step:,} cannot name a checkpoint: it must be in 0..{INT32_MAX:,} "
            f"(int32 header, docs/checkpoint-format.md#limits)",
            rule="limits",
        )
    return f"step_{step:06d}.bin"


def parse_checkpoint_name(name: str) -> int | None:
    """Step encoded in a checkpoint file name, or None if ``name`` is not one (docs/checkpoint-format.md#name).

    name: a bare file name (no directory). Accepts exactly what ``checkpoint_name`` produces:
    ``step_`` + at least six ASCII digits + ``.bin``, canonical (no extra leading zeros, so
    every step has one name) and <= INT32_MAX. Returns None for ``step_latest.bin``,
    ``step_000100.bin.bak``, ``step_abc.bin``, ``step_12.bin``, ``step_0000100.bin``,
    temporaries and anything else. Never raises for a str.
    """
    match = _NAME_RE.fullmatch(name)
    if match is None:
        return None
    step = int(match.group(1))
    if step > INT32_MAX or f"step_{step:06d}.bin" != name:
        return None
    return step


def expected_size(n_params: int) -> int:
    """Exact size in bytes of a checkpoint holding ``n_params`` float32 values per array.

    n_params: int >= 0. Returns 8 + 12 * n_params (docs/checkpoint-format.md). Raises CheckpointError if negative.
    """
    n_params = _as_int(n_params, "n_params")
    if n_params < 0:
        raise CheckpointError(f"n_params {n_params:,} is negative", rule="limits")
    return HEADER_BYTES + 12 * n_params


def is_temporary_name(name: str) -> bool:
    """True if ``name`` is a checkpoint temporary, i.e. matches ``.step_*.bin.tmp-*`` (docs/checkpoint-format.md#atomic-write).

    write_checkpoint names its temporaries ``.{final_name}.tmp-{pid}``.
    """
    return _TEMP_RE.fullmatch(name) is not None


# ---------------------------------------------------------------------------- reading


def _describe_size(name: str, size: int, n: int) -> str:
    want = expected_size(n)
    if size < want:
        hint = (
            "truncated write? (killed mid-write or disk full); the file is kept, "
            "resume from an older checkpoint"
        )
    else:
        hint = (
            "trailing bytes: not written by this format's writer, or appended to; "
            "the file is kept, resume from an older checkpoint"
        )
    return f"{name}: {size:,} bytes, expected {want:,} (8 + 12 x {n:,}): {hint}"


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
    return _HEADER.unpack(head)


def _open_error(path: pathlib.Path, exc: OSError) -> CheckpointError:
    err = CheckpointError(
        f"{path.name}: cannot read ({exc.strerror or exc}): check that {path} is a readable "
        f"regular file",
        path=path,
        rule="io",
    )
    err.__cause__ = exc
    return err


def _open_regular(path: pathlib.Path):
    """Open `path` for unbuffered binary reading, refusing anything but a regular file before
    a read can block: a FIFO or a device named like a checkpoint would hang its reader (opened
    with O_NONBLOCK, checked with fstat). Raises CheckpointError (rule "io") for such a file;
    OSError from the open itself (the callers turn it into rule "io")."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "not a regular file"
            )
            raise CheckpointError(
                f"{path.name}: {kind}, not a checkpoint file: move it out of the run directory "
                f"or give a checkpoint file",
                path=path,
                rule="io",
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_header(path: os.PathLike | str) -> tuple[int, int]:
    """The header of a checkpoint file: (step, n_params), two Python ints (docs/checkpoint-format.md).

    Reads only the first 8 bytes (little-endian int32, int32); does not check the name or size.
    Raises CheckpointError (rule "empty"/"short-header") if the file has fewer than 8 bytes,
    (rule "io") if it cannot be opened.
    """
    path = pathlib.Path(path)
    try:
        with _open_regular(path) as f:
            return _header_from(f, path, os.fstat(f.fileno()).st_size)
    except OSError as exc:
        raise _open_error(path, exc) from exc


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
    if size != expected_size(n):
        raise CheckpointError(_describe_size(name, size, n), path=path, rule="size")
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


def _normalise_checksum(checksum: str, path: pathlib.Path) -> str:
    want = str(checksum).strip().lower()
    if re.fullmatch(r"crc32:[0-9a-f]{8}", want) is None:
        raise CheckpointError(
            f"{path.name}: expected checksum {checksum!r} is not of the form crc32:xxxxxxxx: "
            f"the manifest entry is damaged; drop it to load the file unchecked",
            path=path,
            rule="checksum",
        )
    return want


def _checksum_mismatch(path: pathlib.Path, got: str, want: str) -> CheckpointError:
    return CheckpointError(
        f"{path.name}: checksum {got}, the manifest records {want}: the file changed after "
        f"it was written (bit rot, partial copy, another writer); the file is kept, resume "
        f"from an older checkpoint",
        path=path,
        rule="checksum",
    )


def _check_expected_n(n_params: int | None) -> int | None:
    if n_params is None:
        return None
    n_params = _as_int(n_params, "n_params")
    if not 1 <= n_params <= INT32_MAX:
        check_int32_limits(0, n_params)
    return n_params


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
    path = pathlib.Path(path)
    n_params = _check_expected_n(n_params)
    want = _normalise_checksum(checksum, path) if checksum is not None else None
    try:
        with _open_regular(path) as f:
            info = _check_structure(f, path, n_params)
            if want is not None:
                f.seek(0)
                got = _crc_of_stream(f)
                if got != want:
                    raise _checksum_mismatch(path, got, want)
            elif values:
                f.seek(HEADER_BYTES)
                got = _check_values_of_stream(
                    f, path, info.n_params, crc32(_HEADER.pack(info.step, info.n_params))
                )
                info = dataclasses.replace(info, checksum=got)
    except OSError as exc:
        raise _open_error(path, exc) from exc
    return info


# ---------------------------------------------------------------------------- values (rule 8)

VALUE_CHUNK = 8 * 1024 * 1024  # bytes per piece when rule 8 reads a file


def check_values(
    path: os.PathLike | str, weights: np.ndarray, m: np.ndarray, v: np.ndarray, *, at: int = 0
) -> None:
    """Rule 8 of docs/checkpoint-format.md#validity, for a checkpoint no checksum vouches for:
    every weight and every m is finite, every v is finite and >= 0 (AdamW's second moment is
    an average of squared gradients: Kingma & Ba 2015, Loshchilov & Hutter 2019).

    weights, m, v: float32 1-D arrays (any length, equal or not: pieces of the three regions
    are checked the same way); ``at``: the element offset of these pieces within their
    regions, for the message. Scans with min/max (no temporary of the arrays' size; about
    0.05 s for andrea-12m's 115 M floats). Raises CheckpointError (rule "values") naming the
    file, the region, the first bad element's index and its value.
    """
    for name, arr in (("weights", weights), ("m", m), ("v", v)):
        _check_piece(pathlib.Path(path), name, arr, at)


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


READ_ALIGN = 64  # bytes: a copy from the page cache is fastest when source and destination agree


def empty_for_read(count: int, file_offset: int) -> np.ndarray:
    """An uninitialised little-endian float32 array of ``count`` elements whose address is
    congruent to ``file_offset`` modulo READ_ALIGN, to read the file's bytes from that offset
    into. The kernel's copy from the page cache runs at a third of its speed when the two
    addresses disagree (measured on x86-64: 154 MB from file offset 8 into a buffer at offset
    16 of a page took 0.050 s, into one at offset 8 + 64k 0.012 s: scripts/bench_checkpoint.py's
    load figure); a plain ``np.empty`` sits at an arbitrary 16-byte boundary."""
    raw = np.empty(4 * count + READ_ALIGN, dtype=np.uint8)
    shift = (file_offset - raw.ctypes.data) % READ_ALIGN
    return raw[shift : shift + 4 * count].view(_F32)


def _check_values_of_stream(f, path: pathlib.Path, n: int, crc: int = 0) -> str:
    """Rule 8 over an open file positioned at the first weight, read in VALUE_CHUNK pieces;
    returns the "crc32:%08x" of the bytes read, continuing the running value ``crc`` (the
    header's, for the whole file's checksum)."""
    piece = empty_for_read(VALUE_CHUNK // 4, HEADER_BYTES)  # every piece starts at 8 + k x 8 MiB
    view = memoryview(piece).cast("B")  # type: ignore[arg-type]  # numpy's stubs omit the buffer protocol
    for name in ("weights", "m", "v"):
        done = 0
        while done < n:
            k = min(n - done, piece.shape[0])
            got = 0
            while got < 4 * k:
                r = f.readinto(view[got : 4 * k])
                if not r:
                    raise CheckpointError(
                        f"{path.name}: the file ended while its {name} were read (element "
                        f"{done + got // 4:,} of {n:,}): it shrank while being read; the file "
                        f"is kept, resume from an older checkpoint",
                        path=path,
                        rule="size",
                    )
                got += r
            crc = crc32(view[: 4 * k], crc)
            _check_piece(path, name, piece[:k], done)
            done += k
    return format_crc(crc)


def _readinto_exact(
    f,
    view: memoryview,
    path: pathlib.Path,
    info: CheckpointInfo,
    crc: "BackgroundCrc | None" = None,
    at: int = HEADER_BYTES,
) -> None:
    # Raw reads may be short (Linux caps one read at ~2 GiB); loop until the buffer is full.
    # With a crc, read in CHECKSUM_CHUNK pieces and checksum each read piece in the helper
    # thread while the next one is read.
    done, total = 0, len(view)
    while done < total:
        end = total if crc is None else min(total, done + CHECKSUM_CHUNK)
        got = f.readinto(view[done:end])
        if got and crc is not None:
            crc.feed(view[done : done + got])
        if not got:
            raise CheckpointError(
                f"{path.name}: ended after {at + done:,} of {info.nbytes:,} bytes "
                f"while loading: the file shrank during the read (another writer?); retry",
                path=path,
                rule="size",
            )
        done += got


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
    path = pathlib.Path(path)
    n_params = _check_expected_n(n_params)
    want = _normalise_checksum(checksum, path) if checksum is not None else None
    try:
        with _open_regular(path) as f:
            info = _check_structure(f, path, n_params)
            n = info.n_params
            if out is None:
                buf = empty_for_read(3 * n, HEADER_BYTES)
                parts = (buf[:n], buf[n : 2 * n], buf[2 * n :])
            else:
                parts = _check_out(out, n)
            f.seek(HEADER_BYTES)
            crc = BackgroundCrc(crc32(_HEADER.pack(info.step, n))) if want is not None else None
            try:
                at = HEADER_BYTES
                for part in parts if out is not None else (buf,):
                    view = memoryview(part).cast("B")  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs omit it
                    _readinto_exact(f, view, path, info, crc, at)
                    at += len(view)
            finally:
                if crc is not None:
                    crc.close()
    except OSError as exc:
        raise _open_error(path, exc) from exc
    if crc is not None and want is not None:  # crc runs only when there is a checksum
        got = format_crc(crc.result())
        if got != want:
            raise _checksum_mismatch(path, got, want)
    if values if values is not None else want is None:
        check_values(path, *parts)  # "<f4" views: numpy reads them right on any host
    if sys.byteorder != "little" and out is None:
        parts = (  # big-endian host: native order for callers
            parts[0].astype(np.float32),
            parts[1].astype(np.float32),
            parts[2].astype(np.float32),
        )
    return info.step, parts[0], parts[1], parts[2]


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
    path = pathlib.Path(path)
    n_params = _check_expected_n(n_params)
    want = _normalise_checksum(checksum, path) if checksum is not None else None
    check = values if values is not None else want is None
    try:
        with _open_regular(path) as f:
            info = _check_structure(f, path, n_params)
            n = info.n_params
            if out is None:
                weights = empty_for_read(n, HEADER_BYTES)
            else:
                weights = _check_out((out, out, out), n)[0]
            f.seek(HEADER_BYTES)
            view = memoryview(weights).cast("B")  # type: ignore[arg-type]  # numpy's stubs omit the buffer protocol
            _readinto_exact(f, view, path, info)
            crc = crc32(view, crc32(_HEADER.pack(info.step, n))) if want is not None else 0
            if check:
                _check_piece(path, "weights", weights, 0)
            piece = empty_for_read(min(n, CHECKSUM_CHUNK // 4), HEADER_BYTES + 4 * n)
            pv = memoryview(piece).cast("B")  # type: ignore[arg-type]  # as above
            at = HEADER_BYTES + 4 * n
            for name in ("m", "v"):
                done = 0
                while done < n:
                    k = min(n - done, piece.shape[0])
                    _readinto_exact(f, pv[: 4 * k], path, info, None, at)
                    if want is not None:
                        crc = crc32(pv[: 4 * k], crc)
                    if check:
                        _check_piece(path, name, piece[:k], done)
                    done += k
                    at += 4 * k
    except OSError as exc:
        raise _open_error(path, exc) from exc
    if want is not None:
        got = format_crc(crc)
        if got != want:
            raise _checksum_mismatch(path, got, want)
    if sys.byteorder != "little" and out is None:
        weights = weights.astype(np.float32)  # native order for callers
    return info.step, weights


def _check_out(
    out: tuple[np.ndarray, np.ndarray, np.ndarray], n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if sys.byteorder != "little":
        raise ValueError("load_checkpoint(out=...) needs a little-endian host (the file's order)")
    if len(out) != 3:
        raise ValueError(f"load_checkpoint(out=...) takes (weights, m, v), got {len(out)} arrays")
    for name, a in zip(("weights", "m", "v"), out):
        if (
            a.dtype != np.float32
            or a.shape != (n,)
            or not a.flags.c_contiguous
            or not a.flags.writeable
        ):
            raise ValueError(
                f"load_checkpoint(out=...): {name} must be a writable C-contiguous float32 "
                f"array of {n:,} elements (the file's n_params), got {a.dtype} {a.shape}"
            )
    return out[0], out[1], out[2]


# ---------------------------------------------------------------------------- checksums


def format_crc(crc: int) -> str:
    return "crc32:%08x" % (crc & 0xFFFFFFFF)


class BackgroundCrc:
    """CRC-32 (zlib.crc32's, computed by `crc32`) of the buffers fed to it, in order, computed
    by a helper thread.

    crc32 (zlib's and ISA-L's) and file I/O release the GIL, so the checksum of a 150 MB checkpoint
    (~0.05 s) overlaps the write + fsync (or the read) instead of adding to it
    (scripts/bench_checkpoint.py). Buffers fed must not change until ``result()`` returns. ``close()`` abandons
    the computation (on an error path); both are idempotent.
    """

    def __init__(self, initial: int = 0):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._crc = initial
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-crc32", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            view = self._queue.get()
            if view is None:
                return
            if self._error is None:
                try:
                    self._crc = crc32(view, self._crc)
                except BaseException as exc:  # reported by result(), never lost
                    self._error = exc

    def feed(self, view) -> None:
        self._queue.put(view)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def result(self) -> int:
        self.close()
        if self._error is not None:
            raise self._error
        return self._crc


def _crc_of_stream(f) -> str:
    crc = 0
    chunk = empty_for_read(CHECKSUM_CHUNK // 4, f.tell())
    view = memoryview(chunk).cast("B")  # type: ignore[arg-type]  # numpy's stubs omit the buffer protocol
    while True:
        got = f.readinto(view)
        if not got:
            return format_crc(crc)
        crc = crc32(view[:got], crc)


def file_checksum(path: os.PathLike | str) -> str:
    """``"crc32:%08x"`` (zlib.crc32, lower-case hex) of the whole file, read in 8 MiB chunks.

    Same format as the checksum returned by ``write_checkpoint`` and stored in the manifest
    (docs/checkpoint-format.md#manifest). Raises CheckpointError (rule "io") if the file cannot be read.
    """
    path = pathlib.Path(path)
    try:
        with _open_regular(path) as f:
            return _crc_of_stream(f)
    except OSError as exc:
        raise _open_error(path, exc) from exc


# ---------------------------------------------------------------------------- former names

_MOVED = {  # name -> module, for callers written when this file held all three layers
    **dict.fromkeys(
        (
            "write_checkpoint",
            "write_checkpoint_image",
            "alloc_checkpoint_image",
            "image_arrays",
            "image_offset",
            "DIRECT_ALIGN",
            "fsync_dir",
        ),
        "shared.checkpoint_write",
    ),
    **dict.fromkeys(
        (
            "clean_stale_temporaries",
            "list_checkpoints",
            "scan_for_resume",
            "find_latest_valid",
            "quarantine_checkpoint",
            "QUARANTINE_DIR",
        ),
        "shared.checkpoint_dir",
    ),
}


def __getattr__(name: str):
    """The writing and directory names, resolved on first use (PEP 562): importing them here
    at load time would make this module, which the other two import, import them back."""
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
