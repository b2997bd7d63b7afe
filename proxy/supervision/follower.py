"""A follower node's proxy (docs/architecture.md#several-nodes, docs/signals.md#several-nodes):
launch and signal this node's ranks for each incarnation the owner posts in `.nodes/job.json`,
write nothing but this node's record. It takes a node rank in 1..N-1 (proxy/supervision/nodes.py
`assign_node_rank`); a stop signal is written into its record (the owner stops too) and sent
to this node's ranks; the ranks of an incarnation the owner ended get `--stop-timeout`, then
SIGKILL; a lost owner makes it exit 1 (nothing here takes over the run).

What it is not: the owner's supervision (proxy/supervision/supervisor.py) or the node files
(proxy/supervision/nodes.py).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from proxy.run_files.run_lock import HEARTBEAT_S, RunLockError, owner_alive, read_owner
from proxy.supervision import beacon, proc_tree
from proxy.supervision.beacon import Beacon
from proxy.supervision.launch import (
    LaunchOptions,
    kill_agent,
    local_ranks,
    reap_leftover_ranks,
    signal_pids,
    spawn,
    static_argv,
)
from proxy.supervision.nodes import (
    NODE_STALE_S,
    NodeRecord,
    NodeSetupError,
    assign_node_rank,
    node_records,
    read_job,
    read_node_record,
    record_alive,
)
from shared.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from shared.run.layout import RunLayout

log = logging.getLogger("proxy")

STALE_OWNER_WAIT_S = 20.0  # a held lock under a dead owner's record: wait for the new (seconds)


@dataclass
class Follower:
    """The follower loop of one node; `run()` returns the exit code."""

    layout: RunLayout
    rec: NodeRecord
    owner: dict
    nnodes: int
    stop_timeout: float
    rdzv_timeout: float
    beacon: Beacon | None = None  # the job beacon this node serves, if any
    rdzv_id: str | None = None

    def __post_init__(self) -> None:
        self.stop: str | None = None
        self.usr1 = 0
        self.proc: subprocess.Popen | None = None
        self.incarnation: int | None = None
        self._ended_at: float | None = None  # the owner ended our incarnation at (monotonic)
        self._stop_sent = False
        self._stop_at = math.inf
        self._started = time.monotonic()

    # ------------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        def on_stop(signum, frame):
            self.stop = self.stop or signal.Signals(signum).name

        def on_usr1(signum, frame):
            self.usr1 += 1

        for s in proc_tree.STOP_SIGNALS:
            signal.signal(s, on_stop)
        signal.signal(signal.SIGUSR1, on_usr1)
        early_stop, early_usr1 = proc_tree.EarlySignals.take()
        self.stop = self.stop or early_stop
        self.usr1 += early_usr1
        proc_tree.become_subreaper()

    # ------------------------------------------------------------------ the owner
    def _owner_alive(self) -> bool:
        """The owner's node record is alive (its pid on this host, its heartbeat elsewhere);
        before it has one, the benefit of the doubt for NODE_STALE_S seconds."""
        rec = read_node_record(self.layout, self.owner["host"], self.owner["pid"])
        if rec is not None:
            return record_alive(rec)
        return time.monotonic() - self._started < NODE_STALE_S

    def _owner_left_cleanly(self) -> bool:
        """The owner's node record says it left with exit code 0 (a stop while the nodes
        gathered, or between incarnations: proxy/supervision/nodes.py `NodeRecord.leave`)."""
        rec = read_node_record(self.layout, self.owner["host"], self.owner["pid"])
        return bool(rec and rec.get("left") and rec.get("exit_code") == 0)

    def _owner_ended_clean(self) -> bool:
        """After a stop whose agent exited non-zero (a scheduler signalled the agent too): wait
        up to --stop-timeout for the owner to end the job, True when it ended it cleanly (the
        ranks agreed and the checkpoint is written)."""
        end = time.monotonic() + self.stop_timeout
        while time.monotonic() < end and self._owner_alive():
            job = read_job(self.layout) or {}
            if job.get("token") == self.rec.token and job.get("state") == "done":
                return bool(job.get("clean"))
            self.rec.heartbeat()
            time.sleep(0.1)
        job = read_job(self.layout) or {}
        return bool(job.get("token") == self.rec.token and job.get("clean"))

    # ------------------------------------------------------------------ the agent
    def _launch(self, job: dict) -> None:
        args = [*job["worker_args"], "--parent-pid", str(os.getpid())]
        argv = static_argv(sys.executable, args, job, self.rec.node_rank, self.rdzv_timeout)
        self.proc = spawn(argv, torchrun=True, multi_node=True)
        self.incarnation = job["incarnation"]
        self._ended_at, self._stop_sent = None, False
        self.rec.write(
            agent_pid=self.proc.pid, incarnation=self.incarnation, agent_exit=None, ranks=[]
        )
        log.info(
            "incarnation %d: started this node's agent pid %d (node rank %d of %d, store %s:%s)",
            self.incarnation,
            self.proc.pid,
            self.rec.node_rank,
            self.nnodes,
            job["addr"],
            job["port"],
        )

    def _signal_ranks(self, sig: int) -> bool:
        """`sig` to this node's ranks; before they exist, a stop goes to the agent (it stops
        everything, which is what a stop means) and SIGUSR1 waits. False: nothing sent."""
        if ranks := self.rec.refresh_ranks(self.proc.pid if self.proc else None):
            signal_pids(ranks, sig)
            return True
        if sig == signal.SIGUSR1 or self.proc is None:
            return False
        signal_pids([self.proc.pid], sig)
        return True

    def _kill_agent(self) -> None:
        assert self.proc is not None  # called only while an agent runs
        kill_agent(
            self.proc.pid, self.rec.ranks + local_ranks(self.proc.pid, str(self.layout.root))
        )

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        try:
            return self._loop()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self._kill_agent()
                self.proc.wait()
            self.rec.leave()

    def _relay_second_owners(self) -> None:
        """A second owner of this job (another run directory) told the beacon this node serves
        (proxy/supervision/beacon.py): put it into the record, where the owner reads it."""
        if self.beacon is None or self.rec.fields.get("second_owner"):
            return
        tokens = {r.get("token") for r in node_records(self.layout)}
        for r in list(self.beacon.reports):
            if r.get("rdzv_id") == self.rdzv_id and r.get("token") not in tokens:
                self.rec.write(second_owner=r)
                return

    def _loop(self) -> int:
        said_stop = False
        while True:
            self.rec.heartbeat()
            self._relay_second_owners()
            job = read_job(self.layout)
            if job is not None and job.get("token") != self.rec.token:
                job = None  # an earlier owner's, not yet replaced
            if self.stop and not said_stop:
                said_stop = True
                log.info(
                    "%s received: asking every node to checkpoint and stop (this node's "
                    "ranks directly, the owner through this node's record)",
                    self.stop,
                )
                self.rec.write(stop_request=self.stop)
            if self.proc is None:
                if self.stop:
                    return EXIT_OK
                if job is not None and job.get("state") == "done":
                    log.info("the owner ended the job (%s): exiting", job.get("why") or "done")
                    return EXIT_OK
                if not self._owner_alive():
                    if self._owner_left_cleanly():
                        log.info(
                            "the run's owner (proxy pid %s on %s) stopped cleanly before "
                            "this node's ranks started: exiting",
                            self.owner.get("pid"),
                            self.owner.get("host"),
                        )
                        return EXIT_OK
                    log.error(
                        "the run's owner (proxy pid %s on %s) is gone: this node stops "
                        "(the owner's node holds rank 0 and the history; start the job "
                        "again)",
                        self.owner.get("pid"),
                        self.owner.get("host"),
                    )
                    return EXIT_FAILED
                if (
                    job is not None
                    and job.get("state") == "launch"
                    and job.get("incarnation") != self.incarnation
                    and [self.rec.host, self.rec.pid] in job.get("members", [])
                ):
                    self._launch(job)  # (one this node joined after waits for the next)
                time.sleep(0.05)
                continue
            # an agent of ours runs
            if self.stop and not self._stop_sent:
                self._stop_sent = self._signal_ranks(signal.SIGTERM)
                if self._stop_sent:
                    self._signal_ranks(signal.SIGCONT)
                    self._stop_at = time.monotonic()
            while self.usr1 and self._signal_ranks(signal.SIGUSR1):
                self.usr1 -= 1
                log.info("SIGUSR1 received: forwarded to this node's ranks %s", self.rec.ranks)
            self.rec.refresh_ranks(self.proc.pid)
            rc = self.proc.poll()
            if rc is not None:
                reap_leftover_ranks(self.rec.ranks, str(self.layout.root))
                log.info(
                    "incarnation %s: this node's agent exited with code %d", self.incarnation, rc
                )
                self.rec.write(agent_pid=None, agent_exit=rc, ranks=[])
                self.proc = None
                if self.stop:
                    return EXIT_OK if rc == 0 or self._owner_ended_clean() else EXIT_FAILED
                continue
            now = time.monotonic()
            ended = (
                job is None
                or job.get("incarnation") != self.incarnation
                or job.get("state") != "launch"
                or not self._owner_alive()
            )
            if not ended and self._ended_at is not None and self._ended_at != math.inf:
                self._ended_at = None  # job.json unreadable for a moment (a network filesystem)
            if ended and self._ended_at is None:
                self._ended_at = now
                clean = job is not None and job.get("agent_exit") == 0
                log.log(
                    logging.INFO if clean else logging.WARNING,
                    "incarnation %s ended on the owner's side (%s) while this node's agent "
                    "still runs: it gets %.0f s to exit",
                    self.incarnation,
                    "cleanly" if clean else "its ranks failed or the owner is gone",
                    self.stop_timeout,
                )
            stuck_stop = self._stop_sent and now - self._stop_at > self.stop_timeout
            if (
                self._ended_at is not None and now - self._ended_at > self.stop_timeout
            ) or stuck_stop:
                log.error(
                    "this node's agent pid %d and ranks %s did not exit: killing them",
                    self.proc.pid,
                    self.rec.ranks,
                )
                self._kill_agent()
                self._ended_at = self._stop_at = math.inf
            proc_tree.reap_orphans({self.proc.pid})
            time.sleep(0.02 if self.stop else 0.1)


def _owner_job_problem(owner: dict | None, job: dict) -> str | None:
    """Why this node cannot follow the run's lock holder `owner` (its `.proxy.owner.json`) as a
    node of `job`, or None when it is the owner of the same job."""
    if not owner:
        return "its owner file is unreadable"
    ojob = owner.get("job")
    who = f"proxy pid {owner.get('pid')} on host {owner.get('host')}"
    if not ojob:
        return f"it is owned by {who}, a single-node run (no --nnodes)"
    if ojob.get("rdzv_id") != job["rdzv_id"]:
        return (
            f"it is owned by {who} for the job --rdzv-id {ojob.get('rdzv_id')}, not this "
            f"node's --rdzv-id {job['rdzv_id']}"
        )
    if ojob.get("nnodes") != job["nnodes"]:
        return (
            f"mismatched --nnodes: its owner ({who}) runs --nnodes {ojob.get('nnodes')}, this "
            f"node --nnodes {job['nnodes']}; give every node the same --nnodes"
        )
    if ojob.get("nproc_per_node") != job["nproc_per_node"]:
        return (
            f"mismatched --nproc-per-node: its owner ({who}) runs {ojob.get('nproc_per_node')} "
            f"rank(s) per node, this node {job['nproc_per_node']}; give every node the same"
        )
    return None


def follow(
    layout: RunLayout, launch: LaunchOptions, stop_timeout: float, job: dict, err: RunLockError
) -> int:
    """`run` on a run directory whose lock another proxy holds, with --nnodes > 1: join it as a
    follower when it is the owner of the same job, else refuse (exit 2) naming the mismatch,
    before anything is written. stop_timeout: seconds a stopping rank gets before SIGKILL.
    Returns the exit code."""
    owner = err.owner
    t0, said = time.monotonic(), False
    # The lock's new holder may not have replaced the last owner's record yet (nodes started
    # together; a requeued job finds its own last start's record, of the same --rdzv-id): wait
    # for a live owner's record, never follow a released or dead one.
    while True:
        alive = owner is not None and (
            owner_alive(layout, owner, watch_s=2 * HEARTBEAT_S)
            if owner.get("job")
            else not owner.get("released")  # a single-node owner's record does not beat
        )
        waited = time.monotonic() - t0
        if waited > STALE_OWNER_WAIT_S or (
            owner is not None and alive and (owner.get("job") or waited > 3.0)
        ):
            break
        if owner is not None and not alive and not said:
            said = True
            log.info(
                "%s: the lock is held, but the owner record still names proxy pid %s on %s, "
                "which has stopped: waiting for the new owner's record",
                layout.root,
                owner.get("pid"),
                owner.get("host"),
            )
        time.sleep(0.05)
        owner = read_owner(layout)
    why = _owner_job_problem(owner, job)
    if owner is not None and why is None and not alive:
        why = (
            f"its lock is held, but its owner record names proxy pid {owner.get('pid')} on "
            f"{owner.get('host')}, which is gone, and no live owner replaced it within "
            f"{STALE_OWNER_WAIT_S:.0f} s"
        )
    if why is not None:
        log.error(
            "%s: this node cannot join: %s. Every node of one job runs the same command "
            "(--run-dir on a shared filesystem, --nnodes, --nproc-per-node, --rdzv-id)",
            layout.root,
            why,
        )
        return EXIT_USAGE
    assert owner is not None  # _owner_job_problem refuses a missing record
    # this node on the endpoint's host answers for the job
    served = beacon.serve(
        launch.rdzv_endpoint,
        {
            "rdzv_id": job["rdzv_id"],
            "token": owner["job"]["token"],
            "run_dir": str(layout.root),
            "host": owner["host"],
            "pid": owner["pid"],
        },
    )
    if launch.node_rank is not None:
        log.info(
            "--node-rank %d ignored: the run's owner is node rank 0 and followers take 1..%d "
            "in the order they join (docs/architecture.md#several-nodes)",
            launch.node_rank,
            job["nnodes"] - 1,
        )
    try:
        rec = assign_node_rank(layout, owner["job"]["token"], job["nnodes"], job["nproc_per_node"])
    except NodeSetupError as e:
        log.error("%s", e)
        return EXIT_USAGE
    log.info(
        "following the run %s as node rank %d of %d (owner: proxy pid %s on %s); this node "
        "writes only %s",
        layout.root,
        rec.node_rank,
        job["nnodes"],
        owner["pid"],
        owner["host"],
        rec.path.name,
    )
    rec.start_heartbeat()
    f = Follower(
        layout,
        rec,
        owner,
        job["nnodes"],
        stop_timeout,
        launch.rdzv_timeout,
        beacon=served,
        rdzv_id=job["rdzv_id"],
    )
    f.install_signal_handlers()
    code = f.run()
    log.info("follower exiting with code %d", code)
    return code
