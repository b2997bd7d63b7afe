"""The job beacon at `--rdzv-endpoint` (docs/architecture.md#several-nodes, "Bad set-ups"):
catches two owners of one job that do not share a run directory. A proxy of the job on the
endpoint's host listens on that port and answers every connection with one JSON line naming
the job it serves (rdzv id, the owner's token, the run directory, host and pid); every owner
elsewhere asks it and sends its own line back.

What it is not: a rendezvous (that runs on a fresh port the owner posts,
proxy/supervision/nodes.py), or the check of two owners in ONE directory whose filesystem does
not share flock between hosts (the owner record, proxy/run_files/run_lock.py).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable


def _split(endpoint: str | None) -> tuple[str, int] | None:
    host, _, port = (endpoint or "").rpartition(":")
    host = host.strip("[]")
    return (host, int(port)) if host and port.isdigit() else None


class Beacon:
    """A listening beacon (from `serve`): `info` is what it answers (replaceable), `reports`
    the lines askers sent back (dicts, appended by its thread), `close()` stops it."""

    def __init__(self, sock: socket.socket, info: dict) -> None:
        self.sock, self.info = sock, info
        self.reports: list[dict] = []

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _loop(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c, contextlib.suppress(OSError, ValueError):
                c.settimeout(1.0)
                c.sendall((json.dumps(self.info) + "\n").encode())
                d = json.loads(_read_line(c) or b"null")
                if isinstance(d, dict):
                    self.reports.append(d)


def _read_line(c: socket.socket) -> bytes:
    """One line from `c`, at most 64 KiB (what came before EOF, if it came first)."""
    with c.makefile("rb") as f:
        return f.readline(65536)


def serve(endpoint: str | None, info: dict) -> Beacon | None:
    """Listen at `endpoint` in a daemon thread, answering each connection with `info` as one
    JSON line and keeping the line the asker sends back. None when the endpoint's host is not
    this machine or the port is taken."""
    where = _split(endpoint)
    if where is None:
        return None
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(where)
        s.listen(16)
    except OSError:
        s.close()
        return None
    b = Beacon(s, info)
    threading.Thread(target=b._loop, name="job-beacon", daemon=True).start()
    return b


def ask(endpoint: str | None, me: dict | None = None, timeout: float = 1.0) -> dict | None:
    """The job the beacon at `endpoint` serves, or None (nobody listening, or not a beacon);
    `me` (this proxy's own line) is sent back to it."""
    where = _split(endpoint)
    if where is None:
        return None
    try:
        with socket.create_connection(where, timeout=timeout) as c:
            c.settimeout(timeout)
            d = json.loads(_read_line(c))
            if me is not None:
                c.sendall((json.dumps(me) + "\n").encode())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and "token" in d else None


def two_owners(them: dict, run_dir) -> str:
    """The refusal naming both owners' run directories (`them`: the other owner's line)."""
    return (
        f"two owners of job --rdzv-id {them.get('rdzv_id')}: proxy pid {them.get('pid')} on "
        f"{them.get('host')} owns it in {them.get('run_dir')}, and this node's --run-dir "
        f"{run_dir} is another directory (neither holds the other's node record): give every "
        f"node the same --run-dir on the filesystem they share"
    )


def second_owner(
    endpoint: str | None,
    me: dict,
    run_dir,
    same_dir: Callable[[str], bool] = lambda token: False,
) -> tuple[str | None, bool]:
    """Ask the beacon at `endpoint` as the owner `me` (rdzv_id, token, run_dir, host, pid) of
    a job in `run_dir`. Returns (why this proxy is a second owner, a sentence naming both run
    directories, or None; whether a beacon answered at all). Not a second owner: the beacon
    serves this job's token, another job id, or a token whose records `same_dir(token)` finds
    in this run directory (two owners of one directory: the owner record decides)."""
    d = ask(endpoint, me)
    if d is None:
        return None, False
    if d.get("rdzv_id") != me.get("rdzv_id") or d.get("token") == me.get("token"):
        return None, True
    if same_dir(str(d.get("token"))):
        return None, True
    return two_owners(d, run_dir), True
