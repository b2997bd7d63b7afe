"""Several nodes, one run (docs/architecture.md#several-nodes): the owner/follower split and the
files that carry it, all under `DIR/.nodes/` on the run directory's shared filesystem.

    .nodes/job.json            owner: the job (token, nnodes, nproc per node) and the current
                               incarnation: its number, state ("launch", "ended", "done"),
                               the static rendezvous' address and port, the worker's arguments
    .nodes/<host>-<pid>.json   every node's proxy: node rank, role, token of the job it
                               joined, its agent's pid, its ranks' pids, the incarnation it
                               runs, its agent's exit code, a stop request, a heartbeat
    .nodes/.lock               filelock around the node-rank counter

The owner is node rank 0 of a static rendezvous (why: the docs' section above); followers take
node ranks 1..N-1 from the counter here.

What it is not: the supervision of the owner's incarnations (proxy/supervision/supervisor.py) or
the follower's loop (proxy/supervision/follower.py); the launch argv is built in
proxy/supervision/launch.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from filelock import FileLock

from proxy.supervision.launch import local_ranks
from shared.atomic_io import atomic_write_json, read_json
from shared.processes import alive
from shared.run.layout import RunLayout

log = logging.getLogger("proxy")

HEARTBEAT_S = 1.0  # every node's proxy rewrites its record this often (seconds)
NODE_STALE_S = 15.0  # a record on another host older than this is a lost node (seconds)


class NodeSetupError(RuntimeError):
    """A multi-node set-up that cannot work (mismatched --nnodes, too many nodes, a rendezvous
    that never completes); the message names the values and the fix. Exit 2 when raised before
    anything was written."""


def read_job(layout: RunLayout) -> dict | None:
    """The owner's job.json, or None before the owner wrote it."""
    return read_json(layout.nodes_job, garbage="default", expect=dict)


def write_job(layout: RunLayout, job: dict) -> None:
    layout.nodes.mkdir(exist_ok=True)
    atomic_write_json(layout.nodes_job, job)


def read_node_record(layout: RunLayout, host: str, pid: int) -> dict | None:
    """The node record of the proxy `pid` on `host`, or None when it is missing or unreadable."""
    return read_json(layout.node_record(host, pid), garbage="default", expect=dict)


def record_alive(rec: dict) -> bool:
    """A node record's proxy is alive: on this host, its pid exists; on another host, its
    heartbeat is younger than NODE_STALE_S seconds."""
    if rec.get("left"):
        return False
    if rec.get("host") == socket.gethostname():
        return alive(rec.get("pid"))
    return time.time() - float(rec.get("heartbeat") or 0) < NODE_STALE_S


def node_records(layout: RunLayout) -> list[dict]:
    """Every node record in `.nodes/` (live or not), sorted by node rank."""
    out = [
        {**rec, "file": p.name}
        for p in sorted(layout.nodes.glob("*.json"))  # none when .nodes/ does not exist
        if p.name != layout.nodes_job.name
        and (rec := read_json(p, garbage="default", expect=dict)) is not None
    ]
    return sorted(out, key=lambda r: (r.get("node_rank") is None, r.get("node_rank") or 0))


