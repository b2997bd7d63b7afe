"""What a person watching a run sees, fed from the supervisor's call sites: the progress line
(proxy/observation/progress.py), live TensorBoard scalars (proxy/observation/tensorboard_log.py,
with `--tensorboard`), Weights & Biases (proxy/observation/wandb_log.py, with `--wandb`) and the
summary logged when the run stops.

What it is not: supervision. The supervisor (proxy/supervision/supervisor.py) calls
`on_incarnation`, `on_report`, `progress_line` and `close`, one line each; nothing here changes
what it files.
"""

from __future__ import annotations

import logging
import time

from proxy.observation.progress import ProgressLine, format_summary
from proxy.observation.tensorboard_log import TensorBoardLog, policy_scalars, step_scalars
from proxy.observation.wandb_log import WandbLog

log = logging.getLogger("proxy")


class RunWatch:
    """The observers of one `run`. `tensorboard`: write event files under RUN/tensorboard/;
    `wandb`: log to the run's W&B run (files under RUN/wandb/)."""

    def __init__(
        self,
        layout,
        cfg,
        max_steps: int,
        tensorboard: bool = False,
        wandb: bool = False,
        creation_s: float | None = None,
    ) -> None:
        self.layout, self.cfg, self.max_steps = layout, cfg, max_steps
        self.progress = ProgressLine(max_steps)
        self.t0 = time.monotonic()
        self.sinks: list[TensorBoardLog | WandbLog] = []  # where the scalars go
        if tensorboard:
            self.sinks.append(TensorBoardLog(layout.tensorboard))
        if wandb:
            self.sinks.append(WandbLog(layout.root, cfg.to_json()))
        self._last_step = 0
        self._ema: float | None = None
        self.creation_s = creation_s  # None: this start resumed the run

    def on_incarnation(self, step: int) -> None:
        """A worker is about to start from checkpoint step `step` (0: fresh)."""
        self.progress.on_incarnation(step)
        self._last_step = step
        for sink in self.sinks:  # each backfills what the history holds up to `step`
            sink.start(step, self.layout.loss, self.layout.samples)

    def on_step(self, rec: dict, ema: float | None, policy: dict | None = None) -> None:
        """A step record was filed into .loss.json (`rec` as filed, `ema` after it; `policy`:
        the bandit's `explain()` when it updated at this step, logged under arms/ and policy/)."""
        self.progress.observe(rec)
        self._last_step, self._ema = rec["step"], ema
        if self.sinks:
            values = step_scalars(rec, ema)
            if policy is not None:
                values.update(policy_scalars(policy))
            for sink in self.sinks:
                sink.scalars(rec["step"], values, rec.get("time"))

    def on_report(self, r: dict) -> None:
        """Checkpoint and audit reports (step records come through `on_step`)."""
        kind = r.get("type")
        for sink in self.sinks:
            if kind == "checkpoint" and not r.get("error"):
                sink.scalars(
                    r["step"],
                    {
                        "checkpoint/step": r["step"],
                        "checkpoint/bytes": r.get("bytes"),
                        "checkpoint/seconds": r.get("seconds"),
                    },
                    r.get("time"),
                )
            elif kind == "audit":
                sink.audit(r)  # held-out losses as scalars, the samples as text (a table)

    def progress_line(self, rec: dict, stats) -> str:
        """The progress line for `rec` (`stats`: the supervisor's LiveStats)."""
        return self.progress.line(rec, stats.ema, stats.tok_per_s)

    def close(self, last_step: int | None = None) -> None:
        """The run stops: close the event file, log the summary."""
        for sink in self.sinks:
            sink.close()
        try:
            log.info(
                "%s",
                format_summary(
                    self.layout,
                    self.cfg,
                    self.progress.start_step,
                    last_step or self._last_step,
                    self._ema,
                    time.monotonic() - self.t0,
                    self.max_steps,
                    self.creation_s,
                ),
            )
        except Exception as e:  # the summary must never turn a clean stop into a crash
            log.warning("run summary unavailable: %s", e)
