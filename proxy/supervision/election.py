"""The owner election of a several-node job (docs/architecture.md#several-nodes): the proxy that
took the run lock writes its node record, makes sure no other owner answers for the job (the
job beacon, proxy/supervision/beacon.py) and waits for the other nodes before anything of the
run is written; an earlier claim of the same directory wins, and this proxy then follows it.

What it is not: the node records and the gathering (proxy/supervision/nodes.py), the follower
(proxy/supervision/follower.py), the beacon itself, or the run lock (proxy/run_files/run_lock.py).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

from proxy.run_files.run_lock import RunLock, read_owner
from proxy.supervision import beacon
from proxy.supervision.launch import LaunchOptions
from proxy.supervision.nodes import (
    NodeRecord,
    NodeSetupError,
    live_followers,
    node_records,
    wait_for_followers,
    write_job,
)
from proxy.supervision.proc_tree import EarlySignals
from shared.exit_codes import EXIT_OK, EXIT_USAGE
from shared.run.layout import RunLayout

log = logging.getLogger("proxy")


class OwnedJob:
    """The owner's node record of a several-node job while this proxy holds it (the `run`
    command leaves it on the way out)."""

    node: NodeRecord | None = None


def gather_job(
    layout: RunLayout, lock: RunLock, job: dict, launch: LaunchOptions, owned: OwnedJob
) -> int | None:
    """Own a several-node job, as the module docstring says; sets `owned.node` while the record
    is ours. Returns an exit code when the start ends here (refused or stopped), else None.
    Raises Yielded, with the lock released and nothing of ours left, when an earlier claim of
    the directory won: the caller follows it (proxy/supervision/follower.py)."""
    # the record first: an owner that asks the beacon tells "same directory" from
    # "another directory" by the records it finds here (proxy/supervision/beacon.py)
    node = owned.node = NodeRecord(layout, "owner", 0, job["token"], launch.nproc_per_node)
    node.write()
    node.start_heartbeat()  # also through creation, resume planning, back-off
    checks = OwnerChecks(launch, job, layout)
    if not checks.first():
        node.forget()
        owned.node = None
        return EXIT_USAGE
    write_job(layout, {**job, "state": "gathering", "incarnation": 0})  # not the last owner's
    log.info(
        "owner of %s (node rank 0 of %d, global rank 0 here): waiting up to %.0f s "
        "for the other node(s)",
        layout.root,
        launch.nodes,
        launch.rdzv_timeout,
    )

    def idle() -> None:
        node.heartbeat()
        checks.again()
        if lock.lost is not None:
            raise Yielded(lock.lost)

    try:  # before anything of the run is written: a job that cannot form writes nothing
        if (
            wait_for_followers(
                layout,
                job["token"],
                launch.nodes,
                launch.rdzv_timeout,
                lambda: EarlySignals.stop is not None,
                idle,
            )
            is None
        ):
            log.info("%s received while the nodes gathered: nothing started", EarlySignals.stop)
            return EXIT_OK
    except NodeSetupError as e:
        log.error("%s", e)
        return EXIT_USAGE
    except Yielded:  # an earlier claim of this directory won: the caller follows it
        node.forget()
        owned.node = None
        checks.close()
        lock.release()
        raise
    lock.on_lost = lambda: os.kill(os.getpid(), signal.SIGTERM)  # stop: one history
    return None


class Yielded(Exception):
    """The owner record of an earlier claim of this run directory replaced ours
    (proxy/run_files/run_lock.py): this proxy becomes its follower. `owner`: that record."""

    def __init__(self, owner: dict) -> None:
        super().__init__("yield")
        self.owner = owner


class OwnerChecks:
    """Two owners of one job in two directories (proxy/supervision/beacon.py): the owner serves
    the job beacon at --rdzv-endpoint when that is its host, else asks it, at the start and
    every 2 s while the nodes gather (the endpoint's node may start later). A second owner is
    refused; the beacon's owner, told by it, stops too (NodeSetupError from `again`)."""

    def __init__(self, launch: LaunchOptions, job: dict, layout: RunLayout) -> None:
        self.endpoint, self.layout = launch.rdzv_endpoint, layout
        self.me = {
            "rdzv_id": launch.rdzv_id,
            "token": job["token"],
            "run_dir": str(layout.root),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self.served = beacon.serve(self.endpoint, self.me)
        self.heard = self.served is not None
        self.t0 = self.last = self.scanned = time.monotonic()
        self.warned = False

    def _same_dir(self, token: str) -> bool:
        """A proxy of job `token` has (or had) a record in this run directory."""
        return (
            any(r.get("token") == token for r in node_records(self.layout))
            or ((read_owner(self.layout) or {}).get("job") or {}).get("token") == token
        )

    def first(self) -> bool:
        """False (logged) when this proxy is a second owner."""
        if self.served is not None:
            return True
        why, self.heard = beacon.second_owner(
            self.endpoint, self.me, self.layout.root, self._same_dir
        )
        if why:
            log.error("%s", why)
            self.close()
        return why is None

    def again(self) -> None:
        if time.monotonic() - self.scanned < 1.0:  # called every poll: read the files each second
            return
        self.scanned = time.monotonic()
        for f in live_followers(self.layout, self.me["token"]):  # heard by a follower's beacon
            r = f.get("second_owner")
            if isinstance(r, dict) and r.get("token") != self.me["token"]:
                raise NodeSetupError(
                    beacon.two_owners(r, self.layout.root)
                    + f" (that node was refused by the job beacon of node rank "
                    f"{f.get('node_rank')}; this one stops too: the job cannot form)"
                )
        if self.served is not None:
            for r in list(self.served.reports):
                if (
                    r.get("rdzv_id") == self.me["rdzv_id"]
                    and r.get("token") != self.me["token"]
                    and not self._same_dir(str(r.get("token")))
                ):
                    raise NodeSetupError(
                        beacon.two_owners(r, self.layout.root)
                        + " (that node was refused; this one stops too: the job cannot form)"
                    )
            return
        if time.monotonic() - self.last < 2.0:
            return
        self.last = time.monotonic()
        why, heard = beacon.second_owner(self.endpoint, self.me, self.layout.root, self._same_dir)
        if why:
            raise NodeSetupError(why)
        self.heard = self.heard or heard
        if not self.heard and not self.warned and self.last - self.t0 > 10:
            self.warned = True
            log.warning(
                "nothing answers at --rdzv-endpoint %s: no node of this job runs on its host "
                "yet. Give --rdzv-endpoint the address of one of the job's nodes (the first "
                "node, as torchrun expects): a node with another --run-dir is then refused at "
                "once, not only at the --rdzv-timeout deadline",
                self.endpoint,
            )

    def close(self) -> None:
        if self.served is not None:
            self.served.close()
            self.served = None
