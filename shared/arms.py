"""Data sources (arms): read each arm's text, fingerprint it (docs/architecture.md#arms).

The embedded default needs nothing downloaded: three arms built from the running Python
installation's own files:
  repo-docstrings  docstrings extracted (with `ast`) from standard-library modules
  repo-code        the source code of those modules
  python-docs      the reference documentation text that ships with Python (`pydoc_data`)
Users add arms from text files/directories/globs, JSON Lines (a text field; .gz/.zst), Parquet
(a text column) or pre-tokenized uint16/uint32 token files (nanoGPT's format); user arms are
always read whole (the streaming readers are `shared/arm_sources.py`), the defaults keep their
documented size (DEFAULT_ARM_CHARS) and the creation log says how much of how much was used.

What it is not: tokenization and batching (`shared/arm_tokenize.py`, `worker/data.py`).
"""
from __future__ import annotations

import ast
import glob
import hashlib
import os
import sysconfig
from pathlib import Path

from shared.config import ArmSpec, ConfigError, check_arm_name

MAX_ARM_BYTES = 2_000_000  # the embedded defaults' documented size, characters (never user arms)
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}


class ArmSourceError(ConfigError):
    """An arm's source is missing or unreadable; the message names the arm and the path."""


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 20:
                docs.append(doc)
    return docs


def _take(chunks, limit: int) -> str:
    parts, total = [], 0
    for c in chunks:
        parts.append(c)
        total += len(c) + 2
        if total >= limit:
            break
    return "\n\n".join(parts)[:limit]


def cache_dir() -> Path:
    """Where derived data that is slow to rebuild is cached: $ANDREA_CACHE_DIR, else
    $XDG_CACHE_HOME/andrea, else ~/.cache/andrea."""
    env = os.environ.get("ANDREA_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "andrea"


def _python_docstrings(limit: int) -> str:
    """Docstrings of the standard library. Parsing every module takes seconds, so the text is
    cached per installation, keyed by the modules' names, sizes and mtimes (a changed stdlib
    misses the cache and is parsed again); an unwritable cache is simply skipped."""
    import sys
    files = _stdlib_files()
    key = hashlib.sha256(f"{_stat_digest(files, sys.version)}\0{limit}".encode()).hexdigest()[:24]
    cached = cache_dir() / f"python-docstrings-{key}.txt"
    try:
        return cached.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass

    def gen():
        for f in files:
            for d in _docstrings(f.read_text(encoding="utf-8", errors="replace")):
                yield d
    text = _take(gen(), limit)
    try:
        from shared.atomic_io import atomic_write_bytes
        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cached, text.encode("utf-8"))
    except OSError:
        pass
    return text


def _python_code(limit: int) -> str:
    return _take((f.read_text(encoding="utf-8", errors="replace") for f in _stdlib_files()), limit)


def _python_docs(limit: int) -> str:
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise ArmSourceError("arm python-docs: this Python has no pydoc_data (reference docs); "
                             "remove the arm or install a full Python") from e
    return _take((topics[k] for k in sorted(topics)), limit)


def _text_files(arm: ArmSpec) -> list[Path]:
    from shared.arm_sources import resolve_files
    return resolve_files(arm)


def embedded_files(arm: ArmSpec) -> list[Path]:
    """The files an embedded default arm is built from (for its "of total" size)."""
    if arm.kind in ("python-docstrings", "python-code"):
        return _stdlib_files()
    try:
        import pydoc_data.topics as t
    except ImportError as e:
        raise ArmSourceError("arm python-docs: this Python has no pydoc_data (reference docs); "
                             "remove the arm or install a full Python") from e
    return [Path(t.__file__)]


def read_arm_text(arm: ArmSpec, limit: int = MAX_ARM_BYTES) -> str:
    """The text of an embedded default arm, at most `limit` characters, deterministic for a
    Python installation (user arms are streamed whole: `shared/arm_sources.iter_text`).

    Raises ArmSourceError when the source is missing or yields no text.
    """
    if arm.kind == "python-docstrings":
        text = _python_docstrings(limit)
    elif arm.kind == "python-code":
        text = _python_code(limit)
    elif arm.kind == "python-docs":
        text = _python_docs(limit)
    elif arm.kind in ("text", "jsonl", "parquet"):
        from shared.arm_sources import iter_text
        text = "".join(iter_text(arm))  # whole; small arms and tests only
    else:
        raise ArmSourceError(f"arm {arm.name}: kind {arm.kind!r} has no text; kinds: "
                             "python-docstrings, python-code, python-docs, text, jsonl, parquet, tokens")
    if not text.strip():
        raise ArmSourceError(f"arm {arm.name}: source {arm.source or arm.kind!r} gave no text")
    return text


