"""`.loss.json`: the run's append-only per-step history (docs/history.md).

What it is: the format (docs/history.md#on-disk-format), the O(1) appender `LossHistory`, whose
opening repairs a torn tail (docs/history.md#torn-tail-repair), the tolerant readers and
`rewind`, all in memory that does not grow with the history (docs/history.md#cost).

What it is not: safe for two writers at once (the proxy's run-directory lock guarantees one),
nor a general JSON library. Stdlib only; never imports torch, proxy or worker.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import mmap
import operator
import os
import re
import time
from typing import Iterable, Iterator

from shared.atomic_io import aside_name, atomic_write_bytes, fsync_dir, named
from shared.json_safe import jsonable

log = logging.getLogger("shared.run.loss_history")

_CLOSE = b"\n]\n"  # the tail every healthy history ends with
_EMPTY = b"[\n]\n"  # a history with no records
_STRUCTURAL = b" \t\r\n,[]"  # bytes between records that carry no data
_STEP_AT_LINE_START = re.compile(rb'\n\{"step":(-?\d+)[,}]')  # literal prefix: fast search
_MAX_BACKSCAN_LINES = 64  # lines looked at from the end to find the last clean record
_MAX_LISTED = 5  # damage kinds / dropped steps listed in one warning
_LINE_STEP = re.compile(rb'\{"step":(-?\d+)[,}]')  # a record line's start
_NONBLANK = re.compile(rb"[^ \t\r\n]")
_CHUNK = 1 << 20  # bytes per slice when a scan covers the whole file
_SEEK_WINDOW = 1 << 16  # bytes read per probe of the binary search for a step
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)  # Linux, macOS; None elsewhere
_decoder = json.JSONDecoder()


# ---------------------------------------------------------------------------------------------
# encoding


def _encode(record, path) -> tuple[int, bytes]:
    """(step, one-line JSON bytes) for a record; ValueError/TypeError naming the problem."""
    if not isinstance(record, dict):
        raise TypeError(f"{path}: a history record must be a dict, got {type(record).__name__}")
    step = record.get("step")
    try:
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)  # type: ignore[arg-type]  # None raises TypeError: caught
    except TypeError:
        raise ValueError(f'{path}: a history record needs an int "step", got {step!r}') from None
    rec = {"step": step, **{k: jsonable(v) for k, v in record.items() if k != "step"}}
    return step, json.dumps(rec, separators=(",", ":"), allow_nan=False).encode("ascii")


# ---------------------------------------------------------------------------------------------
# scanning (pure functions over the file's bytes)


def _lines(data: bytes, pos: int) -> Iterator[tuple[int, bytes]]:
    n, released = len(data), pos
    while pos < n:
        nl = data.find(b"\n", pos)
        if nl < 0:
            nl = n
        yield pos, data[pos:nl]
        pos = nl + 1
        if pos - released > _CHUNK:
            released = pos
            _release(data, pos)


def _clean_record(line: bytes):
    """(obj, length) when `line` is exactly one JSON object, optionally followed by ','."""
    core = line[:-1] if line.endswith(b",") else line
    if core[:1] != b"{" or core[-1:] != b"}":
        return None
    try:
        obj = json.loads(core)
    except ValueError:
        return None
    return (obj, len(core)) if isinstance(obj, dict) else None


def _is_step(step) -> bool:
    return type(step) is int


def _tokens(line: bytes, base: int):
    """Yield ("rec", start, end, obj) and ("bad", start, end, why) for one line; structural
    bytes (whitespace, commas, brackets) between them are not reported."""
    hit = _clean_record(line)
    if hit is not None:
        yield "rec", base, base + hit[1], hit[0]
        return
    text = line.decode("latin-1")  # one char per byte, so offsets stay byte offsets
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r,[]":
            i += 1
            continue
        if c == "{":
            try:
                obj, j = _decoder.raw_decode(text, i)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                with contextlib.suppress(ValueError):  # from bytes: non-ASCII text as UTF-8
                    obj = json.loads(line[i:j])
                yield "rec", base + i, base + j, obj
                i = j
                continue
            j = text.find('{"step"', i + 1)
            j = n if j < 0 else j
            nul = text.find("\x00", i, j)  # a torn record then a NUL-padded block
            j = j if nul < 0 else nul
            yield "bad", base + i, base + j, "incomplete record"
            i = j
            continue
        j = text.find("{", i + 1)
        j = n if j < 0 else j
        yield "bad", base + i, base + j, "NUL bytes" if "\x00" in text[i:j] else "unexpected bytes"
        i = j


def _walk(data: bytes, pos: int, prev_step, monotonic: bool, notes: list):
    """Yield (start, end, step, obj, shares_line) for each record to keep in data[pos:], in
    file order. Damage is appended to `notes` as (offset, bytes_dropped, kind)."""
    for line_start, line in _lines(data, pos):
        record_on_line = False
        for kind, s, e, x in _tokens(line, line_start):
            if kind == "bad":
                notes.append((s, len(data[s:e].translate(None, _STRUCTURAL)), x))
                continue
            shares_line, record_on_line = record_on_line, True
            step = x.get("step")
            if not _is_step(step):
                notes.append((s, e - s, 'JSON object without an int "step"'))
                continue
            if monotonic and prev_step is not None and step <= prev_step:
                notes.append(
                    (s, e - s, f"step {step} not after step {prev_step} (duplicate after a crash?)")
                )
                continue
            yield s, e, step, x, shares_line
            prev_step = step


def _release(data, upto: int) -> None:
    """Let go of the pages of a memory map below byte `upto`, which a scan has read and will not
    come back to (a no-op for bytes): resident memory stays flat (docs/history.md#cost)."""
    if isinstance(data, mmap.mmap) and _MADV_DONTNEED is not None:
        upto -= upto % mmap.PAGESIZE
        if upto > 0:
            data.madvise(_MADV_DONTNEED, 0, upto)


def _count(data, sub: bytes, start: int, end: int) -> int:
    """data[start:end].count(sub) for a `sub` that cannot overlap itself, _CHUNK bytes at a
    time (data may be a memory map, which has no count)."""
    n = 0
    for i in range(start, end, _CHUNK):
        n += data[i : min(end, i + _CHUNK + len(sub) - 1)].count(sub)
        _release(data, i)
    return n


def _prefix_ok(data, cut: int, monotonic: bool):
    """Number of records when data[:cut] is a canonical history prefix ("[\\n{..},\\n...{..}"),
    checked at C speed without parsing every record; None when it is not provably so. `data`
    is bytes or a memory map; memory stays within a few _CHUNKs whatever its size."""
    if data[:3] != b"[\n{" or _count(data, b"\x00", 0, cut) or _count(data, b"}{", 0, cut):
        return None
    n = _count(data, b"\n", 0, cut)
    if _count(data, b"\n{", 0, cut) != n or _count(data, b"},\n", 0, cut) != n - 1:
        return None
    if monotonic:
        seen, prev, released = 0, None, 0
        for m in _STEP_AT_LINE_START.finditer(data, 0, cut):
            step = int(m.group(1))
            if prev is not None and step <= prev:
                return None
            seen, prev = seen + 1, step
            if m.start() - released > _CHUNK:
                released = m.start()
                _release(data, released)
        if seen != n:
            return None
    return n


def _trusted_prefix(data: bytes, monotonic: bool):
    """(cut, count, last_step) for the longest canonical prefix ending at a clean record line
    near the end of the file, or None (then the whole file must be walked)."""
    end = len(data)
    for _ in range(_MAX_BACKSCAN_LINES):
        nl = data.rfind(b"\n", 0, end)
        hit = _clean_record(data[nl + 1 : end])
        if hit is not None:
            if not _is_step(hit[0].get("step")):
                return None
            cut = nl + 1 + hit[1]
            n = _prefix_ok(data, cut, monotonic)
            return None if n is None else (cut, n, hit[0]["step"])
        if nl < 0:
            return None
        end = nl
    return None


class _Plan:
    """What opening a history found: the offset to cut at, the bytes to write there (None when
    healthy), the record count and last step afterwards, and the warnings."""

    def __init__(self, kind, cut=0, tail=None, count=0, last_step=None, messages=(), damaged=False):
        self.kind, self.cut, self.tail = kind, cut, tail
        self.count, self.last_step, self.messages = count, last_step, list(messages)
        self.damaged = damaged  # a hole: the rewritten region's bytes are kept aside first


def _first_byte(data) -> bytes:
    """The first byte that is not whitespace, b"" for a blank file (bytes or a memory map)."""
    m = _NONBLANK.search(data)
    return b"" if m is None else data[m.start() : m.start() + 1]


def _last_byte(data, skip: bytes) -> bytes:
    """data.rstrip(skip)[-1:], looking back _CHUNK bytes at a time (data may be a memory map)."""
    end = len(data)
    while end > 0:
        piece = data[max(0, end - _CHUNK) : end].rstrip(skip)
        if piece:
            return piece[-1:]
        end -= _CHUNK
    return b""


def _ends_with(data, tail: bytes, at: int) -> bool:
    """data[at:] == tail, without copying a long data[at:] (data may be a memory map)."""
    return len(data) - at == len(tail) and data[at:] == tail


def _plan(data, path, monotonic: bool) -> _Plan:
    """What opening the history `data` (bytes or a read-only memory map of the file) must do."""
    if not _first_byte(data):
        note = f"{path}: empty file ({len(data)} bytes); starting a fresh history"
        return _Plan("empty", 0, _EMPTY, messages=[note])
    if _first_byte(data) != b"[":
        return _Plan("garbage")
    trusted = _trusted_prefix(data, monotonic)
    if trusted is not None:
        cut, count, last_step = trusted
        if _ends_with(data, _CLOSE, cut):
            return _Plan("ok", cut, None, count, last_step)
    else:
        cut, count, last_step = (1, 0, None) if data[:1] == b"[" else (0, 0, None)
    notes: list = []
    rewrite: list[bytes] = []
    glued = False
    chain_end, chain = cut, count
    holes: list[tuple[int, int, int, int]] = []  # (first byte, end byte, first step, last step)
    noted = 0
    for s, e, step, _obj, shares_line in _walk(data, cut, last_step, monotonic, notes):
        if len(notes) > noted and step > (last_step or 0) + 1:  # damage, then steps missing
            holes.append((notes[noted][0], s, (last_step or 0) + 1, step - 1))
        noted = len(notes)
        glued = glued or shares_line
        sep = b",\n" if count else b"\n"
        if not rewrite and not notes and chain_end > 0 and data[chain_end:s] == sep:
            chain_end, chain = e, chain + 1  # still canonical: keep in place
        else:
            rewrite.append(sep + data[s:e])
        count += 1
        last_step = step
    if not rewrite and not notes and _ends_with(data, _CLOSE if chain_end else b"", chain_end):
        return _Plan("ok", chain_end, None, count, last_step)
    tail = (b"" if chain_end else b"[") + b"".join(rewrite) + _CLOSE
    dropped = sum(n for _, n, _ in notes)
    kinds: dict[str, list[int]] = {}
    for offset, _, kind in notes:
        kinds.setdefault(kind.split(" not after")[0], []).append(offset)  # steps: no numbers
    why = [
        f"{k} at byte {offs[0]}" + (f" (+{len(offs) - 1} more)" if len(offs) > 1 else "")
        for k, offs in kinds.items()
    ]
    if glued:
        why.append("records glued on one line (all kept)")
    if _last_byte(data, b"\x00 \t\r\n,") != b"]":
        why.append("no closing ]")
    if not why:
        why.append(f"tail {data[chain_end : chain_end + 16]!r} is not {_CLOSE!r}")
    more = f"; +{len(why) - _MAX_LISTED} more" if len(why) > _MAX_LISTED else ""
    where = (
        f"{len(holes)} hole(s) inside the history, not a torn tail: "
        + "; ".join(f"bytes {a}..{b} damaged, steps {x}..{y} lost" for a, b, x, y in holes)
        + " (steps past them kept)"
        if holes
        else f"torn tail at byte {chain_end}"
    )
    messages = [
        f"{path}: {where} ({dropped} bytes dropped: "
        f"{'; '.join(why[:_MAX_LISTED])}{more}); kept {count} records, "
        f"last step {last_step}"
    ]
    dups = [(o, k) for o, _, k in notes if k.startswith("step ")]
    for offset, kind in dups[:_MAX_LISTED]:
        messages.append(f"{path}: dropped the record at byte {offset}: {kind}")
    if len(dups) > _MAX_LISTED:
        messages.append(f"{path}: dropped {len(dups) - _MAX_LISTED} more out-of-order records")
    # a torn tail (every kill) is not worth a copy; a hole is
    return _Plan("repair", chain_end, tail, count, last_step, messages, damaged=bool(holes))


# ---------------------------------------------------------------------------------------------
# low-level writes


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write at byte {offset + done}")
        done += n


def _sync(fd: int) -> None:
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


def _keep_damaged(path: str, data, start: int) -> str:
    """Copy data[start:] (bytes or a memory map) to `<path>.damaged-<unix time>` (`aside_name`),
    fsynced, _CHUNK bytes at a time; returns the copy's name."""
    aside = aside_name(path, "damaged")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for i in range(start, len(data), _CHUNK):
            _pwrite_all(fd, bytes(data[i : min(len(data), i + _CHUNK)]), i - start)
            _release(data, i)
        _sync(fd)
    finally:
        os.close(fd)
    return os.path.basename(aside)


# ---------------------------------------------------------------------------------------------
# the appender


class LossHistory:
    """Appender for one history file. Opening repairs a torn tail (see module docstring); the
    warnings are logged and kept in `self.repairs`. One writer at a time.

    Writes go straight to the OS (pwrite, no user-space buffer), so a killed process loses
    nothing it appended; `fsync=True` makes every append durable against power cuts too.
    `monotonic=False` (used for `.loss.rewound.json`) accepts steps in any order.
    """

    def __init__(self, path, *, fsync: bool = False, monotonic: bool = True):
        self.path = os.fspath(path)
        self.fsync = fsync
        self.monotonic = monotonic
        self.repairs: list[str] = []
        self.last_step: int | None = None
        self.bytes_written = 0  # bytes passed to write by appends (benchmarks, O(1) tests)
        self._fd: int | None = None
        self._end = 1  # offset of the closing "\n]\n" (end of the last record)
        self._count = 0
        self._open()

    # -- open / repair
    def _open(self) -> None:
        if not os.path.exists(self.path):
            atomic_write_bytes(self.path, _EMPTY)
        fd = os.open(self.path, os.O_RDWR)
        try:
            with _mapped(self.path) as data:  # read through a map: memory flat in the size
                plan = _plan(data, self.path, self.monotonic)
                size, head = len(data), data[:16]
                if plan.kind == "repair" and plan.damaged:
                    aside = _keep_damaged(self.path, data, plan.cut)
                    plan.messages[0] += (
                        f"; the original bytes from byte {plan.cut} on are kept in {aside} for "
                        "a post-mortem"
                    )
            if plan.kind == "garbage":
                os.close(fd)
                fd = None  # type: ignore[assignment]  # closed: reopened below before any use
                aside = aside_name(self.path, "corrupt")
                os.replace(self.path, aside)
                fsync_dir(os.path.dirname(os.path.abspath(self.path)))
                atomic_write_bytes(self.path, _EMPTY)
                fd = os.open(self.path, os.O_RDWR)
                plan = _Plan(
                    "fresh",
                    messages=[
                        f"{self.path}: not a loss history ({size} bytes, starts with {head!r}, "
                        f"expected '['); moved aside to {aside} and started a fresh history"
                    ],
                )
            elif plan.tail is not None:  # "empty" or "repair"
                os.ftruncate(fd, plan.cut)  # truncate first: a crash now is a
                _pwrite_all(fd, plan.tail, plan.cut)  # plain "no closing ]", still repairable
                _sync(fd)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        self._fd = fd
        self._count = plan.count
        self.last_step = plan.last_step
        self._end = os.fstat(fd).st_size - len(_CLOSE)
        for message in plan.messages:
            log.warning("%s", message)
        self.repairs.extend(plan.messages)

    # -- appends
    def append(self, record: dict) -> None:
        """Append one record; its int "step" must be greater than `last_step`."""
        self.append_many((record,))

    def append_many(self, records: Iterable[dict]) -> None:
        """Append a batch with one write call; all-or-nothing on validation errors."""
        if self._fd is None:
            raise ValueError(f"{self.path}: history is closed")
        chunks = []
        last = self.last_step
        for record in records:
            step, raw = _encode(record, self.path)
            if self.monotonic and last is not None and step <= last:
                raise ValueError(
                    f"{self.path}: record step {step} is not after the last step {last}; the "
                    "history holds one record per step - to resume from an earlier checkpoint, "
                    "rewind() the history to it first"
                )
            chunks.append(raw)
            last = step
        if not chunks:
            return
        buf = (b",\n" if self._count else b"\n") + b",\n".join(chunks) + _CLOSE
        self._write_at(self._end, buf)
        self._end += len(buf) - len(_CLOSE)
        self._count += len(chunks)
        self.last_step = last
        if self.fsync:
            _sync(self._fd)

    def _write_at(self, offset: int, buf: bytes) -> None:
        assert self._fd is not None  # open: writes happen only between _open and close
        try:
            _pwrite_all(self._fd, buf, offset)
        except BaseException as e:
            # e.g. disk full mid-write: put the closing bracket back so the file stays valid
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._end)
                _pwrite_all(self._fd, _CLOSE, self._end)
            if isinstance(e, OSError):
                raise named(e, self.path) from e
            raise
        self.bytes_written += len(buf)

    # -- lifecycle
    def flush(self) -> None:
        """Appends are already in the OS; the constructor's `fsync=True` makes them durable."""
        if self._fd is not None and self.fsync:
            _sync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.flush()
            finally:
                os.close(self._fd)
                self._fd = None

    def rewind(self, keep_upto_step: int, rewound_path, reason: str) -> int:
        """`rewind()` on this open history; returns the number of records moved."""
        self.close()
        try:
            return rewind(self.path, keep_upto_step, rewound_path, reason, repaired=True)
        finally:
            self._open()

    def __len__(self) -> int:
        return self._count

    def __enter__(self) -> "LossHistory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LossHistory({self.path!r}, records={self._count}, last_step={self.last_step})"


