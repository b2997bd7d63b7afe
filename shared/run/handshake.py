"""The proxy <-> worker handshake (docs/handshake.md): two files in the run directory.

What it is: `.handshake.json`, read-modify-written under `.handshake.lock` and replaced atomically
(docs/handshake.md#the-handshake-file): the proxy posts policies and control requests, the worker
announces itself; and `.reports.jsonl`, the worker's append-only reports, of which the proxy
reads complete lines only (docs/handshake.md#reports). Policy periods and their lag:
docs/handshake.md#policy-periods-and-the-lag. What it is not: what either side does with them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from typing import Callable

from filelock import FileLock, Timeout

from shared.atomic_io import atomic_write_json, named, read_json
from shared.json_safe import jsonable
from shared.run.layout import RunLayout

PROTOCOL = 1
LOCK_TIMEOUT_S = 10.0


class HandshakeError(RuntimeError):
    """The handshake file could not be locked or read; the message names the file."""


def policy_period(step: int, period: int) -> int:
    """The policy period of update `step` (1-based): (step - 1) // period."""
    return (step - 1) // period


def control_stops_at(control: dict, step: int, checkpoint_every: int) -> bool:
    """Whether the control request `control` stops the worker at update `step` (1-based):
    `stop_at_step` = S stops at the first update >= S, except that reason "pivot" without "now"
    stops only at a multiple of `checkpoint_every` (docs/pivots.md#the-boundary). Pure; raises
    nothing."""
    at = control.get("stop_at_step")
    if at is None or step < at:
        return False
    return (
        control.get("reason") != "pivot" or bool(control.get("now")) or step % checkpoint_every == 0
    )


def _empty() -> dict:
    return {
        "protocol": PROTOCOL,
        "worker": None,
        "policies": {},
        "control": {"stop_at_step": None, "checkpoint_at_step": None, "reason": None},
    }


def read_handshake(layout: RunLayout) -> dict:
    """The current handshake, or an empty one if missing or unreadable (never raises on garbage:
    both sides rewrite their sections)."""
    try:
        d = read_json(layout.handshake, expect=dict)
        return d if d is not None and d.get("protocol") == PROTOCOL else _empty()
    except ValueError:
        return _empty()


def update_handshake(
    layout: RunLayout, change: Callable[[dict], None], timeout: float = LOCK_TIMEOUT_S
) -> dict:
    """Lock, read, apply `change(d)` in place, write atomically, unlock. Returns the new dict.

    Raises HandshakeError if the lock is not acquired within `timeout` seconds."""
    try:
        with FileLock(str(layout.handshake_lock), timeout=timeout):
            d = read_handshake(layout)
            change(d)
            atomic_write_json(layout.handshake, d, durable=False)  # reset at every start
            return d
    except Timeout:
        raise HandshakeError(
            f"{layout.handshake_lock}: not acquired in {timeout:.0f} s; "
            "another process holds it (a stuck proxy or worker?)"
        ) from None


def reset_handshake(layout: RunLayout) -> None:
    """Start a worker incarnation from a clean slate: empty handshake, no reports."""

    def empty(d: dict) -> None:
        d.clear()
        d.update(_empty())

    update_handshake(layout, empty)
    layout.reports.unlink(missing_ok=True)


# The proxy empties `.reports.jsonl` once it has consumed at least this many bytes and nothing
# unread is left, so the file stays bounded over a run of any length.
REPORTS_COMPACT_BYTES = 4 << 20


class ReportWriter:
    """Worker side: append one JSON line per report with a single O_APPEND write, under an
    exclusive flock of the file so the proxy's compaction never falls between two writes."""

    def __init__(self, layout: RunLayout) -> None:
        self.path = layout.reports
        self.fd = os.open(layout.reports, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, report: dict) -> None:
        line = json.dumps(jsonable(report), separators=(",", ":"), allow_nan=False) + "\n"
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            os.write(self.fd, line.encode("utf-8"))
        except OSError as e:
            raise named(e, self.path) from e
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


class ReportReader:
    """Proxy side: yields complete report lines appended since the last call.

    Bounded file: when a call finds that at least `compact_bytes` were consumed by earlier
    calls (whose reports the caller has handled) and nothing new was appended, it truncates the
    file to zero under the writer's flock and starts again at offset 0. Nothing unread is ever
    dropped, so a salvage after a proxy crash (proxy/supervision/report_salvage.py) still finds every
    unfiled report."""

    def __init__(self, layout: RunLayout, compact_bytes: int = REPORTS_COMPACT_BYTES) -> None:
        self.path = layout.reports
        self.offset = 0
        self.compact_bytes = compact_bytes
        self._partial = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb+" if self.offset >= self.compact_bytes else "rb") as f:
                if self.offset >= self.compact_bytes:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
                    try:
                        if os.fstat(f.fileno()).st_size == self.offset and not self._partial:
                            f.truncate(0)
                            self.offset = 0
                    finally:
                        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):  # a blank line, or one torn by a killed writer
                out.append(json.loads(line))
        return out