def fingerprint_text(text: str) -> str:
    """sha256 of the arm's UTF-8 text, as "sha256:<hex>"."""
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprint_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


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
        raise ConfigError(f"--arm {text!r}: expected NAME=KIND:SOURCE[:FIELD] with KIND one of "
                          f"{', '.join(USER_KINDS)}, or NAME=KIND with KIND one of "
                          f"{', '.join(EMBEDDED_KINDS)} (the defaults)")
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
            raise ConfigError(f"--arm {text!r}: token dtype {tail!r} unknown; use u16 or u32 "
                              "(or leave it out: it is read from a .u16/.u32 name, else the vocabulary)")
    # stored as an absolute path: a run resumed from another directory (a systemd unit's
    # WorkingDirectory=, a batch script's cd) must find the same files (docs/data.md#sources)
    source = os.path.abspath(os.path.expanduser(source))
    return ArmSpec(name=name, kind=kind, source=source, field=field, dtype=dtype)


def _stat_digest(files: list[Path], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode("utf-8"))
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return "stat:" + h.hexdigest()


def source_fingerprint(arm: ArmSpec) -> str:
    """A cheap fingerprint of an arm's SOURCE (not its text): sha256 over the source's file list
    with sizes and mtimes, as "stat:<hex>" (docs/architecture.md#arms).

    For the embedded defaults the files are the standard-library modules (plus the Python version
    and stdlib path); python-docs hashes `pydoc_data/topics.py`. It is computed in milliseconds
    at every start, so the proxy can notice a changed or vanished source without re-reading the
    text; a mismatch is confirmed with the content fingerprint before an arm is retired.
    Raises ArmSourceError (a ConfigError) when the source is gone or matches no file.
    """
    import sys
    if arm.kind in ("python-docstrings", "python-code"):
        files = _stdlib_files()
        if not files:
            raise ArmSourceError(f"arm {arm.name}: no standard-library sources under "
                                 f"{sysconfig.get_paths()['stdlib']}")
        return _stat_digest(files, f"{sys.version}\0{sysconfig.get_paths()['stdlib']}")
    if arm.kind == "python-docs":
        try:
            import pydoc_data.topics as t
        except ImportError as e:
            raise ArmSourceError(f"arm {arm.name}: this Python has no pydoc_data") from e
        return _stat_digest([Path(t.__file__)], sys.version)
    if arm.kind in ("text", "jsonl", "parquet"):
        return _stat_digest(_text_files(arm), arm.field if arm.kind != "text" else "")
    if arm.kind == "tokens":
        return _stat_digest([p.resolve() for p in token_files(arm)])
    raise ArmSourceError(f"arm {arm.name}: kind {arm.kind!r} unknown")


def token_files(arm: ArmSpec) -> list[Path]:
    """The file(s) of a `tokens` arm (a file, directory or glob). Raises ArmSourceError."""
    p = Path(arm.source).expanduser()
    if not p.is_file() and not p.is_dir() and not glob.glob(str(p)):
        raise ArmSourceError(f"arm {arm.name}: token file {p} not found; fix the path or "
                             "remove the arm")
    return _text_files(arm)


def content_fingerprint(arm: ArmSpec) -> str:
    """The content fingerprint stored at creation ("sha256:<hex>" of the text as streamed by
    `shared/arm_sources.iter_text`, or of the token file(s) concatenated). Slow (reads the whole
    source in bounded memory); used only to confirm a `source_fingerprint` mismatch.
    Raises ArmSourceError when the source is gone."""
    h = hashlib.sha256()
    if arm.kind == "tokens":
        files = token_files(arm)
        if len(files) == 1:
            return fingerprint_file(files[0].resolve())
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        return "sha256:" + h.hexdigest()
    if arm.kind in EMBEDDED_KINDS:
        return fingerprint_text(read_arm_text(arm))
    from shared.arm_sources import iter_text
    for t in iter_text(arm):
        h.update(t.encode("utf-8"))
    return "sha256:" + h.hexdigest()
