"""The embedded default arms, built from the running Python installation's own files with
nothing downloaded (docs/architecture.md#arms):
  repo-docstrings  docstrings extracted (with `ast`) from standard-library modules
  repo-code        the source code of those modules
  python-docs      the reference documentation text that ships with Python (`pydoc_data`)
Each keeps its documented size (MAX_ARM_BYTES characters) and is deterministic for a Python
installation.

What it is not: user arms (shared/data/sources.py), fingerprints and the `--arm` option
(shared/data/arms.py). Standard library only.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from shared.atomic_io import atomic_write_bytes
from shared.run.config import ArmSourceError, ArmSpec

MAX_ARM_BYTES = 2_000_000  # the embedded defaults' documented size, characters (never user arms)


_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_files() -> list[Path]:
    """The standard library's `.py` files the embedded arms are drawn from, sorted."""
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
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, nodes))
    return [d for d in docs if d and len(d) > 20]


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
    files = stdlib_files()
    key = hashlib.sha256(f"{stat_digest(files, sys.version)}\0{limit}".encode()).hexdigest()[:24]
    cached = cache_dir() / f"python-docstrings-{key}.txt"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return cached.read_text(encoding="utf-8")
    docs = (d for f in files for d in _docstrings(f.read_text(encoding="utf-8", errors="replace")))
    text = _take(docs, limit)
    with contextlib.suppress(OSError):
        cached.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cached, text.encode("utf-8"))
    return text


def _pydoc_topics():
    """The standard library's `pydoc_data.topics` module; ArmSourceError when this Python lacks
    it."""
    try:
        import pydoc_data.topics as t
    except ImportError as e:
        raise ArmSourceError(
            "arm python-docs: this Python has no pydoc_data (reference docs); "
            "remove the arm or install a full Python"
        ) from e
    return t


def embedded_files(arm: ArmSpec) -> list[Path]:
    """The files an embedded default arm is built from (for its "of total" size)."""
    if arm.kind in ("python-docstrings", "python-code"):
        return stdlib_files()
    return [Path(_pydoc_topics().__file__)]


def stat_digest(files: list[Path], extra: str = "") -> str:
    """A cheap fingerprint of `files` ("stat:" + sha256 hex of each path, size and mtime in ns,
    after `extra`): it changes when any file is replaced or edited."""
    h = hashlib.sha256(extra.encode("utf-8"))
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return "stat:" + h.hexdigest()


def embedded_text(arm: ArmSpec, limit: int = MAX_ARM_BYTES) -> str:
    """The text of an embedded default arm, at most `limit` characters, deterministic for a
    Python installation. Raises ArmSourceError when the source is missing or yields no text."""
    if arm.kind == "python-docstrings":
        text = _python_docstrings(limit)
    elif arm.kind == "python-code":
        files = stdlib_files()
        text = _take((f.read_text(encoding="utf-8", errors="replace") for f in files), limit)
    elif arm.kind == "python-docs":
        topics = _pydoc_topics().topics
        text = _take((topics[k] for k in sorted(topics)), limit)
    else:
        raise ArmSourceError(
            f"arm {arm.name}: kind {arm.kind!r} is not an embedded default; "
            "kinds: python-docstrings, python-code, python-docs"
        )
    if not text.strip():
        raise ArmSourceError(f"arm {arm.name}: source {arm.source or arm.kind!r} gave no text")
    return text
