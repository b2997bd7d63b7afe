"""Writing a checkpoint file atomically: the write engine (docs/checkpoint-format.md#atomic-write).

What it is: ``write_checkpoint_image``, which writes a preallocated file image
(``alloc_checkpoint_image``) to a temporary and renames it over the final name, and
``write_checkpoint``, which copies three arrays into an image and writes that.

What it is not: the layout, its validation or loading (``shared/checkpoint/file_format.py``), the
run directory's policy (``shared/checkpoint/directory.py``), the manifest or retention
(``shared/checkpoint/manifest.py``), the background writer thread (``worker/checkpointer.py``).
numpy and the standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import stat

import numpy as np

from shared.atomic_io import fsync_dir
from shared.checkpoint.file_format import (
    F32,
    HEADER,
    HEADER_BYTES,
    BackgroundCrc,
    CheckpointError,
    check_int32_limits,
    checkpoint_name,
    expected_size,
    format_crc,
)

# ---------------------------------------------------------------------------- writing


def _as_f32_vector(x, what: str, final_name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise CheckpointError(
            f"{final_name}: {what} has dtype {arr.dtype}, the format stores "
            f"float32: convert with .float() / .astype(np.float32) before saving",
            rule="dtype",
        )
    if arr.ndim != 1:
        raise CheckpointError(
            f"{final_name}: {what} has shape {arr.shape}, the format stores flat "
            f"1-D arrays: flatten the parameters in the model's order first",
            rule="shape",
        )
    return arr


def write_checkpoint(
    directory: os.PathLike | str, step: int, weights, m, v, *, fsync: bool = True
) -> tuple[pathlib.Path, int, str]:
    """Write ``step_NNNNNN.bin`` atomically into ``directory`` (docs/checkpoint-format.md#atomic-write).

    weights, m, v: float32 1-D arrays of equal length n (anything np.asarray turns into one,
    e.g. a CPU tensor's numpy view), copied into a new file image that
    ``write_checkpoint_image`` writes with ``recycle=False`` (so no other file is touched).
    step: int in [0, INT32_MAX]; n in [1, INT32_MAX]. Returns and raises as
    ``write_checkpoint_image``, plus CheckpointError rules "dtype" and "shape" (unequal
    lengths) before any file is touched.
    """
    final_name = checkpoint_name(step)  # raises for a bad step
    arrays = [
        _as_f32_vector(a, what, final_name)
        for a, what in ((weights, "weights"), (m, "m"), (v, "v"))
    ]
    n = arrays[0].shape[0]
    if arrays[1].shape[0] != n or arrays[2].shape[0] != n:
        raise CheckpointError(
            f"{final_name}: weights, m, v have lengths {n:,}, {arrays[1].shape[0]:,}, "
            f"{arrays[2].shape[0]:,}; they must be equal: m and v must come from the same "
            f"parameters in the same order",
            rule="shape",
        )
    image = alloc_checkpoint_image(n)  # raises for a bad n
    for dst, src in zip(image_arrays(image), arrays):
        dst[:] = src
    return write_checkpoint_image(directory, step, image, fsync=fsync, recycle=False)


# ---------------------------------------------------------------------------- file images

DIRECT_ALIGN = 4096  # bytes: O_DIRECT needs buffer address, file offset and length aligned


def image_offset(address: int) -> int:
    """Bytes to skip from ``address`` to the next multiple of DIRECT_ALIGN (0 if aligned)."""
    return -address % DIRECT_ALIGN


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
    return raw[off : off + size]


def image_arrays(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, m, v): float32 views of a file image's three regions (no copy)."""
    n = _image_n(image)
    flat = image[HEADER_BYTES:].view(F32)
    return flat[:n], flat[n : 2 * n], flat[2 * n :]


def _image_n(image) -> int:
    if (
        not isinstance(image, np.ndarray)
        or image.dtype != np.uint8
        or image.ndim != 1
        or not image.flags.c_contiguous
    ):
        raise CheckpointError(
            f"checkpoint image must be a 1-D C-contiguous uint8 array, got "
            f"{getattr(image, 'dtype', type(image).__name__)} "
            f"{getattr(image, 'shape', '')}: allocate it with alloc_checkpoint_image",
            rule="shape",
        )
    size = image.shape[0]
    if size < HEADER_BYTES + 12 or (size - HEADER_BYTES) % 12:
        raise CheckpointError(
            f"checkpoint image of {size:,} bytes is not 8 + 12 x n_params with n_params >= 1: "
            f"allocate it with alloc_checkpoint_image",
            rule="shape",
        )
    return (size - HEADER_BYTES) // 12


def _clear_direct(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


RECYCLED_NAME = ".recycled-checkpoint.bin"  # a retired checkpoint, overwritten by the next


def reusable(st: os.stat_result) -> bool:
    """True for what a write may overwrite in place: a regular file (not a symlink, whose
    target could be anything, nor a directory or FIFO) with no other name (``st_nlink == 1``:
    never an operator's hard link). ``st`` from ``os.lstat``."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _take_recycled(directory: pathlib.Path, tmp: pathlib.Path) -> bool:
    """Rename ``RECYCLED_NAME`` to ``tmp`` if it is ``reusable``; True when it was. Anything
    else found there is removed (a directory is left alone) and the write makes a new file."""
    src = directory / RECYCLED_NAME
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(src)
        if reusable(st):
            os.rename(src, tmp)
            return True
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(src)  # a symlink goes, never its target
    return False


def recycle_checkpoint(path: os.PathLike | str) -> pathlib.Path:
    """Retire checkpoint ``path`` by renaming it to ``RECYCLED_NAME`` in its directory, where
    ``write_checkpoint_image`` overwrites it in place as its next file instead of creating one
    (docs/checkpoint-format.md#retention). A file already there is replaced (and so deleted).
    The name matches neither a checkpoint nor a temporary: nothing loads, lists or cleans it
    up as one. The caller checks ``reusable`` first (the next write checks it again).
    Returns the new path; raises OSError (FileNotFoundError when ``path`` is gone; another
    OSError when a directory holds the name).
    """
    path = pathlib.Path(path)
    dest = path.parent / RECYCLED_NAME
    os.replace(path, dest)
    return dest


def _write_image(
    tmp: pathlib.Path, view: memoryview, aligned: bool, fsync: bool, reuse: bool = False
) -> None:
    """Write ``view`` to the file ``tmp``: new, or (``reuse``) an existing file overwritten in
    place from byte 0 and cut to ``len(view)``: its blocks are already allocated, so the
    write changes no block map and frees nothing (scripts/bench_checkpoint.py). The
    4096-aligned bulk with O_DIRECT when possible (no copy into the page cache), the rest (and
    everything, where O_DIRECT is refused or the buffer is not aligned) with plain write(2);
    short writes are continued; then fsync."""
    o_direct = getattr(os, "O_DIRECT", 0)
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    # a reused file is never followed through a link, nor opened if it is not a regular file
    flags |= (os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0)) if reuse else os.O_TRUNC
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
    if reuse and not reusable(os.fstat(fd)):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{tmp.name} is not a regular file with one name")
    try:
        total = len(view)
        bulk = total - total % DIRECT_ALIGN
        done = 0
        while done < total:
            if direct and (done >= bulk or done % DIRECT_ALIGN):
                _clear_direct(fd)
                direct = False
            try:
                got = os.write(fd, view[done : bulk if direct else total])
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:  # alignment refused: plain writes
                    _clear_direct(fd)
                    direct = False
                    continue
                raise
            if got == 0:
                raise OSError(errno.EIO, f"write(2) wrote 0 bytes at offset {done:,}")
            done += got
        if reuse and os.fstat(fd).st_size != total:
            os.ftruncate(fd, total)  # a recycled file of another size (another model)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint_image(
    directory: os.PathLike | str,
    step: int,
    image: np.ndarray,
    *,
    fsync: bool = True,
    recycle: bool = True,
) -> tuple[pathlib.Path, int, str]:
    """Write a file image (``alloc_checkpoint_image``) as ``step_NNNNNN.bin``, atomically.

    The fast path of the background writer (scripts/bench_checkpoint.py): the image already
    holds the file's bytes, so the write is ONE sequential write of one buffer (O_DIRECT where
    it can: ``_write_image``), then fsync. Where retention left a retired checkpoint
    (``RECYCLED_NAME``, ``recycle_checkpoint``) it is renamed to the temporary and overwritten
    in place instead of a new file being created (``recycle=False``: never). Sets the header
    bytes image[0:8] to (step, n_params); weights, m, v must already be in place and must not
    change during the call. Writes ``.{final_name}.tmp-{pid}`` in the same directory, computes
    crc32 over exactly the bytes written (in a helper thread, overlapping the write and the
    fsync), fsyncs (if ``fsync``), renames over the final name with os.replace and fsyncs the
    directory. An existing file for the same step is replaced atomically.
    Returns (final_path, nbytes, "crc32:%08x"), nbytes = 8 + 12*n_params.
    Raises CheckpointError for a bad step or image (rules "limits", "shape", before any file
    is touched) and for any OSError (rule "io", errno text in the message, the OSError as
    __cause__). On every exception, KeyboardInterrupt included, the temporary is removed and
    the exception propagates; other checkpoints are never touched.
    """
    directory = pathlib.Path(directory)
    final_name = checkpoint_name(step)
    step = int(step)
    n = _image_n(image)
    check_int32_limits(step, n)
    image[:HEADER_BYTES] = np.frombuffer(HEADER.pack(step, n), dtype=np.uint8)
    view = memoryview(image).cast("B")  # type: ignore[arg-type]  # numpy's stubs omit the buffer protocol
    crc = BackgroundCrc()
    crc.feed(view)
    aligned = image_offset(image.ctypes.data) == 0

    def write_body(tmp: pathlib.Path) -> None:
        # the rename is atomic: a kill leaves the file under one name or the other
        if recycle and _take_recycled(directory, tmp):
            try:
                _write_image(tmp, view, aligned, fsync, reuse=True)
                return
            except OSError as exc:  # it changed under us (a link, a FIFO): a new file instead
                if exc.errno not in (errno.ELOOP, errno.EINVAL, errno.ENXIO, errno.EISDIR):
                    raise
                os.unlink(tmp)
        _write_image(tmp, view, aligned, fsync)

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
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # gone, or clean_stale_temporaries at the next start removes it
        if isinstance(exc, OSError):
            where = final if renamed else tmp
            raise CheckpointError(
                f"{final_name}: write failed at {where} ({exc.strerror or exc}; errno "
                f"{errno.errorcode.get(exc.errno or 0, exc.errno)}): the temporary was removed and "
                f"earlier checkpoints are intact; free disk space or fix the directory, then "
                f"retry",
                path=where,
                rule="io",
            ) from exc
        raise
    return final, HEADER_BYTES + 12 * n, format_crc(crc.result())
