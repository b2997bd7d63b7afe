"""Resume planning: before a worker starts, make the run directory describe one checkpoint
(docs/history.md#rewind, docs/checkpoint-format.md#validity).

In order, for each incarnation: pick the newest valid checkpoint (rejected files named with the
rule they broke and kept in rejected/), cut the history back to it (records past it go to
`.loss.rewound.json`), drop pivot phases that start after it, rebuild the mixture controller for
that step (proxy/mixture_rebuild.py), start a pending pivot's phase, and make `.state.json` agree
with the rebuilt bandit.

What it is not: spawning or watching the worker (proxy/supervisor.py), filing its reports
(proxy/report_filing.py), or the arm checks at start (proxy/arm_changes.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from proxy.arm_changes import ArmChange
from proxy.mixture import MixtureController
from proxy.mixture_rebuild import new_controller, rebuild_mixture
from proxy.run_setup import read_phases, write_phases
from proxy.sidecars import read_json_tolerant, write_state
from proxy.state_snapshots import mark_rewound
from shared.checkpoint_format import CheckpointError, clean_stale_temporaries, \
    quarantine_checkpoint, scan_for_resume
from shared.checkpoint_manifest import manifest_checksums, read_manifest
from shared.config import RunConfig
from shared.exit_codes import EXIT_USAGE
from shared.loss_history import LossHistory
from shared.run_layout import RunLayout

log = logging.getLogger("proxy")


class ResumeError(RuntimeError):
    """No checkpoint to resume from although the run has a history; `code` is the exit code."""

    def __init__(self, msg: str, code: int = EXIT_USAGE) -> None:
        super().__init__(msg)
        self.code = code


@dataclass
class ResumePoint:
    """Where an incarnation starts: after update `step`, from `path` (None: step 0, fresh)."""

    step: int
    path: Path | None
    verified: str | None = None  # the checksum the scan verified the file against, if any


def find_resume_point(layout: RunLayout, cfg: RunConfig, history: LossHistory,
                      from_scratch: bool) -> ResumePoint:
    """The newest valid checkpoint (docs/checkpoint-format.md#validity). Stale temporaries are
    removed; each rejected file is logged with its rule and, when training will pass its step
    again, moved to rejected/ (never deleted). Raises ResumeError when the history has records
    but no checkpoint is valid, unless `from_scratch`."""
    root = layout.root
    for p in clean_stale_temporaries(root):
        log.info("removed stale temporary %s", p.name)
    checks = manifest_checksums(read_manifest(root))
    info, rejected = scan_for_resume(root, cfg.n_params, checks)
    for err in rejected:  # one line per rejected file, with the rule it broke
        log.warning("rejected %s (rule: %s): %s", err.path.name, err.rule, err)
    if rejected and (info is not None or from_scratch or not history.last_step):
        # Training will pass these steps again: move them where neither the new file of the
        # same step nor retention can touch them (kept, never deleted).
        for err in rejected:
            try:
                dest = quarantine_checkpoint(err.path)
                log.warning("kept rejected %s as %s", err.path.name, dest.relative_to(root))
            except CheckpointError as e:
                log.error("%s", e)
    if info is None:
        if history.last_step and not from_scratch:
            raise ResumeError(
                f"{root}: the history holds {len(history):,} records (to step "
                f"{history.last_step:,}) but no valid checkpoint exists"
                + (f" ({len(rejected)} rejected, see above)" if rejected else "")
                + "; restore a checkpoint, or pass --from-scratch to start again from step 0 "
                "(the history past 0 is then moved to .loss.rewound.json); rejected files "
                "stay where they are")
        return ResumePoint(0, None)
    if rejected:
        log.warning("resuming from %s instead", info.path.name)
    return ResumePoint(info.step, info.path, checks.get(info.step))


def align_history(layout: RunLayout, history: LossHistory, step: int) -> None:
    """Make `.loss.json` end at `step`: records past it move to `.loss.rewound.json` with the
    reason (and the controller snapshots past it are invalidated); a history that ends before
    `step` is logged as a gap (docs/history.md#rewind)."""
    if history.last_step is not None and history.last_step > step:
        n = history.rewind(step, layout.loss_rewound,
                           f"resumed from step {step}; records past it moved aside")
        log.warning("%s: %d records past step %d moved to %s (they do not match the "
                    "checkpoint loaded)", layout.loss.name, n, step, layout.loss_rewound.name)
        mark_rewound(layout, step)
    elif (history.last_step or 0) < step:
        log.warning("%s ends at step %s but the checkpoint is step %d: the history has a gap",
                    layout.loss.name, history.last_step, step)


def archive_phase(layout: RunLayout, step: int) -> Path:
    """Move `.samples.json` and `.state.json` into archive/pivot-<step>/ (docs/pivots.md);
    `.loss.json` stays where it is. Returns the archive folder."""
    dest = layout.pivot_archive(step)
    dest.mkdir(parents=True, exist_ok=True)
    for p in (layout.samples, layout.state):
        if p.exists():
            p.replace(dest / p.name)
    log.info("archived .samples.json and .state.json to %s", dest)
    return dest


def prepare_mixture(layout: RunLayout, cfg: RunConfig, step: int, changes: list[ArmChange],
                    pivot: dict | None) -> tuple[MixtureController, list[str]]:
    """The controller for a resume after update `step`, and the arms changed at `step`.

    Phases that start after `step` (a resume from before a pivot) are removed from phases.json
    (their archives stay). `pivot` ({"label", "caps", "floors"}) starts a new phase at `step`:
    the sidecars of the old one are archived and a fresh controller starts under the new bounds.
    Raises BanditConfigError (bounds)."""
    every = read_phases(layout)
    phases = [p for p in every if p.start_step <= step] or every[:1]
    if len(phases) < len(every):  # resumed from before a pivot: those phases never happened
        gone = [p for p in every if p not in phases]
        log.warning("resuming from step %d, before the start of phase(s) %s: removed from %s "
                    "(their archives stay under archive/)", step,
                    ", ".join(f"{p.index} {p.label!r} at step {p.start_step}" for p in gone),
                    layout.phases.name)
        write_phases(layout, phases)
    r = rebuild_mixture(layout, cfg, step, changes, phase=phases[-1])
    log.info("bandit rebuilt at step %d in %.2f s (%s, %d records replayed)", step, r.seconds,
             f"from the step-{r.snapshot_step} snapshot" if r.snapshot_step is not None
             else "from the phase start", r.replayed)
    mix = r.mix
    if pivot is not None:
        new = mix.next_phase(pivot["label"], pivot["caps"], pivot["floors"], step)
        archive_phase(layout, step)
        write_phases(layout, phases + [new])
        log.info("pivot: phase %d %r starts at step %d with caps %s floors %s",
                 new.index, new.label, step, new.caps, new.floors)
        mix = new_controller(layout, cfg, new, changes)
    return mix, r.changed


def reconcile_state_file(layout: RunLayout, mix: MixtureController, step: int,
                         changed: list[str]) -> None:
    """Make `.state.json` describe the checkpoint loaded: when it is missing nothing is written
    (the next checkpoint writes it); when it describes another step or phase, differs from the
    rebuilt bandit, or the arms changed at `step`, the rebuilt bandit is written (the replay
    wins, docs/history.md#rewind)."""
    st = read_json_tolerant(layout.state, None)
    if st is None:
        return
    replayed = mix.bandit.to_dict()
    if st.get("step") != step or st.get("phase", {}).get("index") != mix.phase.index:
        log.warning("%s describes step %s, not the loaded checkpoint's step %d: rebuilt by "
                    "replaying the history", layout.state.name, st.get("step"), step)
    elif st != replayed and changed:
        log.info("%s at step %d updated for the arm changes (%s)", layout.state.name, step,
                 ", ".join(changed))
    elif st != replayed:
        log.warning("%s differs from the replay of the history at step %d; the replay wins",
                    layout.state.name, step)
    else:
        return
    write_state(layout.state, replayed)