# ---------------------------------------------------------------------------------------------
# readers and maintenance


@contextlib.contextmanager
def _mapped(path):
    """A read-only memory map of the whole file at `path` (b"" when it is empty), closed on
    exit: the page cache holds the bytes, not this process's heap."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            yield m


def _start_offset(f, after_step: int) -> int:
    """A byte offset at a line start such that no record before it has a step > after_step:
    a binary search over the byte range on the steps at line starts (records are one per line
    in step order, docs/history.md#on-disk-format), so finding the tail costs O(log n) short reads,
    not the whole file. When a probe lands on damage the search stops where it is (the reader
    then parses on from there, which is slower, never wrong)."""
    size = f.seek(0, os.SEEK_END)
    lo, hi = 0, size
    while hi - lo > _SEEK_WINDOW:
        mid = (lo + hi) // 2
        f.seek(mid - 1)  # from the byte before: a "\n" right at mid-1
        m = _STEP_AT_LINE_START.search(f.read(min(_SEEK_WINDOW, size - mid + 1)))
        if m is None:
            if size - mid <= _SEEK_WINDOW:  # no record line in the last window: the end
                hi = mid
                continue
            return lo  # damage: read on from what is known
        if int(m.group(1)) <= after_step:
            lo = mid + m.start()
        else:
            hi = mid
    return lo


def iter_records_after(path, after_step: int, end_step: int | None = None) -> Iterator[dict]:
    """Records with after_step < step <= end_step, one at a time, in file order: those of
    `iter_records(path, skip_upto=after_step)` up to end_step, so time is the records returned
    and memory one line, whatever the history's length (docs/history.md#cost)."""
    records = iter_records(path, skip_upto=after_step)
    yield from itertools.takewhile(lambda r: end_step is None or r["step"] <= end_step, records)


def iter_records(path, skip_upto: int | None = None) -> Iterator[dict]:
    """Records one at a time (line by line, little memory). Tolerant: damage is skipped with a
    warning and nothing is written; a missing file yields nothing. With `skip_upto`, only those
    after that step, read from where `_start_offset` finds them, lines holding one record whose
    step is <= `skip_upto` passed over without parsing (glued records are parsed)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        head = f.read(4096)
        if not head.strip(b" \t\r\n"):
            return
        if _first_byte(head) != b"[":
            log.warning("%s: not a loss history (starts with %r); read no records", path, head[:16])
            return
        start = 0 if skip_upto is None else _start_offset(f, skip_upto)
        f.seek(start)
        prev_step, offset, damaged = skip_upto, start, 0  # yield steps after prev_step only
        for line in f:
            if skip_upto is not None:
                m = _LINE_STEP.match(line)
                if m is not None and int(m.group(1)) <= skip_upto and b"}{" not in line:
                    offset += len(line)
                    continue
            body = line[:-1] if line.endswith(b"\n") else line
            for kind, _s, _e, x in _tokens(body, offset):
                if (
                    kind == "rec"
                    and _is_step(x.get("step"))
                    and not (prev_step is not None and x["step"] <= prev_step)
                ):
                    prev_step = x["step"]
                    yield x
                elif kind == "rec" or body.strip(b"\x00"):
                    damaged += 1
            offset += len(line)
        if damaged:
            log.warning(
                "%s: skipped %d damaged or out-of-order pieces while reading", path, damaged
            )


TAIL_BYTES = 1 << 17  # `tail_records`' default: the last 128 KiB, a few hundred records


def tail_records(path, nbytes: int = TAIL_BYTES) -> list[dict]:
    """The complete records in the last `nbytes` of the history at `path`, in file order, read
    from the end without the rest of the file (what `status`, the progress line and `pivot`
    show). A torn or partial line is skipped; a missing or unreadable file gives []."""
    try:
        with open(path, "rb") as f:
            start = max(0, os.fstat(f.fileno()).st_size - nbytes)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    if start:  # the first line is cut: it begins at the first newline
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    return [
        x
        for line in data.split(b"\n")
        for kind, _s, _e, x in _tokens(line, 0)
        if kind == "rec" and _is_step(x.get("step"))
    ]


def repair(path) -> list[str]:
    """Repair a history in place (what opening it does); returns the warnings. A missing file
    is left missing."""
    if not os.path.exists(path):
        return []
    history = LossHistory(path, fsync=True)
    history.close()
    return history.repairs


def rewind(path, keep_upto_step: int, rewound_path, reason: str, *, repaired: bool = False) -> int:
    """Move the records with step > keep_upto_step to `rewound_path` (appended, each with
    "rewound_reason" and "rewound_at"), then cut `path` right after the last kept record.
    The rewound file is written and fsynced before `path` is truncated, so a crash in between
    leaves the records in both files, never in neither. Returns the number moved.
    `repaired=True` skips the repair pass (the caller just opened the history, which repairs)."""
    path = os.fspath(path)
    if not repaired:
        repair(path)  # canonical layout from here on
    moved: list[dict] = []
    try:
        with _mapped(path) as data:  # only the rewound tail is read (memory flat in the history)
            if len(data) <= len(_EMPTY):
                return 0
            end = len(data) - len(_CLOSE)  # end of the last record
            cut = 1
            while end > 1:
                nl = data.rfind(b"\n", 0, end)
                hit = _clean_record(data[nl + 1 : end])
                if hit is None or not _is_step(hit[0].get("step")):
                    raise ValueError(
                        f"{path}: unreadable record line at byte {nl + 1} while "
                        f"rewinding to step {keep_upto_step}; move the file aside "
                        "and run repair()"
                    )
                record, length = hit
                if record["step"] <= keep_upto_step:
                    cut = nl + 1 + length
                    break
                moved.append(record)
                end = nl
    except FileNotFoundError:
        return 0
    if not moved:
        return 0
    moved.reverse()
    now = time.time()
    for record in moved:
        record["rewound_reason"] = reason
        record["rewound_at"] = now
    with LossHistory(rewound_path, fsync=True, monotonic=False) as out:
        out.append_many(moved)
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, cut)  # truncate first: see LossHistory._open
        _pwrite_all(fd, _CLOSE, cut)
        _sync(fd)
    finally:
        os.close(fd)
    log.warning(
        "%s: rewound %d records (steps %d..%d) to %s: %s",
        path,
        len(moved),
        moved[0]["step"],
        moved[-1]["step"],
        os.fspath(rewound_path),
        reason,
    )
    return len(moved)


def holes(path) -> list[tuple[int, int]]:
    """The steps missing from the history at `path`, as [first, last] ranges between step 1 and
    its last step ([] for a missing file): steps a repair dropped (docs/history.md#torn-tail-repair).
    A canonical file whose steps are 1..n is checked at C speed as opening checks it; any other
    is streamed record by record to find where."""
    try:
        with _mapped(path) as data:  # the opening's own check: a canonical file, at C speed
            trusted = _trusted_prefix(data, True) if len(data) else None
            first = _STEP_AT_LINE_START.search(bytes(data[:_CHUNK]))
    except FileNotFoundError:
        return []
    if trusted is not None and first is not None:
        _, n, last = trusted
        if int(first.group(1)) == 1 and last == n:
            return []
    out, prev = [], 0
    for rec in iter_records(path):  # every record it yields has an int "step"
        if rec["step"] > prev + 1:
            out.append((prev + 1, rec["step"] - 1))
        prev = rec["step"]
    return out
