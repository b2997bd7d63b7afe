"""Reading `/proc/PID/stat`: the one parser of a process's state, parent, group and start time.

What it is: `read_stat(pid)` -> `ProcStat` (or None when the process is gone), `process_state`,
and `all_pids`, for the proxy's process-tree duties, `status`, the worker's parent watch and the
tests. The command name (field 2) may itself contain spaces and parentheses, so the fields are
split after the LAST ")" (proc(5)).
What it is not: signalling or waiting (proxy/supervision/proc_tree.py). Linux only; standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ProcStat", "read_stat", "process_state", "all_pids", "seconds_since_start"]


@dataclass(frozen=True)
class ProcStat:
    """The fields of `/proc/PID/stat` this project uses (proc(5) numbering in brackets).

    state: one letter [3]: R running, S sleeping, D uninterruptible I/O, T stopped, t traced,
    Z zombie, X dead, I idle. ppid [4], pgrp [5] (process group), session [6]: pids.
    start_ticks [22]: start time after boot, in clock ticks (os.sysconf("SC_CLK_TCK") per s).
    """

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    start_ticks: int


def read_stat(pid: int) -> ProcStat | None:
    """`/proc/<pid>/stat` parsed, or None when the process does not exist (or the file cannot
    be read or parsed: it vanished mid-read). Never raises for a bad or gone pid."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read().decode("utf-8", errors="replace")
        head, _, tail = raw.rpartition(")")
        fields = tail.split()
        return ProcStat(
            pid=int(pid),
            comm=head.partition("(")[2],
            state=fields[0],
            ppid=int(fields[1]),
            pgrp=int(fields[2]),
            session=int(fields[3]),
            start_ticks=int(fields[19]),
        )
    except (OSError, IndexError, ValueError, TypeError):
        return None


def process_state(pid: int) -> str | None:
    """The one-letter state of `pid` (see ProcStat), or None when it does not exist."""
    st = read_stat(pid)
    return None if st is None else st.state


def all_pids() -> list[int]:
    """Every pid listed in /proc now, ascending (processes may exit while you read them)."""
    return sorted(int(d) for d in os.listdir("/proc") if d.isdigit())


def seconds_since_start(pid: int | None = None) -> float | None:
    """Seconds since process `pid` (default: this one) started: /proc/uptime minus its start
    time in clock ticks after boot (proc(5)), what a start-up log line reports as "since
    launch". Resolution: one tick (10 ms). None where /proc cannot say."""
    st = read_stat(os.getpid() if pid is None else pid)
    if st is None:
        return None
    try:
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return uptime - st.start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
