"""Data sources (arms): the `--arm` option, a `tokens` arm's files and the fingerprints of an
arm's source and content (docs/architecture.md#arms, docs/data.md#sources).

What it is not: reading an arm's text (`shared/data/sources.py`; the embedded defaults,
`shared/data/embedded.py`), tokenization and batching (`shared/data/tokenization.py`,
`worker/data.py`).
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from shared.data.embedded import stat_digest, stdlib_files
from shared.data.sources import iter_text, resolve_files
from shared.run.config import ArmSourceError as ArmSourceError  # also named here
from shared.run.config import ArmSpec, ConfigError, check_arm_name

EMBEDDED_KINDS = ("python-docstrings", "python-code", "python-docs")
USER_KINDS = ("text", "jsonl", "parquet", "tokens")


TOKEN_DTYPES = {"u16": "uint16", "uint16": "uint16", "u32": "uint32", "uint32": "uint32"}


def _split_tail(source: str) -> tuple[str, str | None]:
    """`PATH:TAIL` -> (PATH, TAIL) when TAIL looks like a name (no '/', no '*'), else (source, None)."""
    head, sep, tail = source.rpartition(":")
    if sep and head and tail and "/" not in tail and "*" not in tail and "\\" not in tail:
        return head, tail
    return source, None


def parse_arm_option(text: str) -> ArmSpec:
    """Parse `--arm NAME=KIND:SOURCE[:FIELD]` (docs/data.md#sources), e.g. `notes=text:docs/*.md`,
    `chat=jsonl:data.jsonl.zst:content`, `web=parquet:shards/:text`, `gpt=tokens:train.bin:u16`,
    or `NAME=KIND` for an embedded kind (python-docstrings, python-code, python-docs:
    `repo-code=python-code` is the default arm, so a restart can keep some default arms and
    leave others out). SOURCE is a file, a directory or a glob, relative to the current
    directory; the spec holds it as an absolute path. Raises ConfigError."""
    name, sep, rest = text.partition("=")
    kind, sep2, source = rest.partition(":")
    if sep and name and kind in EMBEDDED_KINDS and not source:
        check_arm_name(name, f"--arm {text!r}")
        return ArmSpec(name=name, kind=kind)
    if not sep or not sep2 or not name or not source:
        raise ConfigError(
            f"--arm {text!r}: expected NAME=KIND:SOURCE[:FIELD] with KIND one of "
            f"{', '.join(USER_KINDS)}, or NAME=KIND with KIND one of "
            f"{', '.join(EMBEDDED_KINDS)} (the defaults)"
        )
    check_arm_name(name, f"--arm {text!r}")
    if kind not in USER_KINDS:
        raise ConfigError(f"--arm {text!r}: kind {kind!r} unknown; use {', '.join(USER_KINDS)}")
    field, dtype = "text", ""
    if kind in ("jsonl", "parquet"):
        source, tail = _split_tail(source)
        field = tail or "text"
    elif kind == "tokens":
        src, tail = _split_tail(source)
        if tail is not None and tail.lower() in TOKEN_DTYPES:
            source, dtype = src, TOKEN_DTYPES[tail.lower()]
        elif tail is not None and not Path(source).expanduser().exists():
            raise ConfigError(
                f"--arm {text!r}: token dtype {tail!r} unknown; use u16 or u32 "
                "(or leave it out: it is read from a .u16/.u32 name, else the vocabulary)"
            )
    # stored as an absolute path: a run resumed from another directory (a systemd unit's
    # WorkingDirectory=, a batch script's cd) must find the same files (docs/data.md#sources)
    source = os.path.abspath(os.path.expanduser(source))
    return ArmSpec(name=name, kind=kind, source=source, field=field, dtype=dtype)


def source_fingerprint(arm: ArmSpec) -> str:
    """A cheap fingerprint of an arm's SOURCE (not its text): sha256 over the source's file list
    with sizes and mtimes, as "stat:<hex>" (docs/architecture.md#arms).

    For the embedded defaults the files are the standard-library modules (plus the Python version
    and stdlib path); python-docs hashes `pydoc_data/topics.py`. It is computed in milliseconds
    at every start, so the proxy can notice a changed or vanished source without re-reading the
    text; a mismatch is confirmed with the content fingerprint before an arm is retired.
    Raises ArmSourceError (a ConfigError) when the source is gone or matches no file.
    """
    if arm.kind in ("python-docstrings", "python-code"):
        files = stdlib_files()
        if not files:
            raise ArmSourceError(
                f"arm {arm.name}: no standard-library sources under "
                f"{sysconfig.get_paths()['stdlib']}"
            )
        return stat_digest(files, f"{sys.version}\0{sysconfig.get_paths()['stdlib']}")
    if arm.kind == "python-docs":
        try:
            import pydoc_data.topics as t
        except ImportError as e:
            raise ArmSourceError(f"arm {arm.name}: this Python has no pydoc_data") from e
        return stat_digest([Path(t.__file__)], sys.version)
    if arm.kind in ("text", "jsonl", "parquet"):
        return stat_digest(resolve_files(arm), arm.field if arm.kind != "text" else "")
    if arm.kind == "tokens":
        return stat_digest([p.resolve() for p in token_files(arm)])
    raise ArmSourceError(f"arm {arm.name}: kind {arm.kind!r} unknown")


def token_files(arm: ArmSpec) -> list[Path]:
    """The file(s) of a `tokens` arm (a file, directory or glob). Raises ArmSourceError."""
    p = Path(arm.source).expanduser()
    if not p.is_file() and not p.is_dir() and not glob.glob(str(p)):
        raise ArmSourceError(
            f"arm {arm.name}: token file {p} not found; fix the path or remove the arm"
        )
    return resolve_files(arm)


def content_fingerprint(arm: ArmSpec) -> str:
    """The content fingerprint stored at creation ("sha256:<hex>" of the text as streamed by
    `shared/data/sources.iter_text`, or of the token file(s) concatenated). Slow (reads the whole
    source in bounded memory); used only to confirm a `source_fingerprint` mismatch.
    Raises ArmSourceError when the source is gone."""
    h = hashlib.sha256()
    if arm.kind == "tokens":
        for f in token_files(arm):
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        return "sha256:" + h.hexdigest()
    for t in iter_text(arm):  # an embedded default is one document: its whole text
        h.update(t.encode("utf-8"))
    return "sha256:" + h.hexdigest()