@dataclass
class NodeRecord:
    """This proxy's own record `.nodes/<host>-<pid>.json`, the one file a follower writes."""

    layout: RunLayout
    role: str  # "owner" | "follower"
    node_rank: int
    token: str  # the job (owner proxy's life) this node belongs to
    nproc_per_node: int

    def __post_init__(self) -> None:
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.path = self.layout.node_record(self.host, self.pid)
        self.fields: dict = {
            "joined_at": time.time(),  # who keeps a node rank two followers took at once
            "agent_pid": None,
            "ranks": [],
            "incarnation": None,
            "agent_exit": None,
            "stop_request": None,
        }
        self._t = self._ranks_t = 0.0
        self._lock = threading.Lock()
        self._beating: threading.Event | None = None

    def write(self, **changes) -> None:
        """Update fields and rewrite the record now (atomic; readers never see half of it)."""
        with self._lock:
            self.fields.update(changes)
            self.layout.nodes.mkdir(exist_ok=True)
            atomic_write_json(
                self.path,
                {
                    "host": self.host,
                    "pid": self.pid,
                    "role": self.role,
                    "node_rank": self.node_rank,
                    "token": self.token,
                    "nproc_per_node": self.nproc_per_node,
                    "heartbeat": time.time(),
                    **self.fields,
                },
            )
            self._t = time.monotonic()

    @property
    def ranks(self) -> list[int]:
        """This node's ranks' pids as the record holds them (pids mean nothing elsewhere)."""
        return self.fields["ranks"]

    def refresh_ranks(self, agent_pid: int | None, every: float = 0.5) -> list[int]:
        """This node's ranks below the torchrun agent `agent_pid` (launch.local_ranks), looked
        up at most every `every` seconds and written into the record when they changed."""
        if agent_pid is not None and time.monotonic() - self._ranks_t > every:
            self._ranks_t = time.monotonic()
            ranks = local_ranks(agent_pid, str(self.layout.root))
            if ranks != self.ranks:
                self.write(ranks=ranks)
        return self.ranks

    def start_heartbeat(self) -> None:
        """Rewrite the record every HEARTBEAT_S from a daemon thread, so that the other hosts
        see this proxy alive also while its main thread is busy for long (creating the run,
        replaying the history, a restart's back-off). Stopped by leave()."""
        if self._beating is not None:
            return
        self._beating = stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    if self.role == "follower" and self.fields.get("incarnation") is None:
                        self._yield_taken_rank()
                    if time.monotonic() - self._t >= HEARTBEAT_S * 0.9:
                        self.write()
                except OSError as e:  # a full or unreachable filesystem: say so, keep trying
                    log.warning("node record %s: %s", self.path, e)

        threading.Thread(target=beat, name="node-heartbeat", daemon=True).start()

    def _yield_taken_rank(self) -> None:
        """Two followers that took one node rank at once (docs/architecture.md#several-nodes):
        the later joiner (joined_at, then file name) moves to the lowest rank no live follower
        holds, before it ever launched an agent; as it is when no rank is free."""
        me = (self.fields["joined_at"], self.path.name)
        others = [r for r in live_followers(self.layout, self.token) if r["file"] != self.path.name]
        if not any(
            r.get("node_rank") == self.node_rank
            and (float(r.get("joined_at") or 0), r["file"]) < me
            for r in others
        ):
            return
        # the lowest rank no other holds: one of 1..len(others)+1 is free
        free = min(set(range(1, len(others) + 2)) - {r.get("node_rank") for r in others})
        nnodes = int(self.fields.get("nnodes") or 0)
        if not nnodes or free < nnodes:
            log.warning(
                "node rank %d was taken at the same moment by another node: this node is "
                "node rank %d",
                self.node_rank,
                free,
            )
            self.node_rank = free
            self.write()

    def heartbeat(self) -> None:
        """Rewrite the record if HEARTBEAT_S passed since it was last written."""
        if time.monotonic() - self._t >= HEARTBEAT_S:
            self.write()

    def forget(self) -> None:
        """Stop beating and remove the record (a refused or yielding owner: it never owned
        anything), and `.nodes/` when nothing else is in it."""
        if self._beating is not None:
            self._beating.set()
        with self._lock:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.layout.nodes.rmdir()

    def leave(self, exit_code: int | None = None) -> None:
        """Mark the record as left (kept for `status`: which node ran what, last), with the
        proxy's exit code when known: a follower whose owner left before any incarnation
        exits with success only when the owner did (proxy/supervision/follower.py)."""
        if self._beating is not None:
            self._beating.set()
        with contextlib.suppress(OSError):
            self.write(left=True, ranks=[], agent_pid=None, exit_code=exit_code)


def live_followers(layout: RunLayout, token: str) -> list[dict]:
    """Records of live followers that joined the job `token`."""
    return [
        r
        for r in node_records(layout)
        if r.get("role") == "follower" and r.get("token") == token and record_alive(r)
    ]


