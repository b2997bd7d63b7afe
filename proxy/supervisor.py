"""Supervision of the worker (SPEC section 6): spawn, forward signals, file reports, restart.

One incarnation = resolve the resume point, make the history and the bandit describe exactly that
checkpoint, post the policies, spawn `python -m worker` (argv list, no shell, its own session),
then watch: file every report into the sidecars, forward signals, detect crash and hang. A worker
that exits non-zero or hangs is restarted from the newest valid checkpoint with back-off, up to
`max_restarts`; SIGTERM/SIGINT/SIGHUP to the proxy stop the worker cleanly and exit 0.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from proxy.collapse_watch import CollapseWatch
from proxy.launch import LaunchOptions, agent_descendants, kill_ranks, rank_pids, \
    reap_leftover_ranks, signal_pids, torchrun_argv
from proxy import proc_tree
from proxy.mixture import MixtureController, Phase
from proxy.report_salvage import salvage_step_reports
from proxy.run_watch import RunWatch
from proxy.sample_format import format_audit
from proxy.pivot import poll_pivot_request
from proxy.zombies import handle_zombies
from proxy.run_setup import read_phases, write_phases
from proxy.sidecars import SamplesLog, read_json_tolerant, write_state
from shared.arm_data import read_arm_index
from shared.atomic_io import atomic_write_json
from shared.checkpoint_format import clean_stale_temporaries, find_latest_valid
from shared.checkpoint_manifest import manifest_checksums, read_manifest
from shared.config import RunConfig
from shared.handshake import ReportReader, policy_period, reset_handshake, update_handshake
from proxy.state_snapshots import append_snapshot, find_snapshot, mark_rewound
from shared.loss_history import LossHistory, read_records, read_records_after
from shared.run_layout import RunLayout

log = logging.getLogger("proxy")

STARTUP_GRACE_S = 300.0     # before its hello a worker may be importing torch / compiling
POLL_IDLE_S = 0.1            # proxy loop period when no report arrived (seconds)
EXIT_FATAL_WORKER = 3       # worker/trainer.py EXIT_FATAL: do not restart
PROJECT_ROOT = Path(__file__).resolve().parent.parent


class SupervisorError(RuntimeError):
    """The run cannot go on; the message says why and what to do. Exit code 1 or 2."""

    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code


@dataclass
class ProxyOptions:
    """Options of `python -m proxy run` that are not part of run.json (they may differ per start)."""

    max_steps: int | None = None       # None: run.json's
    usr1_at: str = "step"
    device: str = "auto"
    keep_last: int = 3
    keep_every: int = 10000
    max_restarts: int = 3
    hang_timeout: float = 300.0        # seconds without a report before the worker counts as hung
    stop_timeout: float = 120.0        # seconds a stopping worker gets before SIGKILL
    print_every: int = 10              # steps between progress lines
    samples_keep: int = 50             # audits kept in .samples.json
    from_scratch: bool = False         # allow step 0 when history exists but no checkpoint does
    pivot: dict | None = None          # {"label", "caps", "floors"}: start a new phase at resume
    backoff: float = 1.0               # first restart delay, seconds (doubles, max 30)
    stop_at_step: int | None = None    # ask the worker to checkpoint and stop here (pivot)
    stop_on_collapse: bool = False     # the collapse alarm also stops the run (issue 5)
    launch: LaunchOptions = field(default_factory=LaunchOptions)  # torchrun (issue 6)
    compile: bool = False              # torch.compile in the worker (issue 6)
    precision: str = "auto"            # worker --precision: auto (bf16 on CUDA), fp32, bf16
    tensorboard: bool = False          # live event files under RUN/tensorboard/ (issue 12)


@dataclass
class LiveStats:
    step: int = 0
    loss: float | None = None
    ema: float | None = None
    tok_per_s: float | None = None
    last_checkpoint: dict | None = None
    recent: list = field(default_factory=list)


class Supervisor:
    def __init__(self, layout: RunLayout, cfg: RunConfig, opts: ProxyOptions) -> None:
        self.layout, self.cfg, self.opts = layout, cfg, opts
        self.max_steps = opts.max_steps or cfg.max_steps
        self.arm_changes: list = []  # data/arms.json's arm-change log, stamped per incarnation
        self.stop_requested: str | None = None
        self.usr1_pending = 0
        self.stats = LiveStats()
        self.proc: subprocess.Popen | None = None
        self._status_t = 0.0
        self._worker_exit_code: int | None = None  # from the worker's "stopped" event
        self.pending_events: list[dict] = []  # attached to the next step record filed (issue 4)
        self.watch = RunWatch(layout, cfg, self.max_steps, opts.tensorboard)  # issue 12

    # ------------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT/SIGHUP -> stop the worker cleanly; SIGUSR1 -> forward. Takes over the
        signals proxy_tree.EarlySignals caught during start-up, and makes the proxy a child
        subreaper so orphans of the worker's tree are re-parented to it and reaped (PID 1 too)."""
        def on_stop(signum, frame):
            if self.stop_requested is None:
                self.stop_requested = signal.Signals(signum).name

        def on_usr1(signum, frame):
            self.usr1_pending += 1

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, on_stop)
        signal.signal(signal.SIGUSR1, on_usr1)
        early_stop, early_usr1 = proc_tree.EarlySignals.take()
        if early_stop and self.stop_requested is None:
            self.stop_requested = early_stop
            log.info("%s received during start-up: no worker will be started", early_stop)
        self.usr1_pending += early_usr1
        self.subreaper = proc_tree.become_subreaper()

    # ------------------------------------------------------------------ resume point
    def _resolve_resume(self, history: LossHistory) -> tuple[int, Path | None]:
        root = self.layout.root
        for p in clean_stale_temporaries(root):
            log.info("removed stale temporary %s", p.name)
        from shared.checkpoint_format import CheckpointError, quarantine_checkpoint, \
            scan_for_resume
        checks = manifest_checksums(read_manifest(root))
        info, rejected = scan_for_resume(root, self.cfg.n_params, checks)
        for err in rejected:  # one line per rejected file, with the rule it broke (SPEC 4)
            log.warning("rejected %s (rule: %s): %s", err.path.name, err.rule, err)
        if rejected and (info is not None or self.opts.from_scratch or not history.last_step):
            # Training will pass these steps again: move them where neither the new file of
            # the same step nor retention can touch them (kept, never deleted).
            for err in rejected:
                try:
                    dest = quarantine_checkpoint(err.path)
                    log.warning("kept rejected %s as %s", err.path.name, dest.relative_to(root))
                except CheckpointError as e:
                    log.error("%s", e)
        if info is None:
            if history.last_step and not self.opts.from_scratch:
                raise SupervisorError(
                    f"{root}: the history holds {len(history):,} records (to step "
                    f"{history.last_step:,}) but no valid checkpoint exists"
                    + (f" ({len(rejected)} rejected, see above)" if rejected else "")
                    + "; restore a checkpoint, or pass --from-scratch to start again from step 0 "
                    "(the history past 0 is then moved to .loss.rewound.json); rejected files "
                    "stay where they are", code=2)
            return 0, None
        if rejected:
            log.warning("resuming from %s instead", info.path.name)
        return info.step, info.path

    def _align_history(self, history: LossHistory, step: int) -> None:
        if history.last_step is not None and history.last_step > step:
            n = history.rewind(step, self.layout.loss_rewound,
                               f"resumed from step {step}; records past it moved aside")
            log.warning("%s: %d records past step %d moved to %s (they do not match the "
                        "checkpoint loaded)", self.layout.loss.name, n, step,
                        self.layout.loss_rewound.name)
            mark_rewound(self.layout, step)
        elif (history.last_step or 0) < step:
            log.warning("%s ends at step %s but the checkpoint is step %d: the history has a gap",
                        self.layout.loss.name, history.last_step, step)

    def _prepare_mixture(self, step: int) -> MixtureController:
        every = read_phases(self.layout)
        phases = [p for p in every if p.start_step <= step] or every[:1]
        if len(phases) < len(every):  # resumed from before a pivot: those phases never happened
            gone = [p for p in every if p not in phases]
            log.warning("resuming from step %d, before the start of phase(s) %s: removed from %s "
                        "(their archives stay under archive/)", step,
                        ", ".join(f"{p.index} {p.label!r} at step {p.start_step}" for p in gone),
                        self.layout.phases.name)
            write_phases(self.layout, phases)
        mix = self._rebuild(phases[-1], step)
        self._arms_changed_now = mix.apply_changes(step)
        if self.opts.pivot is not None:
            pv = self.opts.pivot
            self.opts.pivot = None  # once: a restart after this resumes inside the new phase
            new = Phase(index=phases[-1].index + 1, label=pv["label"], start_step=step,
                        caps=pv["caps"], floors=pv["floors"],
                        prior=mix.bandit.probabilities(),
                        lifetime_pulls={**{a: r["pulls_lifetime"]
                                           for a, r in mix.bandit.retired.items()},
                                        **mix.bandit.pulls_lifetime})
            self._archive_phase(step)
            phases.append(new)
            write_phases(self.layout, phases)
            log.info("pivot: phase %d %r starts at step %d with caps %s floors %s",
                     new.index, new.label, step, new.caps, new.floors)
            mix = self._replay(new, [])
        return mix

    def _rebuild(self, phase: Phase, step: int) -> MixtureController:
        """The controller as it was after update `step`: from the newest snapshot at or before
        `step` plus the records after it, else by replaying the phase from its start."""
        t0 = time.perf_counter()
        snap = find_snapshot(self.layout, phase.index, phase.start_step, step)
        if snap is not None:
            mix = self._replay(phase, [])
            mix.restore(snap)
            records = read_records_after(self.layout.loss, snap["step"], step)
        else:
            mix = self._replay(phase, [])
            records = read_records(self.layout.loss, phase.start_step + 1, step)
        for r in records:
            mix.observe(r)
        log.info("bandit rebuilt at step %d in %.2f s (%s, %d records replayed)", step,
                 time.perf_counter() - t0,
                 f"from the step-{snap['step']} snapshot" if snap else "from the phase start",
                 len(records))
        return mix

    def _replay(self, phase: Phase, records: list[dict]) -> MixtureController:
        names = sorted(read_arm_index(self.layout, include_retired=True))
        mix = MixtureController(names, phase, self.cfg.reward, self.cfg.bandit_warmup,
                                self.cfg.probe_every, self.arm_changes)
        for r in records:
            mix.observe(r)
        return mix

    def _archive_phase(self, step: int) -> None:
        dest = self.layout.pivot_archive(step)
        dest.mkdir(parents=True, exist_ok=True)
        for p in (self.layout.samples, self.layout.state):
            if p.exists():
                p.replace(dest / p.name)
        log.info("archived .samples.json and .state.json to %s", dest)

    # ------------------------------------------------------------------ one incarnation
    def _spawn(self, resume: Path | None) -> subprocess.Popen:
        o = self.opts
        argv = [sys.executable, "-m", "worker", "--run-dir", str(self.layout.root),
                "--max-steps", str(self.max_steps), "--usr1-at", o.usr1_at, "--device", o.device,
                "--parent-pid", str(os.getpid()), "--keep-last", str(o.keep_last),
                "--keep-every", str(o.keep_every)]
        if resume is not None:
            argv += ["--resume-from", str(resume)]
        if o.compile:
            argv.append("--compile")
        if o.precision != "auto":
            argv += ["--precision", o.precision]
        self._worker_exit_code = None
        if o.launch.uses_torchrun:  # ranks watch the proxy's pid (--parent-pid), not the agent
            argv = torchrun_argv(sys.executable, argv[3:], o.launch)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        with proc_tree.signals_blocked(not o.launch.uses_torchrun):  # worker unblocks them
            return subprocess.Popen(argv, env=env, start_new_session=True, close_fds=True)

    def _post_policies(self, mix: MixtureController, first_period: int) -> None:
        pols = mix.policies_from(first_period)
        update_handshake(self.layout, lambda d: d.__setitem__("policies", pols))

    def run(self) -> int:
        """Supervise until the run finishes or is stopped; returns the exit code."""
        history = LossHistory(self.layout.loss)
        for msg in history.repairs:
            log.warning("%s", msg)
        salvage_step_reports(self.layout, history, read_phases(self.layout))  # a dead proxy's
        if self.max_steps != self.cfg.max_steps:
            log.warning("!!! --max-steps %d differs from the %d planned at creation (run.json): the "
                        "learning-rate schedule stays the planned one (warm-up %d, cosine to step "
                        "%d, flat after); recorded in .loss.json as an event !!!", self.max_steps,
                        self.cfg.max_steps, self.cfg.warmup_steps, self.cfg.lr_decay_steps)
            self.pending_events.append({
                "event": "max-steps-changed", "max_steps": self.max_steps,
                "planned_max_steps": self.cfg.max_steps, "lr_decay_steps": self.cfg.lr_decay_steps,
                "warmup_steps": self.cfg.warmup_steps, "time": time.time()})
        restarts = 0
        try:
            while True:
                outcome, rc = self._incarnation(history)
                if outcome == "done":
                    return 0
                if outcome == "fatal":
                    why = getattr(self, "_worker_stop_why", None) or "see the worker's log above"
                    raise SupervisorError(f"worker exited with code {rc} ({why}): the run cannot "
                                          f"go on; not restarting")
                if self.stop_requested:
                    log.error("worker ended badly (%s, code %s) while stopping", outcome, rc)
                    return 1
                restarts += 1
                if restarts > self.opts.max_restarts:
                    raise SupervisorError(
                        f"worker {outcome} (code {rc}) and {self.opts.max_restarts} restarts are "
                        "used up; see logs/ for the cause, fix it, then run again")
                delay = min(30.0, self.opts.backoff * 2 ** (restarts - 1))
                log.warning("worker %s (code %s): restart %d of %d in %.1f s from the newest "
                            "valid checkpoint", outcome, rc, restarts, self.opts.max_restarts, delay)
                self._sleep(delay)
                if self.stop_requested:
                    return 0
        finally:
            history.close()
            self._write_status(force=True, alive=False)
            self.watch.close(self.stats.step)  # TensorBoard closed, run summary logged

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stop_requested:
            time.sleep(0.05)

    def _incarnation(self, history: LossHistory) -> tuple[str, int | None]:
        step, resume = self._resolve_resume(history)
        self._align_history(history, step)
        self.watch.on_incarnation(step)  # ETA window restarts; TensorBoard purges steps > step
        self.arm_changes = handle_zombies(self.layout, self.cfg.arms, step)  # SPEC 7; issue 5
        self.collapse = CollapseWatch(self.layout, self.opts.stop_on_collapse)
        mix = self._prepare_mixture(step)
        self._check_state_file(mix, step)
        samples = SamplesLog(self.layout.samples, {"label": mix.phase.label, "index": mix.phase.index},
                             self.opts.samples_keep)
        samples.trim_after(step, self.layout.archive / "rewound-samples.json")
        reset_handshake(self.layout)
        if self.opts.stop_at_step is not None:
            stop_at = self.opts.stop_at_step
            update_handshake(self.layout, lambda d: d["control"].update(
                stop_at_step=stop_at, reason="pivot"))
        self._post_policies(mix, policy_period(step + 1, self.cfg.probe_every))
        self.stats = LiveStats(step=step, ema=self._history_ema())
        if step >= self.max_steps:
            log.info("step %d already reaches --max-steps %d: nothing to do", step, self.max_steps)
            return "done", 0
        if self.stop_requested:
            return "done", 0
        log.info("starting worker: %s", f"resume from {resume.name}" if resume else "fresh run")
        self.proc = self._spawn(resume)
        return self._watch(mix, samples, history)

    def _history_ema(self) -> float | None:
        """The loss EMA over the history's tail, as `status` computes it, so the progress line
        and `status` agree after a restart."""
        from proxy.status import loss_ema, tail_records
        return loss_ema(tail_records(self.layout.loss))

    def _check_state_file(self, mix: MixtureController, step: int) -> None:
        st = read_json_tolerant(self.layout.state, None)
        replayed = mix.bandit.to_dict()
        if st is None:
            return
        if st.get("step") != step or st.get("phase", {}).get("index") != mix.phase.index:
            log.warning("%s describes step %s, not the loaded checkpoint's step %d: rebuilt by "
                        "replaying the history", self.layout.state.name, st.get("step"), step)
            write_state(self.layout.state, replayed)
        elif st != replayed and getattr(self, "_arms_changed_now", None):
            log.info("%s at step %d updated for the arm changes (%s)", self.layout.state.name,
                     step, ", ".join(self._arms_changed_now))
            write_state(self.layout.state, replayed)
        elif st != replayed:
            log.warning("%s differs from the replay of the history at step %d; the replay wins",
                        self.layout.state.name, step)
            write_state(self.layout.state, replayed)

    # ------------------------------------------------------------------ watching
    def _signal_worker(self, sig: int) -> bool:
        """Signal the worker; under torchrun the ranks directly (proxy/launch.py), never the
        agent once they are known. Returns False when a SIGUSR1 has no rank to go to yet."""
        if self.opts.launch.uses_torchrun:
            pids = rank_pids(self.layout)
            if pids:
                signal_pids(pids, sig)
                return True
            if sig == signal.SIGUSR1:
                return False  # the agent would take it as "stop all": keep it pending
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        return True

    def _signal_tree(self, sig: int) -> None:
        """`sig` to the worker's whole process group (its own session), or to the ranks under
        torchrun."""
        if self.opts.launch.uses_torchrun:
            self._signal_worker(sig)
        else:
            proc_tree.signal_group(self.proc.pid, sig)

    def _who(self) -> str:
        """The worker's processes with their state, for 'which process did not answer'."""
        pids = proc_tree.group_members(self.proc.pid) or [self.proc.pid]
        if self.opts.launch.uses_torchrun:
            pids = sorted(set(pids) | set(rank_pids(self.layout)))
        return "; ".join(proc_tree.describe(p) for p in pids)

    def _kill_group(self) -> None:
        ranks = (rank_pids(self.layout) + agent_descendants(self.proc.pid)
                 if self.opts.launch.uses_torchrun else [])
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_ranks(ranks)  # torchrun starts each rank in its own session

    def _watch(self, mix: MixtureController, samples: SamplesLog,
               history: LossHistory) -> tuple[str, int | None]:
        reader = ReportReader(self.layout)
        snapshots: dict[int, dict] = {}
        posted_next = mix._next
        last_report = time.monotonic()
        stop_sent_at: float | None = None
        hung = False
        while True:
            if self.stop_requested and stop_sent_at is None:
                log.info("%s received: asking worker pid %d to checkpoint and stop",
                         self.stop_requested, self.proc.pid)
                self._signal_worker(signal.SIGTERM)
                stop_sent_at = time.monotonic()
            while self.usr1_pending and (not self.opts.launch.uses_torchrun
                                         or getattr(self.stats, "worker", None) is not None):
                # A single worker starts with SIGUSR1 blocked (proc_tree.signals_blocked) and
                # unblocks it once its handler is in: forward at once, so signals sent during
                # start-up coalesce in the kernel into one request. torchrun's agent would treat
                # SIGUSR1 as "stop all": held until the ranks announce their pids (issue 4, 6).
                if not self._signal_worker(signal.SIGUSR1):
                    break  # torchrun ranks not announced yet: forwarded once they are
                self.usr1_pending -= 1
                log.info("SIGUSR1 received: forwarded to worker pid %d", self.proc.pid)
            reports = reader.read()
            if reports:
                last_report = time.monotonic()
            for r in reports:
                self._file_report(r, mix, samples, history, snapshots)
            poll_pivot_request(self.layout, self.cfg, history.last_step or 0)  # `proxy pivot`
            if mix._next != posted_next:
                posted_next = mix._next
                self._post_policies(mix, policy_period(mix.folded_through + 1, self.cfg.probe_every) - 1)
            rc = self.proc.poll()
            if rc is not None:
                for r in reader.read():
                    self._file_report(r, mix, samples, history, snapshots)
                history.flush()
                if self.opts.launch.uses_torchrun:  # nothing may outlive the agent
                    reap_leftover_ranks(rank_pids(self.layout), str(self.layout.root))
                if hung:
                    return "hung", rc
                if rc == 0:
                    return "done", 0
                if rc == EXIT_FATAL_WORKER or self._worker_exit_code == EXIT_FATAL_WORKER:
                    return "fatal", rc  # (torchrun reports a rank's code 3 as its own 1)
                if self.stop_requested and stop_sent_at is not None and (
                        rc == -signal.SIGTERM or (self.opts.launch.uses_torchrun
                                                  and getattr(self.stats, "worker", None) is None)):
                    if getattr(self.stats, "worker", None) is None:
                        log.info("worker stopped by SIGTERM before it was ready; nothing was lost")
                    else:
                        log.warning("worker ended by SIGTERM (code %d) without its handler; steps "
                                    "after the newest checkpoint are trained again on resume", rc)
                    return "done", 0
                return "crashed", rc
            now = time.monotonic()
            if stop_sent_at is not None and now - stop_sent_at > self.opts.stop_timeout:
                log.error("worker did not exit %.0f s after SIGTERM; not answering: %s; killing "
                          "its process group (SIGKILL)", self.opts.stop_timeout, self._who())
                self._kill_group()
                stop_sent_at = math.inf
            ready = getattr(self.stats, "worker", None) is not None
            limit = self.opts.hang_timeout if ready else max(self.opts.hang_timeout, STARTUP_GRACE_S)
            if not hung and stop_sent_at is None and now - last_report > limit:
                log.error("worker sent no report for %.0f s (hung?): %s; stopping its process "
                          "group (SIGTERM + SIGCONT, SIGKILL after %.0f s)", limit, self._who(),
                          self.opts.stop_timeout)
                hung = True
                self._signal_tree(signal.SIGTERM)
                self._signal_tree(signal.SIGCONT)
                stop_sent_at = now
            if getattr(self, "subreaper", False) or os.getpid() == 1:  # orphans re-parented to us (issue 4)
                proc_tree.reap_orphans({self.proc.pid})
            self._write_status()
            # Every wake-up takes CPU from the worker (on a 2-core box torch's threads feel it):
            # poll fast only while something is happening.
            time.sleep(0.02 if (reports or self.stop_requested or self.usr1_pending
                                or stop_sent_at is not None) else POLL_IDLE_S)

    def _file_report(self, r: dict, mix: MixtureController, samples: SamplesLog,
                     history: LossHistory, snapshots: dict) -> None:
        kind = r.get("type")
        self.watch.on_report(r)  # TensorBoard: checkpoints and audits (issue 12)
        if kind == "step":
            rec = {k: v for k, v in r.items() if k != "type"}
            rec["phase"] = {"label": mix.phase.label, "index": mix.phase.index}
            self.collapse.annotate(rec)
            if history.last_step is not None and rec["step"] <= history.last_step:
                return  # already filed (a replayed report after a crash)
            if self.pending_events:  # e.g. a changed plan (issue 4): one record per step stays
                rec["events"], self.pending_events = self.pending_events, []
            history.append(rec)
            mix.observe(rec)
            self._progress(rec, mix)
        elif kind == "checkpoint_started":
            snapshots[r["step"]] = mix.to_snapshot()
        elif kind == "checkpoint":
            if r.get("error"):
                log.error("checkpoint step %d (%s) failed: %s", r["step"], r["reason"], r["error"])
                return
            history.flush()
            snap = snapshots.pop(r["step"], None)
            if snap is not None:
                write_state(self.layout.state, snap["bandit"])
                append_snapshot(self.layout, snap)
            self.stats.last_checkpoint = {"step": r["step"], "file": r["file"], "reason": r["reason"]}
            log.info("checkpoint %s (step %d, %s, %s bytes, %.2f s)", r["file"], r["step"],
                     r["reason"], f"{r['bytes']:,}", r["seconds"])
        elif kind == "audit":
            alarm = self.collapse.on_audit(r)
            samples.add(r)
            if alarm and self.opts.stop_on_collapse:
                at = max(r["step"], history.last_step or 0) + 1
                update_handshake(self.layout, lambda d: d["control"].update(
                    stop_at_step=at, reason="alarm"))
            for block in format_audit(r):  # prompt and text apart, real line breaks (issue 12)
                log.info("%s", block)
        elif kind == "hello":
            log.info("worker pid %d up: %s, %s parameters, resumed from step %d, world size %d",
                     r["pid"], r["device"], f"{r['n_params']:,}", r["resumed_from"], r["world_size"])
            self.stats.worker = r
        elif kind == "event":
            if r.get("event") == "stopped":
                self._worker_exit_code = r.get("exit_code")
                self._worker_stop_why = r.get("why")  # named in the fatal exit's message
            log.info("worker event: %s", {k: v for k, v in r.items() if k != "type"})

    def _progress(self, rec: dict, mix: MixtureController) -> None:
        s = self.stats
        s.step, s.loss = rec["step"], rec["loss"]
        if rec["loss"] is not None and math.isfinite(rec["loss"]):
            s.ema = rec["loss"] if s.ema is None else 0.95 * s.ema + 0.05 * rec["loss"]
        s.recent = (s.recent + [(rec.get("step_time") or 0.0)])[-20:]
        tokens_per_step = self.cfg.batch_size * self.cfg.model.block_size
        if s.recent and sum(s.recent) > 0:
            s.tok_per_s = tokens_per_step * len(s.recent) / sum(s.recent)
        self.watch.on_step(rec, s.ema)
        if rec["step"] % self.opts.print_every == 0 or rec["step"] == self.max_steps:
            print(self.watch.progress_line(rec, s), flush=True)  # elapsed, ETA (proxy/progress.py)

    def _write_status(self, force: bool = False, alive: bool = True) -> None:
        now = time.monotonic()
        if not force and now - self._status_t < 1.0:
            return
        self._status_t = now
        s = self.stats
        atomic_write_json(self.layout.root / ".status.json", {
            "proxy_pid": os.getpid(), "proxy_alive": alive,
            "worker_pid": self.proc.pid if self.proc and self.proc.poll() is None else None,
            "step": s.step, "max_steps": self.max_steps, "loss": s.loss, "loss_ema": s.ema,
            "tokens_per_s": s.tok_per_s, "last_checkpoint": s.last_checkpoint,
            "time": time.time()})
