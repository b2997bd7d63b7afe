"""The one way the mixture controller is rebuilt for a step (docs/bandit.md#determinism).

A resume from checkpoint S needs the controller exactly as it was after update S: the bandit of
the phase in force at S, every policy it posted, and the arm changes up to S applied. This module
builds it, from the newest controller snapshot at or before S plus the history's records after it
(proxy/run_files/state_snapshots.py), or by replaying `.loss.json` from the phase start. The
resume, the pivot and the tests that check `replay == .state.json` all call `rebuild_mixture`.

What it is not: the controller's arithmetic (proxy/mixture/controller.py, proxy/mixture/bandit.py),
the choice of the resume step (proxy/supervision/resume_planning.py) or phases.json
(proxy/supervision/run_setup.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from proxy.mixture.arm_changes import ArmChange, read_changes
from proxy.mixture.controller import MixtureController
from proxy.run_files.phases import Phase, phase_at, read_phases
from proxy.run_files.state_snapshots import find_snapshot
from shared.data.token_files import ArmData, arm_compression, read_arm_index
from shared.run.config import RunConfig
from shared.run.layout import RunLayout
from shared.run.loss_history import iter_records, iter_records_after

log = logging.getLogger("proxy")


class HistoryRecordError(ValueError):
    """A `.loss.json` record the controller cannot fold (a field of the wrong type: a hand edit
    or damage, since the proxy writes every record itself); the message names the file, the
    step and the field."""


@dataclass
class Rebuilt:
    """What `rebuild_mixture` returns: the controller and how it was made."""

    mix: MixtureController
    changed: list[str]  # arms joined or retired by changes applied at the step itself
    snapshot_step: int | None  # the snapshot it started from; None = from the phase start
    replayed: int  # history records folded on top
    seconds: float


def new_controller(
    layout: RunLayout, cfg: RunConfig, phase: Phase, changes: list[ArmChange]
) -> MixtureController:
    """A controller at the start of `phase`, over every arm the run has had (retired ones
    included, data/arms.json). Raises BanditConfigError (bounds)."""
    arms = read_arm_index(layout, include_retired=True)
    return MixtureController(
        sorted(arms),
        phase,
        cfg.reward,
        cfg.bandit_warmup,
        cfg.probe_every,
        changes,
        {n: arm_compression(layout, a) for n, a in arms.items()},
        {n: epoch_windows(a, cfg.model.block_size) for n, a in arms.items()},
    )


def epoch_windows(arm: ArmData, block_size: int) -> float:
    """Training windows of `block_size` tokens in one epoch of `arm`: its tokens outside the
    held-out ranges / block_size (docs/bandit.md#repetition). A window drawn counts block_size
    tokens, so the arm's epochs are its lifetime pulls / this."""
    held = sum(b - a for a, b in arm.heldout_ranges())
    return max(0, arm.n_tokens - held) / block_size


def rebuild_mixture(
    layout: RunLayout,
    cfg: RunConfig,
    step: int,
    changes: list[ArmChange] | None = None,
    phase: Phase | None = None,
    use_snapshots: bool = True,
    watch: Callable[[int, MixtureController], None] | None = None,
) -> Rebuilt:
    """The controller as it was after update `step` of `phase` (default: the phase in force at
    `step`), with the arm changes up to `step` applied. `changes`: the arm-change log (default:
    data/arms.json's). `use_snapshots=False` replays the phase from its start even when a
    snapshot exists (what tests compare `.state.json` against). The result is the same either
    way, bit for bit. `watch(step, controller)`, when given, is called after each record is
    folded. A snapshot that does not restore is passed over with a warning (the phase is
    replayed from its start). Raises BanditConfigError (bounds), HistoryRecordError (a record
    it cannot fold) and OSError (unreadable history)."""
    t0 = time.perf_counter()
    changes = read_changes(layout) if changes is None else changes
    phase = phase_at(layout, step) if phase is None else phase
    mix = new_controller(layout, cfg, phase, changes)
    snap = find_snapshot(layout, phase.index, phase.start_step, step) if use_snapshots else None
    n = 0
    if snap is not None:
        try:
            mix.restore(snap)
        except ValueError as e:  # a damaged line: the phase's own records say the same
            log.warning(
                "%s: the snapshot at step %s is unusable (%s); replaying phase %d from its start",
                layout.state_snapshots,
                snap["step"],
                e,
                phase.index,
            )
            mix, snap = new_controller(layout, cfg, phase, changes), None
    if snap is not None:
        records: Iterable[dict] = iter_records_after(layout.loss, snap["step"], step)  # streamed
    else:
        records = iter_records(layout.loss)  # streamed: memory flat in the history's length
    for r in records:
        if r["step"] > step:
            break  # records are in step order
        if r["step"] > phase.start_step:
            try:
                mix.observe(r)
            except (KeyError, TypeError, ValueError) as e:
                raise HistoryRecordError(
                    f"{layout.loss}: the record of step {r['step']} cannot be folded ({e}); "
                    "correct or delete that line (the policy skips a missing step), then run the "
                    "same command again"
                ) from None
            n += 1
            if watch is not None:
                watch(r["step"], mix)
    changed = mix.apply_changes(step)
    return Rebuilt(mix, changed, snap["step"] if snap else None, n, time.perf_counter() - t0)


def replay_run(
    layout: RunLayout, cfg: RunConfig, step: int, changes: list[ArmChange] | None = None
) -> MixtureController:
    """`rebuild_mixture` from the phase start, no snapshot: its `bandit.to_dict()` equals the
    `.state.json` written with checkpoint `step`."""
    return rebuild_mixture(layout, cfg, step, changes, use_snapshots=False).mix


def gate_changes(layout: RunLayout, cfg: RunConfig) -> list[tuple[int, bool]]:
    """The steps where the default policy's gate opened (True) or closed (False), phase by
    phase, from a replay of `.loss.json` (docs/bandit.md#reading-the-policy); a phase starts
    closed, so a gate open at a pivot closes at the pivot's step. Empty for the other rewards.
    Streams the history once per phase. Raises BanditConfigError (bounds) and OSError
    (unreadable history)."""
    if cfg.reward != "train_slope":
        return []
    phases = read_phases(layout)
    out: list[tuple[int, bool]] = []
    for i, ph in enumerate(phases):
        end = phases[i + 1].start_step if i + 1 < len(phases) else 2**62
        changes: list[tuple[int, bool]] = []
        if out and out[-1][1]:  # open at the pivot: the new phase's bandit starts closed
            out.append((ph.start_step, False))

        def seen(step: int, mix: MixtureController, changes: list = changes) -> None:
            if (mix.bandit.lam > 0) != (changes[-1][1] if changes else False):
                changes.append((step, mix.bandit.lam > 0))

        rebuild_mixture(layout, cfg, end, phase=ph, use_snapshots=False, watch=seen)
        out += changes
    return out
