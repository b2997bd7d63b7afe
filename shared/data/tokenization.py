"""The streaming tokenization pipeline: an arm's source -> `data/<arm>.u16` (or `.u32`), in
bounded memory, in parallel, with progress (docs/data.md#tokenization), resumable after a stop or
a kill (docs/data.md#crash-safe-creation); and the checks of pre-tokenized `tokens` arms.

What it is not: the arm index and held-out split (`shared/data/token_files.py`), the readers.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from shared.atomic_io import atomic_write_json, read_json
from shared.data.arms import ArmSourceError, token_files
from shared.data.sources import SEPARATOR, BadRecords, open_arm
from shared.data.tokenizer import RunTokenizer
from shared.progress import Progress, megabytes
from shared.run import stop_request
from shared.run.config import ArmSpec

ITEM_CHARS = 1 << 16  # characters per encode item (the unit of parallel work)
ITEMS_PER_THREAD = 2  # items per encoder thread in one batch (load balance at its end)
MIN_BATCH_ITEMS = 8
SCAN_TOKENS = 1 << 24  # tokens per chunk when scanning a token file's ids


def encoder_threads() -> int:
    """Threads the `tokenizers` library encodes on: RAYON_NUM_THREADS, else the usable cores."""
    given = os.environ.get("RAYON_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1  # not on Linux


def batch_items() -> int:
    """Items (of ITEM_CHARS characters) per batch handed to the encoder: enough for every
    thread to take ITEMS_PER_THREAD, no more, so that the encoder's working set (about 80 bytes
    per token of a batch) keeps peak RSS small and flat (measured: docs/data.md#tokenization)."""
    return max(MIN_BATCH_ITEMS, ITEMS_PER_THREAD * encoder_threads())


@dataclass
class ArmStats:
    """What creation used of an arm: documents, source bytes used/total, tokens, bad records."""

    documents: int = 0
    empty: int = 0  # documents with no text, skipped (ArmReader.empty)
    bytes_used: int = 0
    bytes_total: int = 0
    tokens: int = 0
    chars: int = 0  # characters tokenized (separators included)
    text_bytes: int = 0  # UTF-8 bytes of the decoded text tokenized (separators not included)
    capped: bool = False  # stopped at an explicit --arm-max-tokens
    bad: BadRecords = field(default_factory=BadRecords)


MMAP_THRESHOLD = 128 * 1024  # bytes: glibc's default before it starts adjusting it
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def pin_mmap_threshold() -> bool:
    """Keep every allocation of MMAP_THRESHOLD bytes or more in its own mapping, returned to the
    system when freed. glibc raises this threshold to the largest block freed so far (up to
    32 MiB), after which later batches come from the heap and fragment it, and peak RSS grows
    with the corpus (docs/data.md#tokenization). Returns False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def release_free_memory() -> bool:
    """Return the C heap's free pages to the system (glibc `malloc_trim(0)`, every arena), after
    a large transient working set such as BPE training, so what follows does not grow a heap
    left fragmented by it. Returns False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


_log = logging.getLogger("andrea.data")


def progress_path(tmp: Path) -> Path:
    """The progress record of partial token file `tmp` (`data/<arm>.u16.tmp` ->
    `data/<arm>.u16.progress.json`): what part of it is whole (docs/data.md#crash-safe-creation)."""
    return tmp.with_suffix(".progress.json")


class _Diverged(Exception):
    """The source no longer gives the text a progress record describes: start the arm over."""


def _resume_point(tmp: Path, key: dict) -> dict | None:
    """The progress record of `tmp` when it can be resumed from: made with `key` (the arm's
    spec, source fingerprint, tokenizer, cap), and `tmp` holds at least the bytes it records
    (the data is fsynced before the record is written, so after a kill -9 the file may only be
    longer). None otherwise (start the arm from its first byte)."""
    try:
        rec = read_json(progress_path(tmp), expect=dict, missing_ok=False)
        if rec.get("key") != key or tmp.stat().st_size < int(rec["bytes"]):
            return None
        for f in ("pieces", "done", "bytes", "tokens", "chars"):
            int(rec[f])
        return rec
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tokenize_stream(
    arm: ArmSpec,
    tok: RunTokenizer,
    tmp: Path,
    max_tokens: int,
    key: dict,
    after_batch: Callable[[], None] | None = None,
) -> tuple[str, ArmStats]:
    """Tokenize the whole text of `arm` into `tmp` (flat `tok.dtype`, no header), fsynced;
    `after_batch`, when given, is called after each batch's progress is recorded (a test's
    pause, proxy/fault_injection.py).

    Returns (content fingerprint "sha256:<hex>" of the text as streamed, stats). With
    `max_tokens` > 0 at most that many tokens are written (the source is still read to the end
    for the fingerprint and the "of total" figures). Raises ArmSourceError for an unreadable
    or corrupt source, and shared.run.stop_request.StopRequested when a stop was asked for (checked
    before each piece of the source).

    Resumable with `key` (what the arm's tokens are a function of): each batch is recorded in
    `progress_path(tmp)`, and the next call with the same key goes on from the record, with a
    result byte-identical to an uninterrupted run's (docs/data.md#crash-safe-creation). On any
    other error the caller removes `tmp` and its record."""
    try:
        return _tokenize(arm, tok, tmp, max_tokens, key, _resume_point(tmp, key), after_batch)
    except _Diverged as e:
        _log.warning("arm %s: %s; tokenizing it from the start", arm.name, e)
        progress_path(tmp).unlink(missing_ok=True)
        return _tokenize(arm, tok, tmp, max_tokens, key, None, after_batch)


def _tokenize(arm, tok, tmp, max_tokens, key, resume, after_batch):
    pin_mmap_threshold()  # memory that does not grow with the corpus (see there)
    reader = open_arm(arm)
    stats = ArmStats(bytes_total=reader.total, bad=reader.bad)
    h = hashlib.sha256()
    prog = Progress(f"arm {arm.name}", reader.total)
    pool = ThreadPoolExecutor(1, thread_name_prefix="encode")
    pending = None
    batch_chars = batch_items() * ITEM_CHARS
    batch: list[str] = []
    size, first, written, done_at_cap = 0, True, 0, None
    skip = 0  # pieces already in tmp (a resume)
    if resume is not None:
        skip, written = int(resume["pieces"]), int(resume["tokens"])
        done_at_cap = resume.get("capped_at")
        stats.capped = done_at_cap is not None
        _log.info(
            "arm %s: resuming its tokenization after %s of %s (%s tokens kept from the "
            "interrupted attempt)",
            arm.name,
            megabytes(int(resume["done"])),
            megabytes(reader.total),
            f"{written:,}",
        )

    def mark(pieces: int, done: int) -> dict:
        return {
            "pieces": pieces,
            "done": done,
            "chars": stats.chars,
            "text_sha256": h.copy().hexdigest(),
        }

    def record(fh, at: dict) -> None:
        """Make the ids written so far durable, then say so (in that order: kill -9 safe)."""
        fh.flush()
        os.fsync(fh.fileno())
        atomic_write_json(
            progress_path(tmp),
            {"key": key, **at, "bytes": fh.tell(), "tokens": written, "capped_at": done_at_cap},
        )
        if after_batch is not None:
            after_batch()

    def take(text: str, p, count: bool) -> None:
        """Hash piece `p`'s `text` (its separator included), count it when `count`, show it."""
        raw = text.encode("utf-8")
        h.update(raw)
        if count:
            stats.chars += len(text)
            stats.text_bytes += len(raw) - (len(text) - len(p.text))  # ASCII separator
        prog.update(p.done)

    def flush(fh, job) -> None:
        nonlocal written, done_at_cap
        fut, at = job
        ids = fut.result()
        if done_at_cap is not None:
            return  # a batch read before the cap was reached: none of it is the arm's
        if max_tokens and written + len(ids) >= max_tokens:
            ids = ids[: max_tokens - written]
            done_at_cap, stats.capped = at["done"], True
        fh.write(memoryview(np.ascontiguousarray(ids)).cast("B"))  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs omit it
        written += len(ids)
        record(fh, at)

    at_batch, n = None, 0
    if resume is None:
        progress_path(tmp).unlink(missing_ok=True)  # another key's: never to be used
    try:
        with open(tmp, "r+b" if resume is not None else "wb") as fh:
            if resume is not None:
                fh.truncate(int(resume["bytes"]))
                fh.seek(0, os.SEEK_END)
            for n, p in enumerate(reader.pieces(), 1):
                text = p.text
                if p.new_doc and not first:
                    text = SEPARATOR + text
                first = False
                if n <= skip:  # in tmp already: hashed and counted, not encoded
                    take(text, p, count=True)
                    stop_request.check(f"tokenization of arm {arm.name}")
                    if n == skip and (
                        p.done != int(resume["done"])
                        or h.hexdigest() != resume.get("text_sha256")
                        or stats.chars != int(resume["chars"])
                    ):
                        raise _Diverged(
                            "its source no longer gives the text the partial token "
                            "file was made from"
                        )
                    if n == skip:
                        prog.restart_rate()  # the rate and ETA of the encoding that is left
                    continue
                try:
                    stop_request.check(f"tokenization of arm {arm.name}")
                except stop_request.StopRequested:
                    if pending is not None:  # keep what was read: written and recorded
                        flush(fh, pending)
                        pending = None
                    if batch and done_at_cap is None:
                        flush(fh, (pool.submit(tok.encode_pieces, batch), at_batch))
                    raise
                take(text, p, count=done_at_cap is None)
                if done_at_cap is not None:
                    continue  # capped: read on only for the fingerprint and the total
                for i in range(0, len(text), ITEM_CHARS):
                    batch.append(text[i : i + ITEM_CHARS])
                size += len(text)
                at_batch = mark(n, p.done)
                if size >= batch_chars:
                    if pending is not None:
                        flush(fh, pending)
                    pending = (pool.submit(tok.encode_pieces, batch), at_batch)
                    batch, size = [], 0
            if n < skip:
                raise _Diverged(
                    f"its source now ends before piece {skip:,} of the partial token file"
                )
            if pending is not None:
                flush(fh, pending)
            if batch and done_at_cap is None:
                flush(fh, (pool.submit(tok.encode_pieces, batch), mark(n, reader.total)))
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        prog.close()
    stats.documents = reader.documents
    stats.empty = reader.empty
    stats.tokens = written
    stats.bytes_used = done_at_cap if done_at_cap is not None else reader.total
    return "sha256:" + h.hexdigest(), stats


# A token file's name says its width when it ends in one of these (the run's own data/<arm>.u16
# and .u32, nanoGPT's habit of .bin carries no width and falls back to the vocabulary's).
SUFFIX_DTYPES = {".u16": "uint16", ".uint16": "uint16", ".u32": "uint32", ".uint32": "uint32"}


def token_dtype(arm: ArmSpec, tok: RunTokenizer, files: list[Path]) -> np.dtype:
    """The dtype of a `tokens` arm's file(s) `files`: given (`:u16`/`:u32`), else said by the
    files' suffix (`.u16`/`.u32`, see SUFFIX_DTYPES), else inferred from the vocabulary (uint16
    up to 65,536 tokens, else uint32; docs/data.md).

    Raises ArmSourceError when the files' suffixes disagree with each other or with a dtype
    given: a .u32 file read as uint16 would train on every id followed by a zero, with every id
    inside the vocabulary, so no later check could see it."""
    said = {f: SUFFIX_DTYPES[f.suffix.lower()] for f in files if f.suffix.lower() in SUFFIX_DTYPES}
    kinds = sorted(set(said.values()))
    if len(kinds) > 1:
        one = {k: next(f for f, v in said.items() if v == k) for k in kinds}
        raise ArmSourceError(
            f"arm {arm.name}: its token files have different widths by their names "
            f"({', '.join(f'{one[k]} is {k}' for k in kinds)}); give each width its own arm"
        )
    if arm.dtype:
        given = np.dtype(arm.dtype)
        if kinds and kinds[0] != given.name:
            f = next(iter(said))
            raise ArmSourceError(
                f"arm {arm.name}: dtype {given.name} was given but {f} is named {f.suffix} "
                f"({kinds[0]}); give the dtype its name says (tokens:{arm.source}:"
                f"{'u32' if kinds[0] == 'uint32' else 'u16'}) or rename the file"
            )
        return given
    return np.dtype(kinds[0]) if kinds else np.dtype(tok.dtype)


def check_token_files(arm: ArmSpec, tok: RunTokenizer) -> tuple[list[Path], np.dtype, int]:
    """Validate a `tokens` arm without loading it: every file a whole number of tokens, every
    id below the vocabulary (scanned in chunks of SCAN_TOKENS). Returns (files, dtype, total
    tokens). Raises ArmSourceError naming the arm, the file, the value and the fix."""
    files = [f.resolve() for f in token_files(arm)]
    dt = token_dtype(arm, tok, files)
    total = 0
    for f in files:
        size = f.stat().st_size
        if size % dt.itemsize:
            raise ArmSourceError(
                f"arm {arm.name}: {f} is {size:,} bytes, not a whole number of {dt.name} tokens "
                f"({dt.itemsize} bytes each); a truncated copy, or the wrong dtype (give "
                f"tokens:{arm.source}:u16 or :u32)"
            )
        n = size // dt.itemsize
        if n:
            ids = np.memmap(f, dtype=dt, mode="r", shape=(n,))
            for i in range(0, n, SCAN_TOKENS):
                stop_request.check(f"the check of arm {arm.name}'s token file {f.name}")
                chunk = ids[i : i + SCAN_TOKENS]
                if int(chunk.max()) >= tok.vocab_size:
                    at = i + int(np.argmax(chunk >= tok.vocab_size))
                    raise ArmSourceError(
                        f"arm {arm.name}: {f} holds token id {int(ids[at])} at token {at:,} but "
                        f"the run's vocabulary has {tok.vocab_size:,} ids; tokenize it with the "
                        f"run's tokenizer.json (or check the dtype: {dt.name})"
                    )
            del ids
        total += n
    return files, dt, total


def concat_token_files(files: list[Path], dtype, tmp: Path, max_tokens: int = 0) -> int:
    """Copy `files` (already checked) end to end into `tmp` in 16 MB chunks; returns tokens."""
    itemsize, written = np.dtype(dtype).itemsize, 0
    limit = max_tokens * itemsize if max_tokens else None
    with open(tmp, "wb") as out:
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    stop_request.check(f"the copy of token file {f.name}")
                    if limit is not None:
                        chunk = chunk[: max(0, limit - written * itemsize)]
                    out.write(chunk)
                    written += len(chunk) // itemsize
        out.flush()
        os.fsync(out.fileno())
    return written
