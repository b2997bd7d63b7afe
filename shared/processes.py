"""Whether a process runs, and what it is: the project's one answer, from psutil.

What it is: `process_state`, `alive`, `group_members` and `seconds_since_start`, for the
proxy's process-tree duties, the run lock, `status`, the worker's parent watch and the tests.
What it is not: signalling or waiting (proxy/supervision/proc_tree.py).
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil

# psutil's status names as proc(5)'s one-letter states: R running, S sleeping, D uninterruptible
# I/O, T stopped, t traced, Z zombie, X dead, I idle
_LETTER = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_IDLE: "I",
}
START_SLACK_S = 5.0  # a process named by a record may have started this much after its stamp


def _process(pid) -> psutil.Process | None:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def process_state(pid) -> str | None:
    """The one-letter state of `pid` (R, S, D, T, t, Z, X, I; another of psutil's names as it
    is), or None when it does not exist or `pid` is not a positive int. Never raises."""
    p = _process(pid)
    try:
        status = None if p is None else p.status()
    except psutil.Error:
        return None
    return _LETTER.get(status, status)


def alive(pid, started_by: float | None = None) -> bool:
    """True when `pid` exists and has not exited (a zombie or dead process has: only its status
    is left); with `started_by` (seconds since the epoch, when a record of it was written), also
    when it started no later than START_SLACK_S after that, so a younger process that reuses
    the pid of a dead one is not taken for it. Never raises."""
    p = _process(pid)
    try:
        if p is None or p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False
        return started_by is None or p.create_time() <= float(started_by) + START_SLACK_S
    except (psutil.Error, TypeError, ValueError):
        return False


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is `pgid`, ascending (processes may exit while they are read)."""
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(p.pid) == pgid:
                out.append(p.pid)
    return sorted(out)


def seconds_since_start(pid: int | None = None) -> float | None:
    """Seconds since process `pid` (default: this one) started, what a start-up log line reports
    as "since launch" (resolution: one clock tick, 10 ms). None when it cannot be told."""
    try:
        return time.time() - psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None
