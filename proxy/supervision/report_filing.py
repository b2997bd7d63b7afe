"""Report filing: every report the worker writes becomes a history record, a sidecar update, a
log line or a progress line (docs/handshake.md#reports, docs/architecture.md#the-run-directory).

  step               -> one `.loss.json` record (phase and collapse marks added, pending events
                        attached), folded into the mixture controller, a progress line
  checkpoint_started -> the controller's snapshot at that step, held until the file is durable
  checkpoint         -> `.state.json` and `.state.snapshots.jsonl` written with that snapshot
  audit              -> `.samples.json`, the collapse watch, log lines
  hello / event      -> what the worker is and why it stopped

What it is not: reading reports or the handshake (shared/run/handshake.py), the watch loop
(proxy/supervision/supervisor.py), the sidecars' formats (proxy/run_files/sidecars.py, shared/run/loss_history.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from proxy.mixture.collapse_watch import CollapseWatch
from proxy.mixture.controller import MixtureController
from proxy.observation.run_watch import RunWatch
from proxy.observation.sample_format import format_audit
from proxy.run_files.sidecars import SamplesLog, write_state
from proxy.run_files.state_snapshots import append_snapshot
from proxy.run_files.status_file import LiveStats
from shared.run.config import RunConfig
from shared.run.handshake import update_handshake
from shared.run.layout import RunLayout
from shared.run.loss_history import LossHistory

log = logging.getLogger("proxy")

PRINT_SECONDS = 30.0  # at most this long between progress lines (also with a large --print-every)


def print_seconds() -> float:
    """Seconds between progress lines at most: $ANDREA_PRINT_SECONDS, else PRINT_SECONDS."""
    try:
        return max(0.0, float(os.environ.get("ANDREA_PRINT_SECONDS", PRINT_SECONDS)))
    except ValueError:
        return PRINT_SECONDS


@dataclass
class ReportFiler:
    """Files the reports of one incarnation into the history, the controller and the sidecars.

    `history`: the open `.loss.json`; `mix`: the controller of the phase in force; `samples`:
    the phase's audit log; `pending_events`: events to attach to the next step record filed
    (one record per step stays; the list is emptied as they are attached)."""

    layout: RunLayout
    cfg: RunConfig
    history: LossHistory
    mix: MixtureController
    samples: SamplesLog
    stats: LiveStats
    max_steps: int
    print_every: int
    collapse: CollapseWatch  # the supervisor's: a hold outlives an incarnation
    pending_events: list[dict]
    watch: RunWatch  # progress line, TensorBoard, summary

    def __post_init__(self) -> None:
        self.snapshots: dict[int, dict] = {}  # step -> controller snapshot, until durable
        self._printed_at: float | None = None  # monotonic time of the last progress line
        self.lag_s, self.lag_steps = 0.0, 0.0  # the most a step report waited to be filed
        self.stats.policy = self.mix.bandit.explain()  # the policy before its first step

    def file(self, r: dict) -> None:
        """File one report (a dict with "type"); unknown types are ignored."""
        kind = r.get("type")
        self.watch.on_report(r)  # TensorBoard: checkpoints and audits
        if kind == "step":
            self._step(r)
        elif kind == "checkpoint_started":
            self.snapshots[r["step"]] = self.mix.to_snapshot()
        elif kind == "checkpoint":
            self._checkpoint(r)
        elif kind == "audit":
            self._audit(r)
        elif kind == "hello":
            log.info(
                "worker pid %d up: %s, %s parameters, resumed from step %d, world size %d",
                r["pid"],
                r["device"],
                f"{r['n_params']:,}",
                r["resumed_from"],
                r["world_size"],
            )
            self.stats.worker = r
        elif kind == "event":
            if r.get("event") == "stopped":
                self.stats.exit_code = r.get("exit_code")
                self.stats.stop_why = r.get("why")
                log.info(
                    "step reports filed at most %.3f s (%.1f steps) after the worker wrote "
                    "them; the worker waited for a policy %d time(s), %.3f s",
                    self.lag_s,
                    self.lag_steps,
                    r.get("policy_waits", 0),
                    r.get("policy_wait_s", 0.0),
                )
            log.info(
                "worker event %s: %s",
                r.get("event", "?"),
                " ".join(f"{k}={v}" for k, v in r.items() if k not in ("type", "event", "time")),
            )

    def _step(self, r: dict) -> None:
        rec = {k: v for k, v in r.items() if k != "type"}
        rec["phase"] = {"label": self.mix.phase.label, "index": self.mix.phase.index}
        self.collapse.annotate(rec)
        if self.history.last_step is not None and rec["step"] <= self.history.last_step:
            return  # already filed (a replayed report after a crash)
        if self.pending_events:  # e.g. a changed plan: one record per step stays
            rec["events"] = list(self.pending_events)
            self.pending_events.clear()
        self.history.append(rec)
        self._lag(rec)
        self.mix.observe(rec)
        self._progress(rec)

    def _lag(self, rec: dict) -> None:
        """The filing lag of step record `rec`: seconds since the worker stamped it, and in
        steps of its step time (docs/handshake.md#policy-periods-and-the-lag: under one period
        the worker never waits for a policy); steps of the median recent step time."""
        stamped = rec.get("time")
        if not isinstance(stamped, (int, float)):
            return
        lag = max(0.0, time.time() - stamped)
        self.lag_s = max(self.lag_s, lag)
        recent = sorted(self.stats.recent)  # the last 20 step times
        if recent and recent[len(recent) // 2] > 0:
            self.lag_steps = max(self.lag_steps, lag / recent[len(recent) // 2])

    def _checkpoint(self, r: dict) -> None:
        if r.get("error"):
            log.error("checkpoint step %d (%s) failed: %s", r["step"], r["reason"], r["error"])
            return
        self.history.flush()
        snap = self.snapshots.pop(r["step"], None)
        if snap is not None:
            write_state(self.layout.state, snap["bandit"])
            append_snapshot(self.layout, snap)
        self.stats.last_checkpoint = {"step": r["step"], "file": r["file"], "reason": r["reason"]}
        log.info(
            "checkpoint %s (step %d, %s, %s bytes, %.2f s)",
            r["file"],
            r["step"],
            r["reason"],
            f"{r['bytes']:,}",
            r["seconds"],
        )

    def _audit(self, r: dict) -> None:
        alarm = self.collapse.on_audit(r)
        self.samples.add(r)
        if alarm and self.collapse.stop_on_collapse:
            at = max(r["step"], self.history.last_step or 0) + 1
            update_handshake(
                self.layout, lambda d: d["control"].update(stop_at_step=at, reason="alarm")
            )
        for block in format_audit(r):  # prompt and text apart, real line breaks
            log.info("%s", block)

    def _progress(self, rec: dict) -> None:
        s = self.stats
        s.step, s.loss = rec["step"], rec["loss"]
        s.ema = s.ema_state.update(rec["loss"])
        s.recent = (s.recent + [(rec.get("step_time") or 0.0)])[-20:]
        tokens_per_step = self.cfg.batch_size * self.cfg.model.block_size
        if s.recent and sum(s.recent) > 0:
            s.tok_per_s = tokens_per_step * len(s.recent) / sum(s.recent)
        bandit = self.mix.bandit
        policy = None
        if rec["step"] % bandit.period_steps == 0:  # the policy's updates
            policy = s.policy = bandit.explain()
        self.watch.on_step(rec, s.ema, policy)
        now = time.monotonic()
        # the first step of this start at once, then every --print-every steps or every
        # PRINT_SECONDS, whichever comes first (docs/operations.md#watching)
        if (
            self._printed_at is None
            or rec["step"] % self.print_every == 0
            or rec["step"] == self.max_steps
            or now - self._printed_at >= print_seconds()
        ):
            # elapsed, ETA (proxy/observation/progress.py)
            print(self.watch.progress_line(rec, s), flush=True)
            self._printed_at = now
