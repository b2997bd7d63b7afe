"""The live side of a polish pivot (docs/pivots.md): the state machine the supervisor runs on
`.pivot.request.json` = {label, caps, floors, requested_by, requested_at, state, step, ...};
`state` moves requested -> boundary (step B chosen, handshake control stop_at_step = B posted)
-> archived (archive/pivot-B/ complete) -> recorded (phase in phases.json: the commit point) ->
running (the new worker filed step B+1; the file then moves to archive/pivot-B/). A refused
request gets state "failed" and an "error".

What it is not: the request file's reader and writer (proxy/run_files/pivot_request.py), the
phase record (proxy/supervision/resume_planning.py `start_pivot_phase`), the `pivot` command
(proxy/commands/pivot.py).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from proxy.fault_injection import pivot_fault
from proxy.run_files.pivot_request import (
    archive_request,
    pending_request,
    read_request,
    request_lock,
    write_request,
)
from proxy.run_files.sidecars import SamplesLog, write_state
from shared.atomic_io import atomic_write_bytes, fsync_dir
from shared.run.config import RunConfig
from shared.run.handshake import update_handshake
from shared.run.layout import RunLayout

log = logging.getLogger("proxy.commands.pivot")
P = ParamSpec("P")
R = TypeVar("R")
MOVE_LOCK_TIMEOUT_S = 1.0  # the live proxy's wait for the request lock before it defers a move


def _under_request_lock(
    move: Callable[Concatenate[RunLayout, P], R],
) -> Callable[Concatenate[RunLayout, P], R]:
    """Run a move of the state machine under `.pivot.request.lock` (its read, decision and write
    are one step for the `pivot` command, which withdraws or writes under the same lock). A
    lock still held after MOVE_LOCK_TIMEOUT_S raises RequestLockTimeout (see `_pivot_move` in
    proxy/supervision/supervisor.py)."""

    @functools.wraps(move)
    def locked(layout: RunLayout, *args: P.args, **kwargs: P.kwargs) -> R:
        with request_lock(layout, timeout=MOVE_LOCK_TIMEOUT_S):
            return move(layout, *args, **kwargs)

    return locked


@_under_request_lock
def poll_pivot_request(
    layout: RunLayout, cfg: RunConfig, filed_step: int, max_steps: int
) -> int | None:
    """A request in state "requested" gets its boundary B (`next_boundary` after `filed_step`):
    handshake control stop_at_step = B (reason "pivot") is posted and the request moves to state
    "boundary". Returns B, or None when there is nothing to do. A request that can no longer be
    served (B would not be before `max_steps`) gets state "failed"; nothing else changes."""
    req = read_request(layout)
    if not req or req.get("state") != "requested":
        return None
    now = bool(req.get("now"))
    b = next_boundary(cfg, filed_step, now)
    if b >= max_steps:
        _fail(
            layout,
            req,
            (f"the next step, {b}," if now else f"the next checkpoint boundary, step {b},")
            + f" is not before the last step {max_steps}",
        )
        return None
    posted = update_handshake(layout, lambda d: _post_pivot_stop(d["control"], b, now))["control"]
    if posted.get("reason") != "pivot":  # a collapse alarm's stop is pending: it goes first
        if req.get("waiting_for") != "alarm":
            req.update(waiting_for="alarm")
            write_request(layout, req)
            log.warning(
                "pivot %r waits: a collapse alarm is stopping the run at step %s; the "
                "request stays pending and is served at the next start (`python -m "
                "proxy run --run-dir %s`)",
                req.get("label"),
                posted.get("stop_at_step"),
                layout.root,
            )
        return None
    req.pop("waiting_for", None)
    req.update(state="boundary", step=b, proxy_pid=os.getpid(), posted_at=time.time())
    write_request(layout, req)
    log.info(
        "pivot requested (by pid %s, label %r%s): the worker checkpoints and stops at step %d",
        req.get("requested_by"),
        req.get("label"),
        ", --now" if now else "",
        b,
    )
    pivot_fault("before-boundary")
    return b


def next_boundary(cfg: RunConfig, filed_step: int, now: bool = False) -> int:
    """The step a pivot requested after `filed_step` (the last step the proxy filed) happens at:
    the next multiple of the checkpoint cadence after filed_step + 1 (the worker may be a step
    ahead of what is filed), or with `now` (`pivot --now`) filed_step + 1, the step the worker
    is at or will reach next (docs/pivots.md#the-boundary)."""
    if now:
        return filed_step + 1
    every = cfg.checkpoint_every
    return ((filed_step + 1) // every + 1) * every


def _post_pivot_stop(control: dict, b: int, now: bool = False) -> None:
    """Post the pivot's stop at B into the handshake's `control`, unless a collapse alarm's stop
    is pending there: the alarm stops the run now, and replacing it would turn that stop into a
    pivot at a later boundary after which training goes on (docs/pivots.md#the-boundary)."""
    if control.get("reason") == "alarm" and control.get("stop_at_step") is not None:
        return
    control.update(stop_at_step=b, reason="pivot", now=now)


def take_back_pivot_stop(control: dict, b: int | None) -> None:
    """Remove a pivot's stop at `b` from the handshake's `control` (`pivot --withdraw`); a
    collapse alarm's stop, or a pivot's at another step, is left as it is."""
    if control.get("reason") == "pivot" and control.get("stop_at_step") == b:
        control.update(stop_at_step=None, reason=None)
        control.pop("now", None)


@_under_request_lock
def follow_worker_boundary(layout: RunLayout, step: int) -> None:
    """The worker started its pivot checkpoint at `step`, past the B posted (it was past B when
    the request reached it: shared/run/handshake.py `control_stops_at`): the request's B becomes
    that step, where the worker really stopped (docs/pivots.md#the-boundary)."""
    req = read_request(layout)
    if not req or req.get("state") != "boundary" or req.get("step") == step:
        return
    old = req.get("step")
    req.update(step=step, planned_step=old)
    write_request(layout, req)
    log.info(
        "pivot %r: the worker was past step %s when the request reached it; it stops at the "
        "next checkpoint boundary, step %d, and the pivot happens there",
        req.get("label"),
        old,
        step,
    )


@_under_request_lock
def fail_unserved(layout: RunLayout, last_step: int, max_steps: int) -> None:
    """The run ended at its last step (`last_step` >= `max_steps`) with a pivot's boundary still
    ahead: nothing would train in the new phase, so the request gets state "failed" with the
    reason (the `pivot` command prints it)."""
    req = pending_request(layout)
    if not req or req.get("state") != "boundary" or last_step < max_steps:
        return
    _fail(
        layout,
        req,
        f"the run reached its last step {max_steps} before the pivot's "
        f"boundary (step {req.get('step')})",
    )


def _fail(layout: RunLayout, req: dict, why: str) -> None:
    """Give the request state "failed" with `why` and the remedy; nothing else changes."""
    req.update(
        state="failed",
        error=f"{why}: nothing would train in the new phase; run longer "
        "(run --max-steps N) and pivot again",
    )
    write_request(layout, req)
    log.warning("pivot %r not served: %s", req.get("label"), req["error"])


@_under_request_lock
def pivot_due(layout: RunLayout, step: int) -> dict | None:
    """The request when the pivot must happen at `step` now (state boundary or archived, at
    that step); a boundary/archived request for another step (the worker stopped before B: a
    kill, a SIGTERM) is put back to "requested" with a log line, so the live proxy serves it
    again, and a half-made archive of it is removed."""
    req = pending_request(layout)
    if not req or req.get("state") not in ("boundary", "archived"):
        return None
    if req.get("step") == step:
        return req
    b = req.get("step")
    if b is not None:  # a half-made archive of B
        shutil.rmtree(layout.pivot_archive_tmp(b), ignore_errors=True)
        shutil.rmtree(layout.pivot_archive(b), ignore_errors=True)
    log.warning(
        "pivot %r was to happen at step %s but the run resumes from step %d: the old "
        "phase goes on and the request is served again at the next boundary",
        req.get("label"),
        b,
        step,
    )
    req.update(state="requested", step=None)
    write_request(layout, req)
    return None


def archive_sidecars(layout: RunLayout, step: int, bandit: dict, phase: dict) -> None:
    """Archive the old phase at `step` into archive/pivot-<step>/ via pivot-<step>.tmp/ and one
    rename, so the archive is complete or absent (docs/pivots.md#crash-safety): `.state.json` =
    `bandit` (the old phase's bandit at `step`, replayed from the history) and `.samples.json`
    copied, or an empty audit log of `phase` when no audit was filed (either may be missing).
    The originals stay until the phase is recorded. Idempotent: an existing archive is kept."""
    dest = layout.pivot_archive(step)
    if dest.exists():
        return
    tmp = layout.pivot_archive_tmp(step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_state(tmp / layout.state.name, bandit)
    if layout.samples.exists():  # every write here is durable: file and tmp/ fsynced
        atomic_write_bytes(tmp / layout.samples.name, layout.samples.read_bytes())
    else:
        SamplesLog(tmp / layout.samples.name, phase).save()
    tmp.replace(dest)
    fsync_dir(layout.archive)
    log.info("archived .samples.json and .state.json to %s", dest.relative_to(layout.root))


@_under_request_lock
def mark_running(layout: RunLayout, step: int, worker_pid: int | None, first_step: int) -> None:
    """The new worker filed `first_step` after the pivot at `step`: state "running", and the
    request moves into archive/pivot-<step>/ (the record of what was asked)."""
    req = read_request(layout)
    if not req or req.get("state") != "recorded" or req.get("step") != step:
        return
    req.update(
        state="running", worker_pid=worker_pid, first_step=first_step, running_at=time.time()
    )
    write_request(layout, req)
    archive_request(layout, step)
    log.info(
        "pivot %r: new worker pid %s filed step %d; phase in force",
        req.get("label"),
        worker_pid,
        first_step,
    )
