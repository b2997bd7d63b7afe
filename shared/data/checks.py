"""The cheap up-front checks of arms before any work (docs/data.md#checks-before-any-work): each
arm's source exists, is not empty, and its first records or rows are what its kind says, read
at most HEAD_BYTES of each; every problem of every arm reported at once.

What it is not: reading a whole arm (shared/data/sources.py) or fingerprinting it (shared/data/arms.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from shared.data.arms import EMBEDDED_KINDS, source_fingerprint, token_files
from shared.data.sources import (
    ParquetReader,
    corrupt_error,
    is_corrupt,
    open_binary,
    resolve_files,
)
from shared.run.config import ArmSourceError, ArmSpec

HEAD_RECORDS = 100  # JSON Lines records looked at by the up-front check
HEAD_BYTES = 1 << 20  # at most this much (decompressed) read by it
BINARY_PROBE = 8000  # bytes of a single-file text arm looked at for NUL (git's rule)


def _describe(arm: ArmSpec, files: list[Path]) -> str:
    return str(files[0]) if len(files) == 1 else f"source {arm.source!r} ({len(files):,} files)"


def _check_jsonl_head(arm: ArmSpec, files: list[Path]) -> list[str]:
    """The first HEAD_RECORDS non-blank lines of a JSON Lines arm (across its files, at most
    HEAD_BYTES decompressed): they decompress, parse, and at least one has the field as text."""
    lines = parsed = with_field = 0
    first_bad, fields, seen = "", None, 0
    for f in files:
        try:
            reader, _raw = open_binary(f)
            with reader:
                for lineno, line in enumerate(reader, 1):
                    seen += len(line)
                    if not line.strip():
                        continue
                    lines += 1
                    try:
                        obj = json.loads(line)
                    except ValueError:  # UnicodeDecodeError included
                        first_bad = first_bad or f"{f}:{lineno}"
                    else:
                        parsed += 1
                        if isinstance(obj, dict):
                            if isinstance(obj.get(arm.field), str):
                                with_field += 1
                            elif fields is None:
                                fields = sorted(obj)
                    if lines >= HEAD_RECORDS or seen >= HEAD_BYTES:
                        break
        except Exception as e:
            if not is_corrupt(e):
                raise
            return [str(corrupt_error(arm, f, e))]
        if lines >= HEAD_RECORDS or seen >= HEAD_BYTES:
            break
    if not lines:
        return [
            f"arm {arm.name}: {_describe(arm, files)} holds no records; give it JSON Lines "
            "(one object per line) or remove the arm"
        ]
    if not parsed:
        return [
            f"arm {arm.name}: none of the first {lines:,} lines is JSON (first at "
            f"{first_bad}); is it JSON Lines? use kind text for plain text"
        ]
    if not with_field:
        has = (
            f"they have fields {', '.join(map(repr, fields[:12]))}"
            f"{' ...' if len(fields) > 12 else ''}"
            if fields
            else "they are not objects"
        )
        return [
            f"arm {arm.name}: none of the first {parsed:,} records has a text field "
            f"{arm.field!r} ({has}); name the text's field: "
            f"--arm {arm.name}=jsonl:{arm.source}:FIELD"
        ]
    return []


def check_arm(arm: ArmSpec) -> list[str]:
    """Cheap up-front checks of one arm (docs/data.md#checks-before-any-work), reading at most
    HEAD_BYTES of it: the source exists and matches files; it is not empty; a JSON Lines arm's
    first records decompress, parse and carry the field; every Parquet file has the column and
    they hold rows; a single-file text arm is not binary (NUL bytes in its first BINARY_PROBE
    bytes). Returns the problems as messages naming the arm, the file and the fix ([] when it is
    usable); raises nothing for a bad arm."""
    try:
        source_fingerprint(arm)  # the source exists and names files
        if arm.kind in EMBEDDED_KINDS:
            return []
        files = token_files(arm) if arm.kind == "tokens" else resolve_files(arm)
    except ArmSourceError as e:
        return [str(e)]
    except OSError as e:
        return [
            f"arm {arm.name}: source {arm.source!r} cannot be read ({e}); fix the path or "
            "its permissions, or remove the arm"
        ]
    try:
        total = sum(f.stat().st_size for f in files)
    except OSError as e:
        return [f"arm {arm.name}: {e}; fix the path or remove the arm"]
    if total == 0:
        return [
            f"arm {arm.name}: {_describe(arm, files)} is empty (0 bytes); give it data or "
            "remove the arm"
        ]
    if arm.kind == "jsonl":
        return _check_jsonl_head(arm, files)
    if arm.kind == "parquet":
        try:
            ParquetReader(arm).check()
            import pyarrow.parquet as pq

            rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        except ArmSourceError as e:
            return [str(e)]
        except Exception as e:  # noqa: BLE001 - pyarrow's own errors, named in the message
            return [
                f"arm {arm.name}: {files[0]} is not a readable Parquet file ({e}); fix or remove it"
            ]
        if not rows:
            return [
                f"arm {arm.name}: {_describe(arm, files)} holds no rows; give it data or "
                "remove the arm"
            ]
    if arm.kind == "text" and len(files) == 1:
        try:
            with open(files[0], "rb") as fh:
                head = fh.read(BINARY_PROBE)
        except OSError as e:
            return [
                f"arm {arm.name}: {files[0]} cannot be read ({e}); fix its permissions or "
                "remove the arm"
            ]
        if b"\0" in head:
            return [
                f"arm {arm.name}: {files[0]} is binary (NUL bytes in its first "
                f"{BINARY_PROBE:,} bytes), not text; for token ids use "
                f"--arm {arm.name}=tokens:{arm.source}, else remove the arm"
            ]
        if not head.strip():
            with open(files[0], "rb") as fh:
                if not any(chunk.strip() for chunk in iter(lambda: fh.read(1 << 20), b"")):
                    return [
                        f"arm {arm.name}: {files[0]} holds only whitespace; give it text "
                        "or remove the arm"
                    ]
    return []


def check_arms(arms: list[ArmSpec]) -> list[str]:
    """`check_arm` of every arm, in order: all problems at once (docs/data.md#checks-before-any-work)."""
    return [msg for a in arms for msg in check_arm(a)]
