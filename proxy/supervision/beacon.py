"""The job beacon at `--rdzv-endpoint` (docs/architecture.md#several-nodes): catches two owners of one job.

A node whose `--run-dir` is not the directory the other nodes share finds that directory's lock
free and becomes the owner of it: two owners of one job, each waiting for followers that never
come. The run directory cannot tell them apart, the endpoint can: the proxy on the endpoint's host
(when `--rdzv-endpoint`'s host is an address of its machine) listens on that port and answers
every connection with one JSON line naming the job it serves (rdzv id, the owner's token, the run
directory, host and pid). Any other owner of the same job id asks it; a different token means a
second owner, refused with exit 2 naming both run directories. The port is free for this: the
rendezvous itself runs on a fresh port the owner posts (proxy/supervision/nodes.py).

What it is not: a rendezvous or a channel for anything else; a node on no shared filesystem and
not on the endpoint's host is still only caught by the owner's deadline.
"""

from __future__ import annotations

import json
import socket
import threading


def _split(endpoint: str | None) -> tuple[str, int] | None:
    host, _, port = (endpoint or "").rpartition(":")
    host = host.strip("[]")
    return (host, int(port)) if host and port.isdigit() else None


def serve(endpoint: str | None, info: dict) -> bool:
    """Listen at `endpoint` in a daemon thread, answering each connection with `info` as one
    JSON line. False when the endpoint's host is not this machine or the port is taken."""
    where = _split(endpoint)
    if where is None:
        return False
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(where)
        s.listen(16)
    except OSError:
        s.close()
        return False
    line = (json.dumps(info) + "\n").encode()

    def loop() -> None:
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            with c:
                try:
                    c.settimeout(1.0)
                    c.sendall(line)
                except OSError:
                    pass

    threading.Thread(target=loop, name="job-beacon", daemon=True).start()
    return True


def ask(endpoint: str | None, timeout: float = 1.0) -> dict | None:
    """The job the beacon at `endpoint` serves, or None (nobody listening, or not a beacon)."""
    where = _split(endpoint)
    if where is None:
        return None
    try:
        with socket.create_connection(where, timeout=timeout) as c:
            c.settimeout(timeout)
            data = b""
            while not data.endswith(b"\n") and len(data) < 65536:
                chunk = c.recv(4096)
                if not chunk:
                    break
                data += chunk
        d = json.loads(data)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and "token" in d else None


def second_owner(endpoint: str | None, rdzv_id: str | None, token: str, run_dir) -> str | None:
    """Why this proxy, owner of job `token` in `run_dir`, is a second owner of job `rdzv_id`
    (a sentence naming both run directories), or None when the beacon at `endpoint` serves this
    job, another job id, or nobody."""
    d = ask(endpoint)
    if d is None or d.get("rdzv_id") != rdzv_id or d.get("token") == token:
        return None
    return (
        f"two owners of job --rdzv-id {rdzv_id}: proxy pid {d.get('pid')} on {d.get('host')} "
        f"owns it in {d.get('run_dir')}, and this node's --run-dir {run_dir} has no owner "
        f"of that job, so it is not the same directory: give every node the same --run-dir "
        f"on the filesystem they share"
    )
