"""Streaming readers of arm sources (docs/data.md#sources): text, JSON Lines (plain, .gz, .zst),
Parquet and the embedded defaults, as a sequence of text pieces read in bounded chunks.

Every reader yields `Piece`s; `done` counts the source bytes consumed (compressed bytes for
.gz/.zst, file bytes for Parquet) against `total` (the files' sizes on disk), the units of the
progress bar and the "used X of Y" log line. A document is one text file, one JSON Lines record
or one Parquet row; documents are joined with SEPARATOR (docs/data.md#the-token-stream). Bad
records are counted in `reader.bad` (`BadRecords`); they never abort the read.

What it is not: tokenization (`shared/data/tokenization.py`), pre-tokenized `tokens` arms (read
directly as memory maps there), or the cheap checks of an arm before any work
(`shared/data/checks.py`).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from shared.data.embedded import embedded_files, embedded_text
from shared.run.config import ArmSourceError, ArmSpec

SEPARATOR = "\n\n"  # between documents of an arm (not after the last)
READ_CHUNK = 1 << 20  # bytes read per step from a text file
PARQUET_BATCH = 1024  # rows per Parquet record batch
_COMPRESSED = (".gz", ".zst", ".zstd")


@dataclass
class Piece:
    text: str  # a piece of one document (never empty)
    new_doc: bool  # the first piece of a document
    done: int  # source bytes consumed so far


@dataclass
class BadRecords:
    """Records skipped while reading an arm: how many, why (first reason) and where (first)."""

    count: int = 0
    first: str = ""  # "file:line: reason"
    by_reason: dict = field(default_factory=dict)
    hint: str = ""  # what the first record missing its field had instead (the likely fix)

    replaced: int = 0  # undecodable bytes of text files, replaced by U+FFFD (kept, not skipped)
    replaced_first: str = ""

    def add(self, where: str, reason: str) -> None:
        self.count += 1
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1
        if not self.first:
            self.first = f"{where}: {reason}"

    def add_replaced(self, where: str, nbytes: int) -> None:
        """`nbytes` undecodable bytes at `where` ("file:line") became U+FFFD in the text."""
        self.replaced += nbytes
        if not self.replaced_first:
            self.replaced_first = where

    def summary(self) -> str:
        parts = []
        if self.count:
            kinds = ", ".join(f"{n} {r}" for r, n in sorted(self.by_reason.items()))
            parts.append(f"{self.count:,} bad records skipped ({kinds}; first at {self.first})")
        if self.replaced:
            parts.append(
                f"{self.replaced:,} undecodable bytes replaced by U+FFFD (first at "
                f"{self.replaced_first}; a binary file in a text arm?)"
            )
        return "; ".join(parts) or "no bad records"


def resolve_files(arm: ArmSpec) -> list[Path]:
    """The files of a PATH, DIR (recursive, sorted, hidden files skipped) or GLOB source.

    Raises ArmSourceError naming the arm and the source when nothing matches, or an empty file
    list results."""
    p = Path(arm.source).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = _dir_files(p)
        if not files:
            raise ArmSourceError(
                f"arm {arm.name}: directory {p} holds no file; "
                "put the arm's files there or remove the arm"
            )
        return files
    matches = [Path(x) for x in glob.glob(str(p), recursive=True)]
    # a matched directory stands for its files, as a directory named alone does
    files = sorted(
        {f for m in matches for f in ([m] if m.is_file() else _dir_files(m) if m.is_dir() else [])}
    )
    if not files:
        what = (
            f"matches only directories with no file ({', '.join(map(str, sorted(matches)[:3]))})"
            if matches
            else "matches no file"
        )
        raise ArmSourceError(
            f"arm {arm.name}: source {arm.source!r} {what}; fix the path or remove the arm"
        )
    return files


def _dir_files(p: Path) -> list[Path]:
    """The files under directory `p`, recursive and sorted, hidden files and folders skipped."""
    return sorted(
        q
        for q in p.rglob("*")
        if q.is_file() and not any(part.startswith(".") for part in q.relative_to(p).parts)
    )


def open_binary(path: Path):
    """A binary reader of `path`, decompressing .gz and .zst; returns (reader, raw file)."""
    raw = open(path, "rb")
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if name.endswith((".zst", ".zstd")):
        return io.BufferedReader(ZstdFrames(raw), 1 << 20), raw
    return raw, raw


class ZstdFrames(io.RawIOBase):
    """A streaming reader of every zstd frame of a binary file that raises EOFError when the
    file ends inside a frame. zstandard's `stream_reader` returns end-of-file there, so a
    truncated .zst read as a shorter arm without a word; gzip raises, and so does this."""

    def __init__(self, raw, chunk: int = 1 << 20) -> None:
        import zstandard

        self._raw, self._chunk, self._zstd = raw, chunk, zstandard
        self._dobj: Any = None  # the current frame's zstandard decompressobj
        self._fed, self._buf = False, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            data = self._raw.read(self._chunk)
            if not data:
                if self._dobj is not None and self._fed and not self._dobj.eof:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            self._buf = self._feed(data)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._dobj is None or self._dobj.eof:
                self._dobj, self._fed = self._zstd.ZstdDecompressor().decompressobj(), False
            out.append(self._dobj.decompress(data))
            self._fed = True
            data = self._dobj.unused_data if self._dobj.eof else b""
        return b"".join(out)


def is_corrupt(e: Exception) -> bool:
    """Whether a read failed on the file's bytes (OSError, EOFError, zlib.error or zstandard's
    ZstdError): a corrupt or truncated file, named by `corrupt_error`."""
    return isinstance(e, (OSError, EOFError, zlib.error)) or (
        type(e).__module__.startswith("zstandard") or "Zstd" in type(e).__name__
    )


def corrupt_error(arm: ArmSpec, path: Path, e: Exception) -> ArmSourceError:
    return ArmSourceError(
        f"arm {arm.name}: {path} is corrupt or truncated ({type(e).__name__}: "
        f"{e}); re-download or recompress it, or remove it from the arm"
    )


class ArmReader:
    """Base: `files`, `total` (bytes on disk), `bad`, `documents`, `empty` (documents with no
    text: an empty file, record or row; skipped, they add no separator, and counted so the
    creation log says so), iterate with `pieces()` once `check()` passed (`open_arm`)."""

    _resolve = staticmethod(resolve_files)  # the arm's files

    def __init__(self, arm: ArmSpec) -> None:
        self.arm = arm
        self.bad = BadRecords()
        self.documents = 0
        self.empty = 0
        self.files = self._resolve(arm)
        self.total = sum(f.stat().st_size for f in self.files)

    def check(self) -> None:
        """Cheap up-front checks (before anything is written); raises ArmSourceError."""

    def pieces(self) -> Iterator[Piece]:
        raise NotImplementedError


class TextReader(ArmReader):
    """Each file is a document, read in READ_CHUNK bytes cut at a line end (or a UTF-8
    character boundary); undecodable bytes become U+FFFD and are counted (`bad.replaced`)."""

    def pieces(self) -> Iterator[Piece]:
        base = 0
        for f in self.files:
            with open(f, "rb") as fh:
                first, line, carry = True, 1, b""
                while True:
                    buf = fh.read(READ_CHUNK)
                    data = carry + buf
                    if not data:
                        self.empty += first  # a file with no bytes at all
                        break
                    if buf:
                        cut = data.rfind(b"\n") + 1
                        if cut == 0:
                            cut = len(data)
                            while (
                                cut > 0 and len(data) - cut < 4 and (data[cut - 1] & 0xC0) == 0x80
                            ):
                                cut -= 1
                            if cut > 0 and data[cut - 1] >= 0xC0:
                                cut -= 1
                            cut = cut or len(data)
                        data, carry = data[:cut], data[cut:]
                    else:
                        carry = b""
                    try:
                        text = data.decode("utf-8")
                    except UnicodeDecodeError as e:
                        bad_line = line + data[: e.start].count(b"\n")
                        valid = data.decode("utf-8", errors="ignore").encode("utf-8")
                        self.bad.add_replaced(f"{f}:{bad_line}", len(data) - len(valid))
                        text = data.decode("utf-8", errors="replace")
                    line += data.count(b"\n")
                    self.documents += first
                    if text:
                        yield Piece(text, first, base + fh.tell() - len(carry))
                        first = False
                    if not buf:
                        break
            base += f.stat().st_size


class JsonlReader(ArmReader):
    """One record per line; the text is `obj[field]`. Plain, .gz or .zst files."""

    def pieces(self) -> Iterator[Piece]:
        base, key = 0, self.arm.field
        for f in self.files:
            reader, raw = open_binary(f)
            try:
                with reader:
                    for lineno, line in enumerate(reader, 1):
                        if not line.strip():
                            continue
                        where = f"{f}:{lineno}"
                        try:
                            obj = json.loads(line)
                        except UnicodeDecodeError:
                            self.bad.add(where, "undecodable bytes")
                            continue
                        except ValueError:
                            self.bad.add(where, "invalid JSON")
                            continue
                        if not isinstance(obj, dict) or key not in obj:
                            self.bad.add(where, f"no field {key!r}")
                            if isinstance(obj, dict) and not self.bad.hint:
                                names = sorted(obj)
                                self.bad.hint = (
                                    f"the records have fields {', '.join(map(repr, names[:12]))}"
                                    f"{' ...' if len(names) > 12 else ''}; name the text's "
                                    f"field: {self.arm.name}=jsonl:{self.arm.source}:FIELD"
                                )
                            continue
                        text = obj[key]
                        if not isinstance(text, str):
                            self.bad.add(where, f"field {key!r} is not text")
                            continue
                        if not text:
                            self.empty += 1
                            continue
                        self.documents += 1
                        yield Piece(text, True, base + raw.tell())
            except Exception as e:
                if not is_corrupt(e):
                    raise
                raise corrupt_error(self.arm, f, e) from e
            base += f.stat().st_size


class ParquetReader(ArmReader):
    """One row per document from column `field` (default "text"), by record batch."""

    def check(self) -> None:
        import pyarrow.parquet as pq

        for f in self.files:
            try:
                schema = pq.read_schema(f)
            except Exception as e:
                raise ArmSourceError(
                    f"arm {self.arm.name}: {f} is not a readable Parquet file "
                    f"({e}); fix or remove it"
                ) from e
            if self.arm.field not in schema.names:
                raise ArmSourceError(
                    f"arm {self.arm.name}: {f} has no column {self.arm.field!r} (columns: "
                    f"{', '.join(schema.names)}); name the text column as "
                    f"--arm {self.arm.name}=parquet:{self.arm.source}:COLUMN"
                )

    def pieces(self) -> Iterator[Piece]:
        import pyarrow.parquet as pq

        base = 0
        for f in self.files:
            size = f.stat().st_size
            pf = pq.ParquetFile(f)
            n_rows, row = max(1, pf.metadata.num_rows), 0
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=[self.arm.field]):
                for v in batch.column(0).to_pylist():
                    row += 1
                    if not isinstance(v, str):
                        self.bad.add(f"{f}:row {row}", f"column {self.arm.field!r} is not text")
                        continue
                    if not v:
                        self.empty += 1
                        continue
                    self.documents += 1
                    yield Piece(v, True, base + size * row // n_rows)
            base += size


class EmbeddedReader(ArmReader):
    """The embedded defaults: their documented size (MAX_ARM_BYTES characters, built by
    `shared/data/embedded.py`), as one document; `total` is the size of the files read from."""

    _resolve = staticmethod(embedded_files)

    def pieces(self) -> Iterator[Piece]:
        text = embedded_text(self.arm)  # MAX_ARM_BYTES characters
        self.documents = 1
        yield Piece(text, True, self.total)


READERS = {
    "text": TextReader,
    "jsonl": JsonlReader,
    "parquet": ParquetReader,
    "python-docstrings": EmbeddedReader,
    "python-code": EmbeddedReader,
    "python-docs": EmbeddedReader,
}


def open_arm(arm: ArmSpec) -> ArmReader:
    """The reader of a text-bearing arm; runs its up-front checks. Raises ArmSourceError."""
    cls = READERS.get(arm.kind)
    if cls is None:
        raise ArmSourceError(f"arm {arm.name}: kind {arm.kind!r} has no text")
    r = cls(arm)
    r.check()
    return r


def iter_text(arm: ArmSpec) -> Iterator[str]:
    """The arm's whole text as consecutive strings (documents joined by SEPARATOR), streamed:
    the content fingerprint hashes exactly this (docs/data.md#the-token-stream)."""
    first = True
    for p in open_arm(arm).pieces():
        if p.new_doc and not first:
            yield SEPARATOR
        first = False
        yield p.text


def sample_text(arm: ArmSpec, budget: int, piece: int = 1 << 16) -> list[str]:
    """A deterministic sample of about `budget` characters spread over the whole arm, for BPE
    training (docs/data.md#the-tokenizer): the whole text when it fits, else `budget // piece`
    runs of `piece` characters taken where the source position crosses evenly spaced marks.

    The budget counts characters of text whatever the source's encoding: a compressed
    (.gz/.zst) or Parquet source's size on disk says nothing of its text's length (1.37 MB of
    .zst held 5.96 MB of text), so such an arm is taken whole only when its text, read up to the
    budget, ends within it; else it is sampled by marks like any other. A plain file's bytes are
    at least its characters, so one whose size fits is whole. One streaming pass (two for a
    large compressed arm: the first stops at the budget); memory is bounded by `budget`. Raises
    ArmSourceError."""
    r = open_arm(arm)
    whole = isinstance(r, EmbeddedReader)  # the defaults are bounded already
    packed = isinstance(r, ParquetReader) or any(
        f.name.lower().endswith(_COMPRESSED) for f in r.files
    )
    if whole or packed or r.total <= budget:
        parts, n = [], 0
        for t in iter_text(arm):
            parts.append(t)
            n += len(t)
            if n > budget and not whole:
                break
        else:
            return ["".join(parts)] if parts else []
        del parts
        r = open_arm(arm)  # over the budget: sampled by marks from a fresh reader
    piece = max(1, min(piece, budget))
    n = max(1, budget // piece)
    marks = [r.total * j // n for j in range(n)]
    out: list[str] = []
    cur: list[str] = []
    j = need = prev = 0
    for p in r.pieces():
        text, at = p.text, 0
        if need:  # a run that began in an earlier piece
            cur.append(text[:need])
            at = min(len(text), need)
            need -= at
            if need == 0:
                out.append("".join(cur))
                cur = []
        span = max(1, p.done - prev)
        while not need and j < n and marks[j] < p.done:
            # the mark's place inside this piece, by source bytes (pieces are contiguous)
            off = max(at, min(len(text), (marks[j] - prev) * len(text) // span))
            j += 1
            take = text[off : off + piece]
            at = off + len(take)
            if len(take) < piece:
                cur, need = [take], piece - len(take)
            else:
                out.append(take)
        prev = p.done
        if j >= n and not need:
            break
    if cur:
        out.append("".join(cur))
    return out