def assign_node_rank(layout: RunLayout, token: str, nnodes: int, nproc: int) -> NodeRecord:
    """Register this proxy as a follower of job `token`: the lowest node rank in 1..nnodes-1 that
    no live follower holds, taken under `.nodes/.lock` so two nodes arriving together never
    share one. Raises NodeSetupError when every rank is held (more nodes than --nnodes)."""
    layout.nodes.mkdir(exist_ok=True)
    with FileLock(str(layout.nodes_lock), timeout=30):
        held = {r.get("node_rank"): r for r in live_followers(layout, token)}
        free = [r for r in range(1, nnodes) if r not in held]
        if not free:
            who = ", ".join(f"{r}: {h['host']} pid {h['pid']}" for r, h in sorted(held.items()))
            raise NodeSetupError(
                f"{layout.root}: the job already has its {nnodes} nodes (owner, and node ranks "
                f"{who}); this node would be one too many: give every node the same --nnodes, "
                f"or stop the extra launch"
            )
        rec = NodeRecord(layout, "follower", free[0], token, nproc)
        rec.write(nnodes=nnodes)
    return rec


def wait_for_followers(
    layout: RunLayout,
    token: str,
    nnodes: int,
    timeout: float,
    stopping=lambda: False,
    idle=lambda: None,
) -> list[dict] | None:
    """Wait until nnodes-1 live followers of job `token` have joined and none still runs an
    agent of an earlier incarnation. Returns their records, or None when `stopping()` turned
    true. Raises NodeSetupError after `timeout` seconds, naming the node ranks that are missing
    and the ones present. `idle()` is called between polls."""
    end = time.monotonic() + timeout
    said = 0.0
    while True:
        fol = live_followers(layout, token)
        ranks = sorted({r["node_rank"] for r in fol})  # a rank two took at once counts once
        busy = [r for r in fol if r.get("agent_pid") is not None]  # cleared when it exits
        if len(ranks) >= nnodes - 1 and len(fol) == len(ranks) and not busy:
            return fol
        if stopping():
            return None
        now = time.monotonic()
        if now > end:
            missing = [r for r in range(1, nnodes) if r not in ranks]
            present = (
                ", ".join(f"{r['node_rank']} ({r['host']} pid {r['pid']})" for r in fol) or "none"
            )
            raise NodeSetupError(
                f"rendezvous incomplete after {timeout:.0f} s: node rank(s) "
                f"{', '.join(map(str, missing)) or '-'} of --nnodes {nnodes} never joined "
                f"{layout.root} (joined: owner {socket.gethostname()} pid {os.getpid()}, "
                f"followers {present}"
                + (
                    f"; still running an earlier incarnation: "
                    f"{', '.join(str(r['node_rank']) for r in busy)}"
                    if busy
                    else ""
                )
                + "). Start the same command on the missing node(s), with --run-dir on the "
                "filesystem every node shares (a node whose --run-dir is another directory "
                "becomes the owner of that one and waits in vain), or raise --rdzv-timeout"
            )
        if now - said > 10:
            log.info(
                "waiting for %d node(s) to join %s (have node ranks %s of %d)",
                nnodes - 1 - len(ranks),
                layout.root,
                ranks or "none",
                nnodes,
            )
            said = now
        idle()
        time.sleep(0.05)


def store_address(rdzv_endpoint: str | None) -> str:
    """The address the owner's agent serves the static rendezvous store on: the host of
    `--rdzv-endpoint` when it is an address of this machine, else this machine's host name
    (docs/architecture.md#several-nodes)."""
    host = (rdzv_endpoint or "").rpartition(":")[0].strip("[]")
    if host:
        with contextlib.suppress(OSError):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))  # succeeds only for an address of this machine
            return host
    return socket.gethostname()


def free_port(addr: str) -> int:
    """A TCP port free on `addr` now (the store of one incarnation binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr if addr != socket.gethostname() else "", 0))
        return s.getsockname()[1]
