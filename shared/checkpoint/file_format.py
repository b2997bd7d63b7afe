"""The flat checkpoint file's layout: names, limits, sizes, errors, checksums (docs/checkpoint-format.md).

What it is: the one place that knows the byte layout of ``step_NNNNNN.bin``
(docs/checkpoint-format.md#layout: int32 step, int32 n_params, then weights, m and v as
little-endian float32[n_params]), how to name one, the int32 limits, ``CheckpointError`` and
the crc32 the manifest records (``BackgroundCrc``: in a helper thread, overlapping a read or a
write).

What it is not: reading and validating a file (``shared/checkpoint/read.py``), writing one
(``shared/checkpoint/write.py``), the run directory's policy (``shared/checkpoint/directory.py``),
the manifest (``shared/checkpoint/manifest.py``), the background writer thread or the torch side
(``worker/``). numpy, isal and the standard library only: the proxy imports it without torch.
"""

from __future__ import annotations

import operator
import os
import pathlib
import queue
import re
import struct
import threading
from dataclasses import dataclass

import numpy as np

# ISA-L's crc32: zlib.crc32's values (the running value included) at about a quarter of the CPU,
# which a background checkpoint takes from training (docs/checkpoint-format.md#writing-without-stalling)
from isal.isal_zlib import crc32

HEADER_BYTES = 8  # int32 step + int32 n_params
INT32_MAX = 2**31 - 1  # largest step / n_params the header can hold
CHECKSUM_CHUNK = 8 * 1024 * 1024  # bytes per crc32 call of a checksum read
HEADER = struct.Struct("<ii")  # little-endian step, n_params
F32 = np.dtype("<f4")  # on-disk element type
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

    step: int in [0, INT32_MAX]; n_params: int in [1, INT32_MAX] (numpy integers accepted, bools
    and floats refused). Raises CheckpointError (rule "limits") naming the value; call it before
    training starts.
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
    """True if ``name`` is a checkpoint temporary, i.e. matches ``.step_*.bin.tmp-*``
    (docs/checkpoint-format.md#atomic-write): the writer names them ``.{final_name}.tmp-{pid}``.
    """
    return _TEMP_RE.fullmatch(name) is not None


def check_n_params(n_params: int | None) -> int | None:
    """A model's parameter count as an int (None stays None), refused as ``check_int32_limits``
    refuses it (CheckpointError, rule "limits")."""
    if n_params is None:
        return None
    check_int32_limits(0, n_params)
    return operator.index(n_params)


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
