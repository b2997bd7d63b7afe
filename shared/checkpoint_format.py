"""The flat checkpoint file: names, layout, validation, atomic write, discovery (docs/checkpoint-format.md).

What it is: the one place that knows the byte layout of ``step_NNNNNN.bin``

    offset 0       int32    step      optimizer updates completed
    offset 4       int32    n_params  length of each array below
    offset 8       float32[n_params]  weights
    offset 8+4n    float32[n_params]  m  (AdamW exp_avg)
    offset 8+8n    float32[n_params]  v  (AdamW exp_avg_sq)
    total          8 + 12 * n_params bytes, little-endian, no padding

and how to write one atomically, check one, load one and find the newest good one.

What it is not: the manifest (``shared/checkpoint_manifest.py``), the retention policy's
deletions, the background writer thread or the torch side (``worker/``). numpy and the
standard library only, so the proxy can import it without torch.

Every error is a ``CheckpointError`` whose message names the file, the offending value, the
rule and what to do next; it is meant to be printed to an operator as is.
"""

from __future__ import annotations

import errno
import operator
import os
import pathlib
import re
import queue
import struct
import sys
import threading
import zlib
from dataclasses import dataclass

import numpy as np

from shared.atomic_io import fsync_dir

HEADER_BYTES = 8                     # int32 step + int32 n_params
INT32_MAX = 2**31 - 1                # largest step / n_params the header can hold
CHECKSUM_CHUNK = 8 * 1024 * 1024     # bytes per zlib.crc32 call in file_checksum
_HEADER = struct.Struct("<ii")       # little-endian step, n_params
_F32 = np.dtype("<f4")               # on-disk element type
_NAME_RE = re.compile(r"step_([0-9]{6,})\.bin")            # ASCII digits only
_TEMP_RE = re.compile(r"\.step_[^/]*\.bin\.tmp-[^/]*")     # the glob ".step_*.bin.tmp-*"


