"""Supervision of the worker (docs/architecture.md#processes, docs/signals.md): spawn, forward
signals, watch, restart.

One incarnation = plan the resume (proxy/supervision/resume_planning.py), post the policies,
spawn the worker, then watch: hand every report to the filer (report_filing.py), forward
signals, detect crash and hang, serve pivots in place (docs/pivots.md#live-runs: the proxy's pid
never changes). A worker that exits non-zero or hangs is restarted from the newest valid
checkpoint with back-off, up to `max_restarts` in a row without a new checkpoint.

What it is not: the options (proxy/supervision/run_options.py, built by
proxy/commands/run_args.py), the run's creation (proxy/supervision/run_setup.py).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from proxy.fault_injection import pivot_fault
from proxy.mixture.collapse_watch import CollapseWatch
from proxy.mixture.controller import MixtureController
from proxy.observation.run_watch import RunWatch
from proxy.run_files.loss_ema import LossEma
from proxy.run_files.phases import read_phases
from proxy.run_files.pivot_request import RequestLockTimeout, pending_request
from proxy.run_files.sidecars import SamplesLog
from proxy.run_files.status_file import LiveStats, write_status
from proxy.supervision import proc_tree
from proxy.supervision.launch import (
    agent_descendants,
    kill_agent,
    rank_pids,
    reap_leftover_ranks,
    signal_pids,
    spawn,
    static_argv,
    torchrun_argv,
    wait_for_earlier_workers,
)
from proxy.supervision.nodes import (
    NodeRecord,
    NodeSetupError,
    free_port,
    node_records,
    record_alive,
    store_address,
    wait_for_followers,
    write_job,
)
from proxy.supervision.pivots import (
    fail_unserved,
    follow_worker_boundary,
    mark_running,
    poll_pivot_request,
)
from proxy.supervision.report_filing import ReportFiler
from proxy.supervision.report_salvage import salvage_step_reports
from proxy.supervision.resume_planning import ResumeError, plan_resume
from proxy.supervision.run_options import ProxyOptions
from proxy.supervision.run_setup import replan
from shared.atomic_io import storage_failure
from shared.exit_codes import EXIT_FAILED, EXIT_FATAL
from shared.lr_schedule import learning_rate
from shared.processes import group_members, seconds_since_start
from shared.run.config import RunConfig
from shared.run.handshake import ReportReader, policy_period, reset_handshake, update_handshake
from shared.run.layout import RunLayout
from shared.run.loss_history import LossHistory, tail_records
from shared.run.worker_options import WorkerOptions

log = logging.getLogger("proxy")

NODE_LOST_GRACE_S = 10.0  # a lost node's peers get this long to fail before they are killed
STARTUP_GRACE_S = 300.0  # before its hello a worker may be importing torch / compiling
POLL_IDLE_S = 0.1  # proxy loop period when no report arrived (seconds)


class SupervisorError(RuntimeError):
    """The run cannot go on; the message says why and what to do. Exit code 1, 2 or 3
    (docs/architecture.md#exit-codes: 3 when the worker said it cannot go on)."""

    def __init__(self, msg: str, code: int = EXIT_FAILED) -> None:
        super().__init__(msg)
        self.code = code


class Supervisor:
    """Supervises one run's worker until it ends (docs/architecture.md#processes).

    opts: this start's options. creation_s: seconds this start spent creating the run (None: it
    resumed one), for the summary. node: the owner's node record of a several-node job (None on
    one node), which the launches rewrite (docs/architecture.md#several-nodes)."""

    def __init__(
        self,
        layout: RunLayout,
        cfg: RunConfig,
        opts: ProxyOptions,
        creation_s: float | None = None,
        node: NodeRecord | None = None,
    ) -> None:
        self.layout, self.cfg, self.opts = layout, cfg, opts
        self.max_steps = opts.max_steps or cfg.max_steps
        self.stop_requested: str | None = None
        self.usr1_pending = 0
        self.stats = LiveStats()
        self.resumed_step = 0
        self.proc: subprocess.Popen | None = None
        self.filer: ReportFiler | None = None  # the current incarnation's
        self.subreaper = False  # orphans of the worker's tree are re-parented here
        self._status_t = 0.0
        self.pending_events: list[dict] = []  # attached to the next step record filed
        self._replanned = False  # --replan done (the first incarnation does it)
        self.watch = RunWatch(
            layout, cfg, self.max_steps, opts.tensorboard, opts.wandb, creation_s=creation_s
        )
        self.pivot_step: int | None = None  # a pivot at B recorded, its worker's first step due
        self.collapse = CollapseWatch(layout, opts.stop_on_collapse)  # across incarnations
        self._lock_warned_at = -math.inf  # the last "pivot ... deferred" warning (monotonic s)
        # several nodes (docs/architecture.md#several-nodes): this proxy is the owner
        self.node = node
        self.incarnation = 0
        self._nodes_t = 0.0
        self.followers: dict[int, dict] = {}  # node rank -> record, at this incarnation's launch
        self.node_lost: str | None = None  # why a follower counts as lost this incarnation
        self._lost_at: float | None = None

    # ------------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT/SIGHUP -> stop the worker cleanly; SIGUSR1 -> forward. Takes over the
        signals proxy_tree.EarlySignals caught during start-up, and makes the proxy a child
        subreaper so orphans of the worker's tree are re-parented to it and reaped (PID 1 too)."""

        def on_stop(signum, frame):
            self.stop_requested = self.stop_requested or signal.Signals(signum).name

        def on_usr1(signum, frame):
            self.usr1_pending += 1

        for s in proc_tree.STOP_SIGNALS:
            signal.signal(s, on_stop)
        signal.signal(signal.SIGUSR1, on_usr1)
        early_stop, early_usr1 = proc_tree.EarlySignals.take()
        if early_stop and self.stop_requested is None:
            self.stop_requested = early_stop
            log.info("%s received during start-up: no worker will be started", early_stop)
        self.usr1_pending += early_usr1
        self.subreaper = proc_tree.become_subreaper()

    # ------------------------------------------------------------------ one incarnation
    def _spawn(self, resume: Path | None, verified: str | None = None) -> subprocess.Popen:
        o = self.opts
        wo = WorkerOptions(
            run_dir=self.layout.root,
            max_steps=self.max_steps,
            usr1_at=o.usr1_at,
            device=o.device,
            parent_pid=os.getpid(),
            keep_last=o.keep_last,
            keep_every=o.keep_every,
            resume_from=resume,
            resume_verified=verified,
            compile=o.compile,
            precision=o.precision,
            micro_batch_size=o.micro_batch_size,
        )
        argv = [sys.executable, "-m", "worker", *wo.to_argv()]
        if self.node is not None:  # the owner: node rank 0 of a static rendezvous
            argv = self._owner_argv(argv[3:])
        elif o.launch.uses_torchrun:  # ranks watch the proxy's pid (--parent-pid), not the agent
            argv = torchrun_argv(sys.executable, argv[3:], o.launch)
        proc = spawn(argv, o.launch.uses_torchrun, self.node is not None)
        if self.node is not None:
            self.node.write(
                agent_pid=proc.pid, incarnation=self.incarnation, agent_exit=None, ranks=[]
            )
        return proc

    # ------------------------------------------------------------------ several nodes
    def _job(self) -> dict:
        lo = self.opts.launch
        return {
            "token": self.node.token,
            "rdzv_id": lo.rdzv_id,
            "nnodes": lo.nodes,
            "nproc_per_node": lo.nproc_per_node,
            "owner_host": self.node.host,
            "owner_pid": self.node.pid,
            "incarnation": self.incarnation,
        }

    def _owner_argv(self, worker_args: list[str]) -> list[str]:
        """Post incarnation n+1 in .nodes/job.json (the worker's arguments without
        --parent-pid, which each node gives its own; the address and a fresh port of the store
        this node's agent serves) and return the owner's torchrun argv (node rank 0)."""
        lo = self.opts.launch
        i = worker_args.index("--parent-pid")
        shared_args = worker_args[:i] + worker_args[i + 2 :]
        self.incarnation += 1
        addr = store_address(lo.rdzv_endpoint)
        port = free_port(addr)
        job = {
            **self._job(),
            "state": "launch",
            "addr": addr,
            "port": port,
            "run_id": f"{lo.rdzv_id or 'andrea'}-{self.node.token[:8]}-{self.incarnation}",
            "worker_args": shared_args,
            "members": [[f["host"], f["pid"]] for _, f in sorted(self.followers.items())],
            "posted_at": time.time(),
        }
        write_job(self.layout, job)
        log.info(
            "incarnation %d: %d node(s) x %d rank(s), rank 0 on this node; store %s:%d; "
            "followers: %s",
            self.incarnation,
            lo.nodes,
            lo.nproc_per_node,
            addr,
            port,
            ", ".join(
                f"node rank {r} {f['host']} pid {f['pid']}"
                for r, f in sorted(self.followers.items())
            ),
        )
        return static_argv(sys.executable, worker_args, job, 0, lo.rdzv_timeout)

    def _gather_nodes(self) -> bool:
        """Before an incarnation: wait (up to --rdzv-timeout) for every follower to be present
        and idle. False when a stop came meanwhile. Raises SupervisorError naming the missing
        node ranks when they never come."""

        def stopping() -> bool:
            self._poll_follower_stops()
            return self.stop_requested is not None

        try:
            fol = wait_for_followers(
                self.layout,
                self.node.token,
                self.opts.launch.nodes,
                self.opts.launch.rdzv_timeout,
                stopping,
                idle=self.node.heartbeat,
            )
        except NodeSetupError as e:
            raise SupervisorError(
                f"{e}; the job cannot go on without them: the newest valid "
                "checkpoint is kept, run the job again"
            ) from None
        if fol is None:
            return False
        self.followers = {r["node_rank"]: r for r in fol}
        self.node_lost, self._lost_at = None, None
        return True

    def _poll_follower_stops(self) -> None:
        """A stop signal a follower received (its record's stop_request) stops the job."""
        for r in node_records(self.layout):
            if (
                r.get("token") == self.node.token
                and r.get("role") == "follower"
                and r.get("stop_request")
                and self.stop_requested is None
                and not r.get("left")
            ):
                self.stop_requested = (
                    f"{r['stop_request']} on node rank {r['node_rank']} ({r['host']})"
                )

    def _nodes_tick(self) -> None:
        """While an incarnation runs (about 4 times a second): heartbeat, this node's ranks,
        stop requests from followers, and followers lost (proxy gone, or agent exited non-zero;
        docs/architecture.md#several-nodes, "A node lost")."""
        now = time.monotonic()
        if now - self._nodes_t < 0.25:
            return
        self._nodes_t = now
        self.node.refresh_ranks(self.proc.pid)
        self.node.heartbeat()
        self._poll_follower_stops()
        if self.node_lost is None:
            recs = {(r["host"], r["pid"]): r for r in node_records(self.layout)}
            for rank, f in self.followers.items():
                r = recs.get((f["host"], f["pid"]))
                if r is None or not record_alive(r):
                    self.node_lost = f"node rank {rank} ({f['host']} pid {f['pid']}) is gone"
                elif r.get("incarnation") == self.incarnation and r.get("agent_exit"):
                    self.node_lost = (
                        f"the ranks of node rank {rank} ({f['host']}) exited with "
                        f"code {r['agent_exit']}"
                    )
                if self.node_lost:
                    self._lost_at = now
                    log.error(
                        "%s: this node's ranks get %.0f s to fail, then the job restarts "
                        "from the newest valid checkpoint",
                        self.node_lost,
                        NODE_LOST_GRACE_S,
                    )
                    break
        elif (
            self._lost_at is not None
            and now - self._lost_at > NODE_LOST_GRACE_S
            and self.proc.poll() is None
        ):
            log.error("%s and this node's ranks still run: killing them", self.node_lost)
            self._kill_group()
            self._lost_at = None

    def _rank_pids(self) -> list[int]:
        """This node's ranks: the announced pids, or under several nodes the agent's own
        descendants (the handshake's pids mix every node's)."""
        if self.node is None:
            return rank_pids(self.layout)
        return self.node.refresh_ranks(self.proc.pid, every=0.0)

    def _replan(self, step: int) -> None:
        """--replan at `step`, where this start resumes (proxy/supervision/run_setup.py
        `replan`), logged and recorded as an event; once per proxy (a restart keeps the plan)."""
        self._replanned = True
        before = learning_rate(step + 1, self.cfg) if step else None
        entry = replan(self.layout, self.cfg, step, self.max_steps, self.opts.decay_at)
        if entry is None:
            log.info(
                "--replan: the plan already ends at step %d; nothing to change", self.max_steps
            )
            return
        after = learning_rate(step + 1, self.cfg)
        log.warning(
            "re-planned the learning-rate schedule at step %d to end at step %d (%s%s): the "
            "rate of step %d was %s and is %.3g (run.json replans)",
            step,
            self.max_steps,
            self.cfg.schedule,
            f", decay from step {entry['decay_at']}" if entry["decay_at"] is not None else "",
            step + 1,
            f"{before:.3g}" if before is not None else "-",
            after,
        )
        self.pending_events.append({"event": "replanned", **entry, "time": time.time()})

    def _post_policies(self, mix: MixtureController, first_period: int) -> None:
        pols = mix.policies_from(first_period)
        update_handshake(self.layout, lambda d: d.__setitem__("policies", pols))

    def run(self) -> int:
        """Supervise until the run finishes or is stopped; returns the exit code."""
        wait_for_earlier_workers(self.layout, self.opts.stop_timeout)  # a kill -9'd proxy's
        history = LossHistory(self.layout.loss)  # logs each repair of a torn tail itself, once
        salvage_step_reports(self.layout, history, read_phases(self.layout))  # a dead proxy's
        if self.max_steps != self.cfg.max_steps and not self.opts.replan:
            log.warning(
                "!!! --max-steps %d differs from the %d planned (run.json): the "
                "learning-rate schedule stays the planned one (warm-up %d, decay to step "
                "%d, flat after); add --replan to re-plan it to end at --max-steps; "
                "recorded in .loss.json as an event !!!",
                self.max_steps,
                self.cfg.max_steps,
                self.cfg.warmup_steps,
                self.cfg.decay_end,
            )
            self.pending_events.append(
                {
                    "event": "max-steps-changed",
                    "max_steps": self.max_steps,
                    "planned_max_steps": self.cfg.max_steps,
                    "lr_decay_steps": self.cfg.decay_end,
                    "warmup_steps": self.cfg.warmup_steps,
                    "time": time.time(),
                }
            )
        restarts = 0
        clean = False  # the run ends with exit 0 (followers that stopped exit 0 too)
        storage_failed = False  # a run file could not be written (a full disk)
        try:
            while True:
                outcome, rc = self._incarnation(history)
                if outcome == "done":
                    clean = True
                    return 0
                if outcome == "pivot":  # the worker stopped at the boundary: same proxy goes on
                    restarts = 0  # it wrote step_B.bin: progress
                    log.info(
                        "pivot: the worker stopped at boundary step %s; archiving the phase "
                        "and starting the new one in this proxy (pid %d)",
                        rc,
                        os.getpid(),
                    )
                    continue
                if outcome == "withdrawn":
                    restarts = 0  # it wrote its checkpoint: progress
                    log.info(
                        "the worker stopped at step %s for a pivot that was withdrawn; a new "
                        "worker resumes there in the phase in force",
                        rc,
                    )
                    continue
                if outcome == "fatal":
                    why = self.stats.stop_why or "see the worker's log above"
                    raise SupervisorError(
                        f"worker exited with code {rc} ({why}): the run cannot "
                        f"go on; not restarting",
                        code=EXIT_FATAL,
                    )
                if self.stop_requested:
                    log.error("worker ended badly (%s, code %s) while stopping", outcome, rc)
                    return EXIT_FAILED
                ckpt = (self.stats.last_checkpoint or {}).get("step")
                if restarts and ckpt is not None and ckpt > self.resumed_step:
                    log.info(
                        "the worker wrote step_%06d.bin before it %s: it made progress, so "
                        "the restart count starts again (--max-restarts counts restarts in "
                        "a row that reach no new checkpoint)",
                        ckpt,
                        outcome,
                    )
                    restarts = 0
                restarts += 1
                if restarts > self.opts.max_restarts:
                    raise SupervisorError(
                        f"worker {outcome} (code {rc}) and {self.opts.max_restarts} restarts are "
                        "used up; see logs/ for the cause, fix it, then run again"
                    )
                delay = min(30.0, self.opts.backoff * 2 ** (restarts - 1))
                log.warning(
                    "worker %s (code %s): restart %d of %d in %.1f s from the newest "
                    "valid checkpoint",
                    outcome,
                    rc,
                    restarts,
                    self.opts.max_restarts,
                    delay,
                )
                self._sleep(delay)
                if self.stop_requested:
                    clean = True
                    return 0
        except OSError as e:  # a run file could not be written: the disk is full, say
            if (line := storage_failure(e)) is None:
                raise
            self._stop_worker_now()  # its unfiled reports stay in .reports.jsonl for the next start
            storage_failed = True
            raise SupervisorError(line) from None
        finally:
            if self.node is not None:  # followers exit once they see it
                write_job(
                    self.layout,
                    {
                        **self._job(),
                        "state": "done",
                        "clean": clean,
                        "why": self.stop_requested or "the run ended",
                    },
                )
                self.node.leave()
            history.close()
            try:
                if not storage_failed:  # said once, by the error above
                    self._write_status(force=True, alive=False)
            except OSError as e:
                log.error("%s", storage_failure(e) or e)
            self.watch.close(self.stats.step)  # TensorBoard closed, run summary logged

    def _stop_worker_now(self) -> None:
        """SIGTERM (and SIGCONT) to a running worker; SIGKILL to its group past --stop-timeout."""
        if self.proc is None or self.proc.poll() is not None:
            return
        log.info("asking worker pid %d to stop", self.proc.pid)
        self._signal_worker(signal.SIGTERM)
        self._signal_worker(signal.SIGCONT)
        try:
            self.proc.wait(timeout=self.opts.stop_timeout)
        except subprocess.TimeoutExpired:
            self._kill_group()

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stop_requested:
            time.sleep(0.05)

    def _incarnation(self, history: LossHistory) -> tuple[str, int | None]:
        try:
            plan = plan_resume(self.layout, self.cfg, history, self.opts.from_scratch)
        except ResumeError as e:
            raise SupervisorError(str(e), code=e.code) from None
        step, mix = plan.step, plan.mix
        if self.opts.replan and not self._replanned:
            self._replan(step)
        self.pivot_step = plan.pivot_step
        self.watch.on_incarnation(step)  # ETA window restarts; TensorBoard purges steps > step
        samples = SamplesLog(
            self.layout.samples,
            {"label": mix.phase.label, "index": mix.phase.index},
            self.opts.samples_keep,
        )
        samples.trim_after(step, self.layout.archive / "rewound-samples.json")
        reset_handshake(self.layout)
        self._post_policies(mix, policy_period(step + 1, self.cfg.probe_every))
        # the EMA over the history's tail, as `status` computes it, so the two agree
        ema = LossEma.over(tail_records(self.layout.loss))
        self.stats = LiveStats(step=step, ema=ema.value, ema_state=ema)
        self.resumed_step = step  # the step this incarnation resumed from
        self.filer = ReportFiler(
            self.layout,
            self.cfg,
            history,
            mix,
            samples,
            self.stats,
            self.max_steps,
            self.opts.print_every,
            self.collapse,
            self.pending_events,
            self.watch,
        )
        if step >= self.max_steps:
            log.info("step %d already reaches --max-steps %d: nothing to do", step, self.max_steps)
            return "done", 0
        if self.stop_requested or (self.node is not None and not self._gather_nodes()):
            return "done", 0  # a stop came before or while the nodes gathered
        log.info(
            "starting worker: %s", f"resume from {plan.path.name}" if plan.path else "fresh run"
        )
        self.stats.new_worker()  # hello and "stopped" are per worker, not per proxy
        self.proc = self._spawn(plan.path, plan.verified)
        log.debug(
            "start-up: worker %d spawned %.3f s after the proxy's launch",
            self.proc.pid,
            seconds_since_start() or 0.0,
        )
        return self._watch(mix, history)

    # ------------------------------------------------------------------ watching
    def _signal_worker(self, sig: int) -> bool:
        """Signal the worker; under torchrun the ranks directly (proxy/supervision/launch.py),
        never the agent once they are known. False when a SIGUSR1 has no rank to go to yet."""
        if self.opts.launch.uses_torchrun:
            pids = self._rank_pids()
            if pids:
                signal_pids(pids, sig)
                return True
            if sig == signal.SIGUSR1:
                return False  # the agent would take it as "stop all": keep it pending
        signal_pids([self.proc.pid], sig)
        return True

    def _signal_tree(self, sig: int) -> None:
        """`sig` to the worker's process group (its own session), or to the ranks under torchrun."""
        if self.opts.launch.uses_torchrun:
            self._signal_worker(sig)
        else:
            proc_tree.signal_group(self.proc.pid, sig)

    def _who(self) -> str:
        """The worker's processes with their state, for 'which process did not answer'."""
        pids = group_members(self.proc.pid) or [self.proc.pid]
        if self.opts.launch.uses_torchrun:
            pids = sorted(set(pids) | set(self._rank_pids()))
        return "; ".join(proc_tree.describe(p) for p in pids)

    def _kill_group(self) -> None:
        ranks = (
            self._rank_pids() + agent_descendants(self.proc.pid)
            if self.opts.launch.uses_torchrun
            else []
        )
        kill_agent(self.proc.pid, ranks)

    def _forward_usr1(self) -> None:
        """Forward pending SIGUSR1s to the worker: a single one at once (blocked until its
        handler is in, they coalesce: docs/signals.md#coalescing); under torchrun, held until
        the ranks announce their pids (the agent would take SIGUSR1 as "stop all")."""
        while self.usr1_pending and (
            not self.opts.launch.uses_torchrun or self.stats.worker is not None
        ):
            if not self._signal_worker(signal.SIGUSR1):
                break  # torchrun ranks not announced yet: forwarded once they are
            self.usr1_pending -= 1
            log.info("SIGUSR1 received: forwarded to worker pid %d", self.proc.pid)

    def _outcome(
        self, rc: int, hung: bool, stop_sent: bool, history: LossHistory
    ) -> tuple[str, int | None]:
        """What the worker's exit with code `rc` means: "hung", "pivot" (stopped at a pivot's
        boundary B: the new phase starts in this proxy), "withdrawn" (stopped for a pivot
        withdrawn meanwhile: a new worker goes on in the same phase), "done", "fatal" (do not
        restart) or "crashed" (restart from the newest valid checkpoint)."""
        if hung:
            return "hung", rc
        if rc == 0:
            b = self._pivot_boundary()
            if b is not None and history.last_step == b and not self.stop_requested:
                return "pivot", b
            if (
                (self.stats.stop_why or "").startswith("pivot ")
                and (history.last_step or 0) < self.max_steps
                and not self.stop_requested
            ):  # it stopped for a pivot withdrawn after it had decided to (`pivot --withdraw`)
                return "withdrawn", history.last_step
            if self.node is not None and not self.stop_requested:
                self._nodes_t = 0.0
                self._nodes_tick()  # a follower's proxy killed: its ranks stopped with ours
                if self.node_lost and (history.last_step or 0) < self.max_steps:
                    log.error(
                        "the ranks stopped cleanly but %s: the job restarts from the "
                        "newest valid checkpoint once every node is back",
                        self.node_lost,
                    )
                    return "crashed", rc
            self._pivot_move(fail_unserved, self.layout, history.last_step or 0, self.max_steps)
            return "done", 0
        if rc == EXIT_FATAL or self.stats.exit_code == EXIT_FATAL:
            return "fatal", rc  # (torchrun reports a rank's code 3 as its own 1)
        torchrun = self.opts.launch.uses_torchrun
        if not (self.stop_requested and stop_sent):
            return "crashed", rc
        if rc == -signal.SIGTERM or (torchrun and self.stats.worker is None):
            if self.stats.worker is None:
                log.info("worker stopped by SIGTERM before it was ready; nothing was lost")
            elif self.stats.exit_code is not None:  # it had stopped, checkpoint written
                log.info(
                    "worker had already stopped (%s) when the SIGTERM reached it as it "
                    "exited; nothing was lost",
                    self.stats.stop_why,
                )
            else:
                log.warning(
                    "worker ended by SIGTERM (code %d) without its handler; steps "
                    "after the newest checkpoint are trained again on resume",
                    rc,
                )
        elif torchrun and self.stats.exit_code == 0:
            # a scheduler signalled every process (Slurm's pre-emption): rank 0 stopped cleanly
            # with its checkpoint, the agent's own code is that of the signal it got
            log.info(
                "the ranks stopped cleanly (%s); torchrun's agent exited with code %d, "
                "having got the stop signal itself; nothing was lost",
                self.stats.stop_why,
                rc,
            )
        else:
            return "crashed", rc
        return "done", 0

    def _watch(self, mix: MixtureController, history: LossHistory) -> tuple[str, int | None]:
        reader = ReportReader(self.layout)
        posted_next = mix.next_period
        last_report = time.monotonic()
        stop_sent_at: float | None = None
        hung = False
        while True:
            if self.stop_requested and stop_sent_at is None:
                log.info(
                    "%s received: asking worker pid %d to checkpoint and stop",
                    self.stop_requested,
                    self.proc.pid,
                )
                self._signal_worker(signal.SIGTERM)
                # a worker paused by SIGSTOP (an operator, a debugger, a job-control ^Z) can only
                # act on the SIGTERM once continued; a running one ignores SIGCONT
                self._signal_worker(signal.SIGCONT)
                stop_sent_at = time.monotonic()
            self._forward_usr1()
            reports = reader.read()
            if reports:
                last_report = time.monotonic()
            self._file_reports(reports)
            if self.pivot_step is not None and (history.last_step or 0) > self.pivot_step:
                if self._pivot_move(
                    mark_running, self.layout, self.pivot_step, self.proc.pid, self.pivot_step + 1
                ):
                    self.pivot_step = None
            if not self.stop_requested:  # `proxy pivot` on this live run
                self._pivot_move(
                    poll_pivot_request,
                    self.layout,
                    self.cfg,
                    history.last_step or 0,
                    self.max_steps,
                )
            if mix.next_period != posted_next:
                posted_next = mix.next_period
                self._post_policies(
                    mix, policy_period(mix.folded_through + 1, self.cfg.probe_every) - 1
                )
            rc = self.proc.poll()
            if rc is not None:
                self._file_reports(reader.read())  # what it wrote after the last read
                history.flush()
                if self.opts.launch.uses_torchrun:  # nothing may outlive the agent
                    reap_leftover_ranks(
                        self.node.ranks if self.node is not None else rank_pids(self.layout),
                        str(self.layout.root),
                    )
                if self.node is not None:  # followers give their ranks --stop-timeout, then kill
                    write_job(self.layout, {**self._job(), "state": "ended", "agent_exit": rc})
                    self.node.write(agent_pid=None, agent_exit=rc, ranks=[])
                return self._outcome(rc, hung, stop_sent_at is not None, history)
            now = time.monotonic()
            if stop_sent_at is not None and now - stop_sent_at > self.opts.stop_timeout:
                log.error(
                    "worker did not exit %.0f s after SIGTERM; not answering: %s; killing "
                    "its process group (SIGKILL)",
                    self.opts.stop_timeout,
                    self._who(),
                )
                self._kill_group()
                stop_sent_at = math.inf
            limit = max(self.opts.hang_timeout, STARTUP_GRACE_S if self.stats.worker is None else 0)
            if not hung and stop_sent_at is None and now - last_report > limit:
                log.error(
                    "worker sent no report for %.0f s (hung?): %s; stopping its process "
                    "group (SIGTERM + SIGCONT, SIGKILL after %.0f s)",
                    limit,
                    self._who(),
                    self.opts.stop_timeout,
                )
                hung = True
                self._signal_tree(signal.SIGTERM)
                self._signal_tree(signal.SIGCONT)
                stop_sent_at = now
            if self.node is not None:
                self._nodes_tick()
            if self.subreaper or os.getpid() == 1:  # orphans re-parented to us
                proc_tree.reap_orphans({self.proc.pid})
            self._write_status()
            # Every wake-up takes CPU from the worker (on a 2-core box torch's threads feel it):
            # poll fast only while something is happening.
            time.sleep(
                0.02
                if (reports or self.stop_requested or self.usr1_pending or stop_sent_at is not None)
                else POLL_IDLE_S
            )

    def _file_reports(self, reports: list[dict]) -> None:
        """File each report; a pivot checkpoint at another step than the B posted moves the
        request there (the worker was past B, docs/pivots.md#the-boundary)."""
        for r in reports:
            self.filer.file(r)
            if r.get("type") != "checkpoint_started":
                continue
            if r.get("reason") == "pivot":  # deferred: pivot_due serves it again
                self._pivot_move(follow_worker_boundary, self.layout, r["step"])
            if self._pivot_boundary() == r["step"]:
                pivot_fault("during-checkpoint")  # crash test hook (docs/pivots.md)

    def _pivot_move(self, move: Callable[..., Any], *args: Any) -> bool:
        """Call a move of the pivot state machine (proxy/supervision/pivots.py); True when it
        ran. When another process holds `.pivot.request.lock` past MOVE_LOCK_TIMEOUT_S (a
        `pivot` command suspended inside it, say), return False and warn at most every 30 s: the
        watch loop goes on and the move is tried again (docs/pivots.md#withdrawing-a-pivot)."""
        try:
            move(*args)
            return True
        except RequestLockTimeout as e:
            now = time.monotonic()
            if now - self._lock_warned_at > 30.0:
                self._lock_warned_at = now
                log.warning("pivot %s deferred: %s", move.__name__.replace("_", " "), e)
            return False

    def _pivot_boundary(self) -> int | None:
        """B of a pivot request whose boundary is posted, else None."""
        req = pending_request(self.layout)
        return req.get("step") if req and req.get("state") == "boundary" else None

    def _write_status(self, force: bool = False, alive: bool = True) -> None:
        now = time.monotonic()
        if not force and now - self._status_t < 1.0:
            return
        self._status_t = now
        pid = self.proc.pid if self.proc and self.proc.poll() is None else None
        write_status(self.layout, self.stats, self.max_steps, pid, alive)
