"""One proxy per run directory (docs/architecture.md#one-proxy-per-run-directory): a `filelock`
lock held for the proxy's life.

The lock is an advisory flock on `.proxy.lock`: the kernel releases it when the holder dies, so a
lock left by a dead process never blocks, and its descriptor is close-on-exec, so the worker never
inherits it. `.proxy.owner.json` names the holder (host, pid, start time) for the refusal message.
"""

from __future__ import annotations

import json
import os
import socket
import time

from filelock import FileLock, Timeout

from proxy.run_files.json_file import read_json
from shared.atomic_io import atomic_write_json
from shared.run_layout import RunLayout


class RunLockError(RuntimeError):
    """Another live proxy owns the run directory; the message names its host and pid.
    `owner`: the holder's `.proxy.owner.json` (None when unreadable), whose `job` says which
    multi-node job it owns (docs/architecture.md#several-nodes)."""

    def __init__(self, msg: str, owner: dict | None = None) -> None:
        super().__init__(msg)
        self.owner = owner


class RunLock:
    def __init__(self, layout: RunLayout, command: str = "run", job: dict | None = None) -> None:
        """`command`: what holds the lock ("run": a proxy; "pivot": a stopped run's pivot),
        written to the owner file so `status` names the holder truly. `job`: the multi-node
        job this proxy owns (token, rdzv_id, nnodes, nproc_per_node), written to the owner file
        so the other nodes' proxies can join it as followers (proxy/supervision/nodes.py)."""
        self.layout = layout
        self.command = command
        self.job = job
        self._lock = FileLock(str(layout.proxy_lock), timeout=0)

    def acquire(self) -> None:
        """Take the lock or raise RunLockError naming the holder."""
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            o = None
            try:
                o = json.loads(self.layout.proxy_owner.read_text())
                who = (
                    f"{'proxy' if o.get('command', 'run') == 'run' else '`' + o['command'] + '`'}"
                    f" pid {o['pid']} on host {o['host']} (since {time.ctime(o['started_at'])})"
                )
            except (OSError, ValueError, KeyError):
                who = "another proxy (owner file unreadable)"
            raise RunLockError(
                f"{self.layout.root}: already owned by {who}; stop it first "
                f"(kill -TERM <pid>) or use another --run-dir",
                o if isinstance(o, dict) else None,
            ) from None
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": time.time(),
            "command": self.command,
        }
        if self.job is not None:
            owner["job"] = self.job
        atomic_write_json(self.layout.proxy_owner, owner)

    def release(self) -> None:
        if self._lock.is_locked:
            self._lock.release()


def lock_is_free(layout: RunLayout) -> bool:
    """True when no proxy holds the run lock (tried and released at once)."""
    lock = FileLock(str(layout.proxy_lock), timeout=0)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    lock.release()
    return True


def read_owner(layout: RunLayout) -> dict | None:
    """`.proxy.owner.json` (host, pid, started_at, command), or None when it is missing or
    unreadable (the holder may be replacing it)."""
    d = read_json(layout.proxy_owner, None)
    return d if isinstance(d, dict) else None


def owner_pid(layout: RunLayout) -> int | None:
    """The pid in `.proxy.owner.json`, or None when there is none."""
    try:
        return int((read_owner(layout) or {})["pid"])
    except (KeyError, TypeError, ValueError):
        return None
