"""One proxy per run directory (docs/architecture.md#one-proxy-per-run-directory): a `filelock`
lock on `.proxy.lock` held for the proxy's life, and `.proxy.owner.json` naming the holder (host,
pid, start time) for the refusal message. The owner of a multi-node job also keeps its owner
record beating, for filesystems that do not share the flock between hosts
(docs/architecture.md#several-nodes, "Who owns"): a live owner of another token holds the run
whatever the flock says, and of two simultaneous claims the earlier (started_at, then token)
keeps it; a record marked `released` (a clean exit) is free at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from filelock import FileLock, Timeout

from proxy.fault_injection import flock_shared
from shared.atomic_io import atomic_write_json, read_json
from shared.processes import alive
from shared.run.layout import RunLayout

log = logging.getLogger("proxy")

HEARTBEAT_S = 1.0  # a multi-node owner rewrites its owner record this often (seconds)
OWNER_STALE_S = 15.0  # an owner record on another host that did not move for this long is dead


class RunLockError(RuntimeError):
    """Another live proxy owns the run directory; the message names its host and pid.
    `owner`: the holder's `.proxy.owner.json` (None when unreadable), whose `job` says which
    multi-node job it owns (docs/architecture.md#several-nodes)."""

    def __init__(self, msg: str, owner: dict | None = None) -> None:
        super().__init__(msg)
        self.owner = owner


def _who(o: dict | None) -> str:
    try:
        assert o is not None
        return (
            f"{'proxy' if o.get('command', 'run') == 'run' else '`' + o['command'] + '`'}"
            f" pid {o['pid']} on host {o['host']} (since {time.ctime(o['started_at'])})"
        )
    except (AssertionError, KeyError, TypeError, ValueError):
        return "another proxy (owner file unreadable)"


def _token(o: dict | None) -> str | None:
    job = (o or {}).get("job")
    return job.get("token") if isinstance(job, dict) else None


def owner_alive(layout: RunLayout, o: dict, watch_s: float = OWNER_STALE_S) -> bool:
    """The multi-node owner named by owner record `o` still runs: `released` records are dead;
    on this host, its pid runs (and is not a younger process with its number); on another host,
    its heartbeat moves within `watch_s` seconds (a record older than that by this clock is dead
    at once). Blocks at most `watch_s` seconds, only for a record of another host."""
    if o.get("released"):
        return False
    if o.get("host") == socket.gethostname():
        return alive(o.get("pid"), o.get("started_at"))
    beat = o.get("heartbeat")
    if not isinstance(beat, (int, float)) or time.time() - beat > watch_s:
        return False
    end = time.monotonic() + watch_s
    while time.monotonic() < end:
        time.sleep(0.2)
        now = read_owner(layout) or {}
        if _token(now) != _token(o) or now.get("released"):
            return _token(now) is not None and owner_alive(layout, now, watch_s)
        if now.get("heartbeat") != beat:
            return True
    return False


class RunLock:
    def __init__(self, layout: RunLayout, command: str = "run", job: dict | None = None) -> None:
        """`command`: what holds the lock ("run": a proxy; "pivot": a stopped run's pivot),
        written to the owner file so `status` names the holder truly. `job`: the multi-node
        job this proxy owns (token, rdzv_id, nnodes, nproc_per_node), written to the owner file
        so the other nodes' proxies can join it as followers (proxy/supervision/nodes.py); with
        a job the owner record beats (module docstring)."""
        self.layout = layout
        self.command = command
        self.job = job
        self._lock = FileLock(str(layout.proxy_lock), timeout=0)
        self._flock = flock_shared()  # off only in a test (proxy/fault_injection.py)
        self._record: dict | None = None
        self._beating: threading.Event | None = None
        self.lost: dict | None = None  # the owner record of the claim that won over ours
        self.on_lost: Callable[[], None] | None = None  # called (beat thread) when lost is set

    def acquire(self) -> None:
        """Take the lock or raise RunLockError naming the holder (`owner`: its record). For a
        multi-node job, also when the record names another live owner (the flock may not be
        shared between hosts); then the record starts beating."""
        if self._flock:
            try:
                self._lock.acquire(timeout=0)
            except Timeout:
                o = read_owner(self.layout)
                raise RunLockError(self._refusal(_who(o)), o) from None
        if self.job is not None:
            o = read_owner(self.layout)
            if o is not None and _token(o) and owner_alive(self.layout, o):
                self.release()
                raise RunLockError(
                    self._refusal(
                        f"{_who(o)}, whose owner record beats (this filesystem does not share "
                        f"the lock between hosts)"
                    ),
                    o,
                )
        self._record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": time.time(),
            "command": self.command,
        }
        if self.job is not None:
            self._record |= {"job": self.job, "heartbeat": time.time()}
        atomic_write_json(self.layout.proxy_owner, self._record)
        if self.job is not None:
            self._start_heartbeat()

    def _refusal(self, who: str) -> str:
        return (
            f"{self.layout.root}: already owned by {who}; stop it first "
            f"(kill -TERM <pid>) or use another --run-dir"
        )

    def _start_heartbeat(self) -> None:
        self._beating = stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    self._beat()
                except OSError as e:  # a full or unreachable filesystem: say so, keep trying
                    log.warning("owner record %s: %s", self.layout.proxy_owner, e)
                if self.lost is not None:
                    return

        threading.Thread(target=beat, name="owner-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        """Rewrite our record with a new heartbeat, unless another owner's record replaced it:
        then the earlier claim of the two keeps the run (ours: rewrite; theirs: `lost`)."""
        assert self._record is not None
        now = read_owner(self.layout)
        if now is not None and _token(now) not in (None, _token(self._record)):
            theirs = (float(now.get("started_at") or 0), str(_token(now)))
            ours = (float(self._record["started_at"]), str(_token(self._record)))
            if theirs < ours and owner_alive(self.layout, now, watch_s=3 * HEARTBEAT_S):
                self.lost = now
                log.error(
                    "%s: %s claimed this run before this proxy did (the filesystem does "
                    "not share the lock between hosts): this proxy gives the run up",
                    self.layout.root,
                    _who(now),
                )
                if self.on_lost is not None:
                    self.on_lost()
                return
        self._record["heartbeat"] = time.time()
        atomic_write_json(self.layout.proxy_owner, self._record)

    def release(self) -> None:
        """Stop beating, mark our owner record `released` (still ours; read by `status` and by
        the next owner, which need not wait for it to go stale), then drop the flock."""
        if self._beating is not None:
            self._beating.set()
            self._beating = None
            now = read_owner(self.layout)
            if (
                self._record is not None
                and self.lost is None
                and _token(now) == _token(self._record)
            ):
                with contextlib.suppress(OSError):
                    atomic_write_json(self.layout.proxy_owner, {**self._record, "released": True})
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
    """`.proxy.owner.json` (host, pid, started_at, command; a multi-node owner's also job and
    heartbeat, and released once it exits), or None when it is missing or unreadable."""
    return read_json(layout.proxy_owner, garbage="default", expect=dict)


def owner_pid(layout: RunLayout) -> int | None:
    """The pid in `.proxy.owner.json`, or None when there is none."""
    try:
        return int((read_owner(layout) or {})["pid"])
    except (KeyError, TypeError, ValueError):
        return None
