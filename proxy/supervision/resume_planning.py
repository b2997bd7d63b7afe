"""Resume planning: before a worker starts, make the run directory describe one checkpoint
(docs/history.md#rewind, docs/checkpoint-format.md#validity).

In order, for each incarnation: pick the newest valid checkpoint (rejected files named with the
rule they broke and kept in rejected/), cut the history back to it (records past it go to
`.loss.rewound.json`), drop pivot phases that start after it, rebuild the mixture controller for
that step (proxy/mixture/rebuild.py), make `.state.json` agree with the rebuilt bandit, and carry
out, finish or roll back a pending pivot (`plan_resume`, docs/pivots.md#crash-safety).

What it is not: spawning or watching the worker (proxy/supervision/supervisor.py), filing its reports
(proxy/supervision/report_filing.py), or the arm checks at start (proxy/mixture/arm_changes.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from proxy.fault_injection import pivot_fault
from proxy.mixture.arm_changes import ArmChange, handle_zombies
from proxy.mixture.controller import MixtureController
from proxy.mixture.rebuild import HistoryRecordError, new_controller, rebuild_mixture
from proxy.run_files.phases import read_phases, write_phases
from proxy.run_files.pivot_request import (
    RequestLockTimeout,
    pending_request,
    request_lock,
    write_request,
)
from proxy.run_files.sidecars import read_state, write_state
from proxy.run_files.state_snapshots import mark_rewound
from proxy.supervision.pivots import archive_sidecars, mark_running, pivot_due
from proxy.supervision.run_setup import replan
from shared.atomic_io import STALE_WRITE_S, atomic_write_json, clean_stale_writes
from shared.checkpoint.directory import (
    clean_stale_temporaries,
    quarantine_checkpoint,
    scan_for_resume,
)
from shared.checkpoint.file_format import CheckpointError
from shared.checkpoint.manifest import manifest_checksums, read_manifest
from shared.exit_codes import EXIT_FAILED, EXIT_USAGE
from shared.lr_schedule import learning_rate
from shared.run.config import RunConfig
from shared.run.layout import RunLayout
from shared.run.loss_history import LossHistory

log = logging.getLogger("proxy")


class ResumeError(RuntimeError):
    """No checkpoint to resume from although the run has a history, or a pending pivot that
    cannot be served now; `code` is the exit code."""

    def __init__(self, msg: str, code: int = EXIT_USAGE) -> None:
        super().__init__(msg)
        self.code = code


def _clean_killed_writes(layout: RunLayout) -> list[tuple[Path, str]]:
    """Remove the temporaries of atomic writes cut by a kill -9: (directory, name) of each. Called
    with the run lock held: every one in data/ and archive/ is dead (a half-made
    `archive/pivot-<B>.tmp/` too: a pivot due now makes it again), and so is one of the root's
    own files (`RunLayout.own_files`) once the request lock is held too (a `pivot` command writes
    the request under it); anything else in the root only when older than STALE_WRITE_S."""
    out = [(d, n) for d in (layout.data, layout.archive) for n in clean_stale_writes(d, 0.0)]
    for tmp in sorted(layout.archive.glob(layout.pivot_archive_tmp("*").name)):
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
            out.append((layout.archive, tmp.name))
    try:
        with request_lock(layout, timeout=5.0):
            names = clean_stale_writes(layout.root, STALE_WRITE_S, targets=layout.own_files)
    except RequestLockTimeout:  # a `pivot` at work: its temporary may be live
        names = clean_stale_writes(layout.root, STALE_WRITE_S)
    return out + [(layout.root, n) for n in names]


def find_resume_point(
    layout: RunLayout, cfg: RunConfig, history: LossHistory, from_scratch: bool
) -> tuple[int, Path | None, str | None]:
    """The newest valid checkpoint (docs/checkpoint-format.md#validity) as (step, path, the
    checksum the scan verified it against or None); (0, None, None): start fresh. Stale
    temporaries are removed; each rejected file is logged with its rule and, when training will
    pass its step again, moved to rejected/ (never deleted). A run stopped before its first
    checkpoint starts again from step 0 with a warning (docs/history.md#rewind, "Before the
    first checkpoint"). Raises ResumeError when the history has records but no checkpoint is
    valid otherwise, unless `from_scratch`."""
    root = layout.root
    for p in clean_stale_temporaries(root):
        log.info("removed stale temporary %s", p.name)
    for d, name in _clean_killed_writes(layout):
        log.info("removed stale temporary %s", os.path.join(os.path.relpath(d, root), name))
    manifest = read_manifest(root)
    checks = manifest_checksums(manifest)
    info, rejected = scan_for_resume(root, cfg.n_params, checks, values=True)
    for err in rejected:  # one line per rejected file, with the rule it broke
        assert err.path is not None  # scan_for_resume names the file of every rejection
        log.warning("rejected %s (rule: %s): %s", err.path.name, err.rule, err)
    if rejected and (info is not None or from_scratch or not history.last_step):
        # Training will pass these steps again: move them where neither the new file of the
        # same step nor retention can touch them (kept, never deleted).
        for err in rejected:
            assert err.path is not None
            try:
                dest = quarantine_checkpoint(err.path)
                log.warning("kept rejected %s as %s", err.path.name, dest.relative_to(root))
            except CheckpointError as e:
                log.error("%s", e)
    if info is None:
        if (
            history.last_step
            and not from_scratch
            and not rejected
            and not manifest
            and not (layout.rejected.is_dir() and any(layout.rejected.iterdir()))
            and history.last_step <= 2 * cfg.checkpoint_every
        ):
            # stopped by kill -9, a crash or OOM before its first checkpoint landed (rejected/
            # empty: none ever existed): nothing to lose or restore (docs/history.md#rewind)
            log.warning(
                "%s: no checkpoint was ever written (the history ends at step %d, before "
                "the first cadence checkpoint at step %d was sure to be on disk): starting "
                "again from step 0; the %d records go to %s",
                root,
                history.last_step,
                cfg.checkpoint_every,
                len(history),
                layout.loss_rewound.name,
            )
            return 0, None, None
        if history.last_step and not from_scratch:
            raise ResumeError(
                f"{root}: the history holds {len(history):,} records (to step "
                f"{history.last_step:,}) but no valid checkpoint exists"
                + (f" ({len(rejected)} rejected, see above)" if rejected else "")
                + "; restore a checkpoint, or pass --from-scratch to start again from step 0 "
                "(the history past 0 is then moved to .loss.rewound.json); rejected files "
                "stay where they are"
            )
        return 0, None, None
    if rejected:
        log.warning("resuming from %s instead", info.path.name)
    # a file without a manifest entry was read whole for rule 8: its checksum, computed then,
    # lets the worker check that it reads the same bytes (docs/checkpoint-format.md#validity)
    return info.step, info.path, checks.get(info.step) or info.checksum


def align_history(layout: RunLayout, history: LossHistory, step: int) -> None:
    """Make `.loss.json` end at `step`: records past it move to `.loss.rewound.json` with the
    reason (and the controller snapshots past it are invalidated); a history that ends before
    `step` is logged as a gap (docs/history.md#rewind)."""
    if history.last_step is not None and history.last_step > step:
        n = history.rewind(
            step, layout.loss_rewound, f"resumed from step {step}; records past it moved aside"
        )
        log.warning(
            "%s: %d records past step %d moved to %s (they do not match the checkpoint loaded)",
            layout.loss.name,
            n,
            step,
            layout.loss_rewound.name,
        )
        mark_rewound(layout, step)
    elif (history.last_step or 0) < step:
        log.warning(
            "%s ends at step %s but the checkpoint is step %d: the history has a gap",
            layout.loss.name,
            history.last_step,
            step,
        )


def prepare_mixture(
    layout: RunLayout, cfg: RunConfig, step: int, changes: list[ArmChange]
) -> tuple[MixtureController, list[str]]:
    """The controller for a resume after update `step` (the phase in force at `step`), and the
    arms changed at `step`. Phases that start after `step` (a resume from before a pivot) are
    removed from phases.json (their archives stay). Raises BanditConfigError (bounds)."""
    every = read_phases(layout)
    phases = [p for p in every if p.start_step <= step] or every[:1]
    if len(phases) < len(every):  # resumed from before a pivot: those phases never happened
        gone = [p for p in every if p not in phases]
        log.warning(
            "resuming from step %d, before the start of phase(s) %s: removed from %s "
            "(their archives stay under archive/)",
            step,
            ", ".join(f"{p.index} {p.label!r} at step {p.start_step}" for p in gone),
            layout.phases.name,
        )
        write_phases(layout, phases)
    r = rebuild_mixture(layout, cfg, step, changes, phase=phases[-1])
    log.info(
        "bandit rebuilt at step %d in %.2f s (%s, %d records replayed)",
        step,
        r.seconds,
        f"from the step-{r.snapshot_step} snapshot"
        if r.snapshot_step is not None
        else "from the phase start",
        r.replayed,
    )
    return r.mix, r.changed


def reconcile_state_file(
    layout: RunLayout, mix: MixtureController, step: int, changed: list[str]
) -> None:
    """Make `.state.json` describe the checkpoint loaded: when it is missing nothing is written
    (the next checkpoint writes it); when it describes another step or phase, differs from the
    rebuilt bandit, or the arms changed at `step`, the rebuilt bandit is written (the replay
    wins, docs/history.md#rewind)."""
    st = read_state(layout.state)
    if st is None:
        return
    replayed = mix.bandit.to_dict()
    if st.get("step") != step or st.get("phase", {}).get("index") != mix.phase.index:
        log.warning(
            "%s describes step %s, not the loaded checkpoint's step %d: rebuilt by "
            "replaying the history",
            layout.state.name,
            st.get("step"),
            step,
        )
    elif st != replayed and changed:
        log.info(
            "%s at step %d updated for the arm changes (%s)",
            layout.state.name,
            step,
            ", ".join(changed),
        )
    elif st != replayed:
        log.warning(
            "%s differs from the replay of the history at step %d; the replay wins",
            layout.state.name,
            step,
        )
    else:
        return
    write_state(layout.state, replayed)


@dataclass
class ResumePlan:
    """What `plan_resume` returns: where the incarnation starts and under which controller.
    `pivot_step`: B when a pivot at B is recorded and its new worker has not filed a step yet
    (the supervisor then marks the request running after step B+1)."""

    step: int
    path: Path | None
    mix: MixtureController
    pivot_step: int | None = None
    verified: str | None = None  # the checksum the scan verified `path` against, if any


def plan_resume(
    layout: RunLayout,
    cfg: RunConfig,
    history: LossHistory,
    from_scratch: bool,
    stopped_pivot: dict | None = None,
) -> ResumePlan:
    """Make the run directory describe one checkpoint and build its controller; then carry out,
    finish or roll back a pivot request (docs/pivots.md#crash-safety). `stopped_pivot`: a
    request to pivot at the resume step (`pivot` on a stopped run). Raises ResumeError (no
    checkpoint; a stopped pivot without one; a history record the controller cannot fold) and
    BanditConfigError (bounds)."""
    t0 = time.perf_counter()
    step, path, verified = find_resume_point(layout, cfg, history, from_scratch)
    t_scan = time.perf_counter()
    align_history(layout, history, step)
    t_history = time.perf_counter()
    if stopped_pivot is not None:
        if path is None:
            raise ResumeError(
                f"{layout.root} has no valid checkpoint to pivot at; train at "
                "least one checkpoint cadence first",
                code=EXIT_FAILED,
            )
        stopped_pivot.update(state="boundary", step=step)
        write_request(layout, stopped_pivot)
    changes = handle_zombies(layout, cfg.arms, step)
    t_arms = time.perf_counter()
    try:
        mix, changed = prepare_mixture(layout, cfg, step, changes)
    except HistoryRecordError as e:
        raise ResumeError(str(e), code=EXIT_FAILED) from None
    t_mix = time.perf_counter()
    reconcile_state_file(layout, mix, step, changed)
    log.debug(
        "resume planning: checkpoint scan (sizes, headers, checksum of the newest) %.3f s, "
        "history aligned %.3f s, arm checks %.3f s, bandit rebuilt %.3f s, .state.json "
        "%.3f s",
        t_scan - t0,
        t_history - t_scan,
        t_arms - t_history,
        t_mix - t_arms,
        time.perf_counter() - t_mix,
    )
    plan = ResumePlan(step, path, mix, verified=verified)
    try:
        with request_lock(layout):  # the `pivot` command withdraws under it (docs/pivots.md)
            _serve_pivot_request(layout, cfg, plan, changes)
    except RequestLockTimeout as e:
        raise ResumeError(
            f"{e}; the pending pivot cannot be served or rolled back while it is held: end "
            "or continue that process, then run the same command again",
            code=EXIT_FAILED,
        ) from None
    return plan


def _serve_pivot_request(
    layout: RunLayout, cfg: RunConfig, plan: ResumePlan, changes: list[ArmChange]
) -> None:
    """Carry out, finish or roll back the pending pivot request at the resume step (the table
    in docs/pivots.md#crash-safety); a request still "requested" waits for the live proxy."""
    step = plan.step
    req = pending_request(layout)
    if req is None or req.get("state") == "requested":
        return
    b, recorded = req.get("step"), phase_recorded(layout, req)
    if b == step and not recorded:
        plan.mix = start_pivot_phase(layout, cfg, plan.mix, req, step, changes)
        plan.pivot_step = step
        pivot_fault("after-record")
    elif b == step:  # recorded before a kill: finish, idempotently
        finish_pivot(layout, cfg, plan.mix, req, step)
        plan.pivot_step = step
    elif recorded and b is not None and step > b:  # the new phase already trained past B
        if req.get("state") == "recorded":
            mark_running(layout, b, None, step)
    else:
        pivot_due(layout, step)  # the old phase goes on: serve the request again


def phase_recorded(layout: RunLayout, req: dict) -> bool:
    """True when phases.json's last phase is the one `req` asks for (the commit point)."""
    last = read_phases(layout)[-1]
    return last.index > 0 and last.start_step == req.get("step") and last.label == req.get("label")


def start_pivot_phase(
    layout: RunLayout,
    cfg: RunConfig,
    mix: MixtureController,
    req: dict,
    step: int,
    changes: list[ArmChange],
) -> MixtureController:
    """The pivot at `step` (docs/pivots.md#the-sequence): archive the two sidecars (complete or
    absent), record the new phase in phases.json (the commit point), then reset
    `.state.json`/`.samples.json` for it. Returns the new phase's controller. `.loss.json` is
    not touched. Raises BanditConfigError (bounds)."""
    new = mix.next_phase(req["label"], req["caps"], req["floors"], step)
    new_mix = new_controller(layout, cfg, new, changes)  # bounds checked before any change
    old = {"label": mix.phase.label, "index": mix.phase.index}
    archive_sidecars(layout, step, mix.bandit.to_dict(), old)
    req.update(state="archived", archived_at=time.time())
    write_request(layout, req)
    pivot_fault("after-archive")
    write_phases(layout, read_phases(layout) + [new])
    log.info(
        "pivot: phase %d %r starts at step %d with caps %s floors %s",
        new.index,
        new.label,
        step,
        new.caps,
        new.floors,
    )
    finish_pivot(layout, cfg, new_mix, req, step)
    return new_mix


def finish_pivot(
    layout: RunLayout, cfg: RunConfig, mix: MixtureController, req: dict, step: int
) -> None:
    """After the phase is recorded: the final learning-rate decay from `step` to the request's
    `decay_to` when it asks for one (docs/pivots.md#a-decay-at-the-pivot), `.state.json` = the
    fresh bandit at `step`, `.samples.json` = an empty log of the new phase, request state
    "recorded". Idempotent."""
    end = req.get("decay_to")
    if isinstance(end, int) and end > step:
        entry = replan(layout, cfg, step, end, decay_at=step)
        if entry is not None:
            log.warning(
                "pivot %r: the final learning-rate decay starts at step %d (lr %.3g) and "
                "reaches the floor %.3g at step %d (run.json replans)",
                req.get("label"),
                step,
                learning_rate(step, cfg),
                cfg.lr * cfg.min_lr_ratio,
                end,
            )
    elif end is not None:
        log.warning(
            "pivot %r at step %d: no decay started, the plan's end %s is not after it",
            req.get("label"),
            step,
            end,
        )
    write_state(layout.state, mix.bandit.to_dict())
    atomic_write_json(
        layout.samples,
        {"phase": {"label": mix.phase.label, "index": mix.phase.index}, "audits": []},
    )
    if req.get("state") != "recorded":
        req.update(state="recorded", recorded_at=time.time())
        write_request(layout, req)