class CheckpointError(ValueError):
    """A checkpoint cannot be named, written, read or trusted (docs/checkpoint-format.md#validity).

    The message is operator-facing: file, value, rule, what to do. ``path`` is the file
    concerned (or None) and ``rule`` a short machine-readable key: "name", "limits",
    "empty", "short-header", "header-n", "size", "step", "n_params", "checksum", "dtype",
    "shape", "io", "disk".
    """

    def __init__(self, message: str, *, path: os.PathLike | str | None = None,
                 rule: str | None = None):
        super().__init__(message)
        self.path = pathlib.Path(path) if path is not None else None
        self.rule = rule


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that passed ``validate_checkpoint`` (docs/checkpoint-format.md#validity).

    path: the file; step: header step (= the name's); n_params: header count;
    nbytes: file size in bytes (= 8 + 12 * n_params).
    """

    path: pathlib.Path
    step: int
    n_params: int
    nbytes: int


# ---------------------------------------------------------------------------- names, limits

def _as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise CheckpointError(f"{what} {value!r} is a bool, not an integer", rule="limits")
    try:
        return operator.index(value)
    except TypeError:
        raise CheckpointError(f"{what} {value!r} is not an integer "
                              f"({type(value).__name__})", rule="limits") from None


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
            f"run's history", rule="limits")
    if not 1 <= n_params <= INT32_MAX:
        raise CheckpointError(
            f"n_params {n_params:,} is outside 1..{INT32_MAX:,} (the header stores it as "
            f"int32, docs/checkpoint-format.md#limits): choose an architecture with at most {INT32_MAX:,} "
            f"parameters", rule="limits")


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint for ``step``: ``f"step_{step:06d}.bin"`` (docs/checkpoint-format.md#name).

    step: int in [0, INT32_MAX]; past 999,999 the number widens (``step_1000000.bin``).
    Raises CheckpointError (rule "limits") for a negative, non-integer or > INT32_MAX step.
    """
    step = _as_int(step, "step")
    if not 0 <= step <= INT32_MAX:
        raise CheckpointError(
            f"step {step:,} cannot name a checkpoint: it must be in 0..{INT32_MAX:,} "
            f"(int32 header, docs/checkpoint-format.md#limits)", rule="limits")
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
        hint = ("truncated write? (killed mid-write or disk full); the file is kept, "
                "resume from an older checkpoint")
    else:
        hint = ("trailing bytes: not written by this format's writer, or appended to; "
                "the file is kept, resume from an older checkpoint")
    return (f"{name}: {size:,} bytes, expected {want:,} (8 + 12 x {n:,}): {hint}")


def _header_from(f, path: pathlib.Path, size: int) -> tuple[int, int]:
    name = path.name
    if size == 0:
        raise CheckpointError(
            f"{name}: 0 bytes (zero-length file), expected at least {HEADER_BYTES} header "
            f"bytes: the write never completed; the file is kept, resume from an older "
            f"checkpoint", path=path, rule="empty")
    head = f.read(HEADER_BYTES)
    if size < HEADER_BYTES or len(head) < HEADER_BYTES:
        raise CheckpointError(
            f"{name}: {max(size, len(head)):,} bytes, shorter than the {HEADER_BYTES}-byte "
            f"header: truncated write? the file is kept, resume from an older checkpoint",
            path=path, rule="short-header")
    return _HEADER.unpack(head)


def _open_error(path: pathlib.Path, exc: OSError) -> CheckpointError:
    err = CheckpointError(
        f"{path.name}: cannot read ({exc.strerror or exc}): check that {path} is a readable "
        f"regular file", path=path, rule="io")
    err.__cause__ = exc
    return err


def read_header(path: os.PathLike | str) -> tuple[int, int]:
    """The header of a checkpoint file: (step, n_params), two Python ints (docs/checkpoint-format.md).

    Reads only the first 8 bytes (little-endian int32, int32); does not check the name or size.
    Raises CheckpointError (rule "empty"/"short-header") if the file has fewer than 8 bytes,
    (rule "io") if it cannot be opened.
    """
    path = pathlib.Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
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
            f"directory", path=path, rule="name")
    size = os.fstat(f.fileno()).st_size
    step, n = _header_from(f, path, size)
    if n <= 0:
        raise CheckpointError(
            f"{name}: header n_params = {n:,}, must be >= 1: corrupt header or not a "
            f"checkpoint file; the file is kept, resume from an older checkpoint",
            path=path, rule="header-n")
    if size != expected_size(n):
        raise CheckpointError(_describe_size(name, size, n), path=path, rule="size")
    if step != name_step:
        fix = (f"rename it to {checkpoint_name(step)} if the header is right" if step >= 0
               else "the header is corrupt")
        raise CheckpointError(
            f"{name}: header step {step:,} differs from the name's step {name_step:,}: "
            f"renamed or copied by hand? {fix}; the file is kept", path=path, rule="step")
    if n_params is not None and n != n_params:
        raise CheckpointError(
            f"{name}: the model has {n_params:,} parameters, the file has {n:,}; the "
            f"architecture differs: resume with the architecture in run.json, or start a "
            f"new run directory", path=path, rule="n_params")
    return CheckpointInfo(path=path, step=step, n_params=n, nbytes=size)


def _normalise_checksum(checksum: str, path: pathlib.Path) -> str:
    want = str(checksum).strip().lower()
    if re.fullmatch(r"crc32:[0-9a-f]{8}", want) is None:
        raise CheckpointError(
            f"{path.name}: expected checksum {checksum!r} is not of the form crc32:xxxxxxxx: "
            f"the manifest entry is damaged; drop it to load the file unchecked",
            path=path, rule="checksum")
    return want


def _checksum_mismatch(path: pathlib.Path, got: str, want: str) -> CheckpointError:
    return CheckpointError(
        f"{path.name}: checksum {got}, the manifest records {want}: the file changed after "
        f"it was written (bit rot, partial copy, another writer); the file is kept, resume "
        f"from an older checkpoint", path=path, rule="checksum")


def _check_expected_n(n_params: int | None) -> int | None:
    if n_params is None:
        return None
    n_params = _as_int(n_params, "n_params")
    if not 1 <= n_params <= INT32_MAX:
        check_int32_limits(0, n_params)
    return n_params


def validate_checkpoint(path: os.PathLike | str, n_params: int | None,
                        checksum: str | None = None) -> CheckpointInfo:
    """Check one checkpoint file against every rule of docs/checkpoint-format.md#validity, reading no weights.

    path: the ``step_NNNNNN.bin`` file. n_params: the model's parameter count, or None to
    skip that rule. checksum: ``"crc32:%08x"`` from the manifest, or None to skip (with it
    the whole file is read once).
    Returns CheckpointInfo. Raises CheckpointError for the FIRST failing rule, in order:
    name unparseable ("name"); zero-length ("empty") or < 8 bytes ("short-header"); header
    n_params <= 0 ("header-n"); size != 8 + 12*header_n ("size"); header step != name's
    ("step"); header n_params != n_params ("n_params", naming both counts); checksum
    mismatch ("checksum"); unreadable file ("io"). Never modifies or deletes the file.
    """
    path = pathlib.Path(path)
    n_params = _check_expected_n(n_params)
    want = _normalise_checksum(checksum, path) if checksum is not None else None
    try:
        with open(path, "rb", buffering=0) as f:
            info = _check_structure(f, path, n_params)
            if want is not None:
                f.seek(0)
                got = _crc_of_stream(f)
                if got != want:
                    raise _checksum_mismatch(path, got, want)
    except OSError as exc:
        raise _open_error(path, exc) from exc
    return info


def _readinto_exact(f, view: memoryview, path: pathlib.Path, info: CheckpointInfo,
                    crc: "_BackgroundCrc | None" = None) -> None:
    # Raw reads may be short (Linux caps one read at ~2 GiB); loop until the buffer is full.
    # With a crc, read in CHECKSUM_CHUNK pieces and checksum each read piece in the helper
    # thread while the next one is read.
    done, total = 0, len(view)
    while done < total:
        end = total if crc is None else min(total, done + CHECKSUM_CHUNK)
        got = f.readinto(view[done:end])
        if got and crc is not None:
            crc.feed(view[done:done + got])
        if not got:
            raise CheckpointError(
                f"{path.name}: ended after {HEADER_BYTES + done:,} of {info.nbytes:,} bytes "
                f"while loading: the file shrank during the read (another writer?); retry",
                path=path, rule="size")
        done += got


def load_checkpoint(path: os.PathLike | str, n_params: int | None,
                    checksum: str | None = None
                    ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Validate and read a checkpoint: (step, weights, m, v) (docs/checkpoint-format.md#validity).

    Same arguments and CheckpointError rules as ``validate_checkpoint``, checked on the same
    open file that is then read. The three arrays are float32, 1-D, length n_params,
    contiguous, writable views of ONE preallocated buffer of 3*n_params (read straight into
    it, no extra copy; the checksum, when given, is computed in a helper thread over each
    8 MiB piece already read while the next piece is read).
    """
    path = pathlib.Path(path)
    n_params = _check_expected_n(n_params)
    want = _normalise_checksum(checksum, path) if checksum is not None else None
    try:
        with open(path, "rb", buffering=0) as f:
            info = _check_structure(f, path, n_params)
            n = info.n_params
            buf = np.empty(3 * n, dtype=_F32)
            f.seek(HEADER_BYTES)
            crc = (_BackgroundCrc(zlib.crc32(_HEADER.pack(info.step, n)))
                   if want is not None else None)
            try:
                _readinto_exact(f, memoryview(buf).cast("B"), path, info, crc)  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs omit it
            finally:
                if crc is not None:
                    crc.close()
    except OSError as exc:
        raise _open_error(path, exc) from exc
    if crc is not None and want is not None:  # crc runs only when there is a checksum
        got = _format_crc(crc.result())
        if got != want:
            raise _checksum_mismatch(path, got, want)
    if sys.byteorder != "little":
        buf = buf.astype(np.float32)  # big-endian host only: native order for callers
    return info.step, buf[:n], buf[n:2 * n], buf[2 * n:]


# ---------------------------------------------------------------------------- checksums

def _format_crc(crc: int) -> str:
    return "crc32:%08x" % (crc & 0xFFFFFFFF)


class _BackgroundCrc:
    """zlib.crc32 of the buffers fed to it, in order, computed by a helper thread.

    zlib.crc32 and file I/O both release the GIL, so the checksum of a 150 MB checkpoint
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
                    self._crc = zlib.crc32(view, self._crc)
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
    chunk = bytearray(CHECKSUM_CHUNK)
    view = memoryview(chunk)
    while True:
        got = f.readinto(view)
        if not got:
            return _format_crc(crc)
        crc = zlib.crc32(view[:got], crc)


def file_checksum(path: os.PathLike | str) -> str:
    """``"crc32:%08x"`` (zlib.crc32, lower-case hex) of the whole file, read in 8 MiB chunks.

    Same format as the checksum returned by ``write_checkpoint`` and stored in the manifest
    (docs/checkpoint-format.md#manifest). Raises CheckpointError (rule "io") if the file cannot be read.
    """
    path = pathlib.Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
            return _crc_of_stream(f)
    except OSError as exc:
        raise _open_error(path, exc) from exc


# ---------------------------------------------------------------------------- writing

def _as_f32_vector(x, what: str, step: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise CheckpointError(
            f"{checkpoint_name(step)}: {what} has dtype {arr.dtype}, the format stores "
            f"float32: convert with .float() / .astype(np.float32) before saving",
            rule="dtype")
    if arr.ndim != 1:
        raise CheckpointError(
            f"{checkpoint_name(step)}: {what} has shape {arr.shape}, the format stores flat "
            f"1-D arrays: flatten the parameters in the model's order first", rule="shape")
    return np.ascontiguousarray(arr, dtype=_F32)  # no copy for contiguous LE float32


def write_checkpoint(directory: os.PathLike | str, step: int, weights, m, v, *,
                     fsync: bool = True) -> tuple[pathlib.Path, int, str]:
    """Write ``step_NNNNNN.bin`` atomically into ``directory`` (docs/checkpoint-format.md#atomic-write).

    weights, m, v: float32 1-D arrays of equal length n (anything np.asarray turns into one,
    e.g. a CPU tensor's numpy view); each buffer is written directly, without concatenation.
    step: int in [0, INT32_MAX]; n in [1, INT32_MAX].
    Writes ``.{final_name}.tmp-{pid}`` in the same directory (header, weights, m, v), computes
    crc32 over exactly the bytes written (in a helper thread, overlapping the write and the
    fsync; the arrays must not change during the call), flushes, fsyncs (if ``fsync``),
    renames over the final name with os.replace and fsyncs the directory. An existing file
    for the same step is replaced atomically.
    Returns (final_path, nbytes, "crc32:%08x"), nbytes = 8 + 12*n.
    Raises CheckpointError for bad inputs (rules "limits", "dtype", "shape", before any file
    is touched) and for any OSError (rule "io", errno text in the message, the OSError as
    __cause__). On every exception, KeyboardInterrupt included, the temporary is removed and
    the exception propagates; other checkpoints are never touched.
    """
    directory = pathlib.Path(directory)
    final_name = checkpoint_name(step)  # raises for a bad step
    step = int(step)
    arrays = [_as_f32_vector(a, what, step)
              for a, what in ((weights, "weights"), (m, "m"), (v, "v"))]
    n = arrays[0].shape[0]
    if arrays[1].shape[0] != n or arrays[2].shape[0] != n:
        raise CheckpointError(
            f"{final_name}: weights, m, v have lengths {n:,}, {arrays[1].shape[0]:,}, "
            f"{arrays[2].shape[0]:,}; they must be equal: m and v must come from the same "
            f"parameters in the same order", rule="shape")
    check_int32_limits(step, n)

    header = _HEADER.pack(step, n)
    views = [memoryview(arr).cast("B") for arr in arrays]  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs omit it
    crc = _BackgroundCrc(zlib.crc32(header))
    for view in views:
        crc.feed(view)

    def write_body(tmp: pathlib.Path) -> None:
        with open(tmp, "wb") as f:
            f.write(header)
            for view in views:
                f.write(view)
            f.flush()
            if fsync:
                os.fsync(f.fileno())

    final = _atomic_commit(directory, final_name, write_body, crc, fsync)
    return final, HEADER_BYTES + 12 * n, _format_crc(crc.result())


def _atomic_commit(directory: pathlib.Path, final_name: str, write_body, crc: _BackgroundCrc,
                   fsync: bool) -> pathlib.Path:
    """Temporary -> write_body(tmp) -> crc done -> os.replace -> directory fsync (docs/checkpoint-format.md#atomic-write).

    On any exception the temporary is removed, the crc thread stopped, and an OSError becomes
    a CheckpointError (rule "io") naming errno; other checkpoints are never touched.
    """
    final = directory / final_name
    tmp = directory / f".{final_name}.tmp-{os.getpid()}"
    renamed = False
    try:
        write_body(tmp)
        crc.result()  # the checksum is complete before the file becomes visible
        os.replace(tmp, final)
        renamed = True
        if fsync:
            fsync_dir(directory)
    except BaseException as exc:
        crc.close()
        if not renamed:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            except OSError:
                pass  # clean_stale_temporaries at the next start removes it
        if isinstance(exc, OSError):
            where = final if renamed else tmp
            raise CheckpointError(
                f"{final_name}: write failed at {where} ({exc.strerror or exc}; errno "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)}): the temporary was removed and "
                f"earlier checkpoints are intact; free disk space or fix the directory, then "
                f"retry", path=where, rule="io") from exc
        raise
    return final


# ---------------------------------------------------------------------------- file images

DIRECT_ALIGN = 4096   # bytes: O_DIRECT needs buffer address, file offset and length aligned


def image_offset(address: int, align: int = DIRECT_ALIGN) -> int:
    """Bytes to skip from ``address`` to the next multiple of ``align`` (0 if aligned)."""
    return -address % align


def alloc_checkpoint_image(n_params: int) -> np.ndarray:
    """A zeroed, 4096-byte-aligned uint8 array of ``8 + 12 * n_params`` bytes: a file image.

    Layout = the file's (docs/checkpoint-format.md): header at [0:8], weights, m, v as float32 from byte 8 on
    (``image_arrays`` gives the views). ``write_checkpoint_image`` writes it with O_DIRECT
    where the filesystem allows. Raises CheckpointError (rule "limits") for a bad n_params.
    """
    check_int32_limits(0, n_params)
    size = expected_size(n_params)
    raw = np.zeros(size + DIRECT_ALIGN, dtype=np.uint8)
    off = image_offset(raw.ctypes.data)
    return raw[off:off + size]


def image_arrays(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, m, v): float32 views of a file image's three regions (no copy)."""
    n = _image_n(image)
    flat = image[HEADER_BYTES:].view(_F32)
    return flat[:n], flat[n:2 * n], flat[2 * n:]


def _image_n(image) -> int:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 1 \
            or not image.flags.c_contiguous:
        raise CheckpointError(
            f"checkpoint image must be a 1-D C-contiguous uint8 array, got "
            f"{getattr(image, 'dtype', type(image).__name__)} "
            f"{getattr(image, 'shape', '')}: allocate it with alloc_checkpoint_image",
            rule="shape")
    size = image.shape[0]
    if size < HEADER_BYTES + 12 or (size - HEADER_BYTES) % 12:
        raise CheckpointError(
            f"checkpoint image of {size:,} bytes is not 8 + 12 x n_params with n_params >= 1: "
            f"allocate it with alloc_checkpoint_image", rule="shape")
    return (size - HEADER_BYTES) // 12


def _clear_direct(fd: int) -> None:
    import fcntl
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _write_image(tmp: pathlib.Path, view: memoryview, aligned: bool, fsync: bool) -> None:
    """Write ``view`` to a new file ``tmp``: the 4096-aligned bulk with O_DIRECT when possible
    (no copy into the page cache), the rest (and everything, where O_DIRECT is refused or the
    buffer is not aligned) with plain write(2); short writes are continued; then fsync."""
    o_direct = getattr(os, "O_DIRECT", 0)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = bool(o_direct) and aligned
    fd = None
    if direct:
        try:
            fd = os.open(tmp, flags | o_direct, 0o644)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                raise
            direct = False
    if fd is None:
        fd = os.open(tmp, flags, 0o644)
    try:
        total = len(view)
        bulk = total - total % DIRECT_ALIGN
        done = 0
        while done < total:
            if direct and (done >= bulk or done % DIRECT_ALIGN):
                _clear_direct(fd)
                direct = False
            try:
                got = os.write(fd, view[done:bulk if direct else total])
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:  # alignment refused: plain writes
                    _clear_direct(fd)
                    direct = False
                    continue
                raise
            if got == 0:
                raise OSError(errno.EIO, f"write(2) wrote 0 bytes at offset {done:,}")
            done += got
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint_image(directory: os.PathLike | str, step: int, image: np.ndarray, *,
                           fsync: bool = True) -> tuple[pathlib.Path, int, str]:
    """Write a file image (``alloc_checkpoint_image``) as ``step_NNNNNN.bin``, atomically.

    The fast path of the background writer (scripts/bench_checkpoint.py): the image already holds the
    file's bytes, so the write is ONE sequential write of one buffer; when the image is
    4096-aligned and the filesystem supports it, with O_DIRECT (the kernel reads the buffer
    directly, no copy into the page cache), then fsync. Sets the header bytes image[0:8] to
    (step, n_params); weights, m, v must already be in place and must not change during the
    call. Same temporary/rename/directory-fsync protocol, return value (final_path, nbytes,
    "crc32:%08x") and errors as ``write_checkpoint`` (rules "limits", "shape", "io").
    """
    directory = pathlib.Path(directory)
    final_name = checkpoint_name(step)
    step = int(step)
    n = _image_n(image)
    check_int32_limits(step, n)
    image[:HEADER_BYTES] = np.frombuffer(_HEADER.pack(step, n), dtype=np.uint8)
    view = memoryview(image).cast("B")  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs omit it
    crc = _BackgroundCrc()
    crc.feed(view)
    aligned = image_offset(image.ctypes.data) == 0
    final = _atomic_commit(directory, final_name,
                           lambda tmp: _write_image(tmp, view, aligned, fsync), crc, fsync)
    return final, HEADER_BYTES + 12 * n, _format_crc(crc.result())


# ---------------------------------------------------------------------------- directories

def _scan(directory: pathlib.Path):
    try:
        return list(os.scandir(directory))
    except OSError as exc:
        raise CheckpointError(
            f"{directory}: cannot list the checkpoint directory ({exc.strerror or exc}): "
            f"check the --run-dir path", path=directory, rule="io") from exc


def clean_stale_temporaries(directory: os.PathLike | str) -> list[pathlib.Path]:
    """Delete leftover checkpoint temporaries (``.step_*.bin.tmp-*``) in ``directory``.

    Call at start, before this process's writer runs (docs/checkpoint-format.md#atomic-write: "Stale temporaries are cleaned
    at start"; one owner per run directory, docs/architecture.md#one-proxy-per-run-directory). Only regular files and links whose name
    matches are removed; ``step_*.bin`` files are never touched.
    Returns the removed paths, sorted. Raises CheckpointError (rule "io") if the directory
    cannot be listed; a temporary that vanished meanwhile is ignored.
    """
    directory = pathlib.Path(directory)
    removed = []
    for entry in _scan(directory):
        if not is_temporary_name(entry.name) or entry.is_dir(follow_symlinks=False):
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
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
    found = []
    for entry in _scan(directory):
        step = parse_checkpoint_name(entry.name)
        if step is not None and not entry.is_dir():
            found.append((step, directory / entry.name))
    found.sort(key=lambda item: item[0])
    return found


def scan_for_resume(directory: os.PathLike | str, n_params: int | None,
                    checksums: dict[int, str] | None = None
                    ) -> tuple[CheckpointInfo | None, list[CheckpointError]]:
    """Like ``find_latest_valid`` but each rejection is the CheckpointError itself (docs/checkpoint-format.md#validity).

    Returns (info, rejected): rejected lists, newest first, one CheckpointError per newer file
    that failed, with ``.path`` (the file), ``.rule`` (the rule it broke: "size", "step",
    "n_params", "checksum", ...) and the operator message as ``str(err)``. Deletes nothing.
    Raises CheckpointError if n_params is outside 1..INT32_MAX or the directory cannot be
    listed.
    """
    n_params = _check_expected_n(n_params)
    checksums = checksums or {}
    rejected: list[CheckpointError] = []
    for step, path in reversed(list_checkpoints(directory)):
        try:
            return validate_checkpoint(path, n_params, checksums.get(step)), rejected
        except CheckpointError as exc:
            if exc.path is None:
                exc.path = path
            rejected.append(exc)
    return None, rejected


def find_latest_valid(directory: os.PathLike | str, n_params: int | None,
                      checksums: dict[int, str] | None = None
                      ) -> tuple[CheckpointInfo | None, list[tuple[pathlib.Path | None, str]]]:
    """The newest valid checkpoint in ``directory`` and the newer ones rejected (docs/checkpoint-format.md#validity).

    n_params: the model's parameter count (None: not checked). checksums: step -> the
    manifest's "crc32:%08x" for the steps it knows; files without an entry are checked
    without a checksum (another writer's file still loads).
    Walks newest-first by integer step; returns (info, rejected) where info is the first
    file passing validate_checkpoint (None if none does) and rejected lists (path, reason)
    for every newer file that failed, newest first. Deletes nothing.
    Raises CheckpointError if n_params is outside 1..INT32_MAX or the directory cannot be
    listed. ``scan_for_resume`` gives the same with each failure's rule.
    """
    info, rejected = scan_for_resume(directory, n_params, checksums)
    return info, [(err.path, str(err)) for err in rejected]


QUARANTINE_DIR = "rejected"   # run-directory subfolder for checkpoints resume rejected


def quarantine_checkpoint(path: os.PathLike | str, folder: str = QUARANTINE_DIR
                          ) -> pathlib.Path:
    """Move a rejected checkpoint into ``<its directory>/<folder>/``, keeping it (docs/checkpoint-format.md#validity).

    Why: a rejected ``step_000300.bin`` left in place would be overwritten when training
    reaches step 300 again, or deleted by retention; in the quarantine folder it is out of
    reach of both, and of ``list_checkpoints``. The name is kept; if the folder already holds
    that name, ``.1``, ``.2``, ... is appended. Same filesystem, so it is a rename (no copy);
    the directories are fsynced. Returns the new path.
    Raises CheckpointError (rule "io") if the folder cannot be created or the rename fails
    (the file then stays where it was).
    """
    path = pathlib.Path(path)
    dest_dir = path.parent / folder
    try:
        dest_dir.mkdir(exist_ok=True)
        dest, k = dest_dir / path.name, 0
        while dest.exists():
            k += 1
            dest = dest_dir / f"{path.name}.{k}"
        os.rename(path, dest)
        fsync_dir(dest_dir)
        fsync_dir(path.parent)
    except OSError as exc:
        raise CheckpointError(
            f"{path.name}: cannot move it to {dest_dir} ({exc.strerror or exc}): it stays "
            f"where it is; move it aside by hand before training reaches its step",
            path=path, rule="io") from exc
    return dest
