"""`python -m proxy pivot`: ask for a polish pivot and follow it (docs/pivots.md). The command
writes `.pivot.request.json` (proxy/run_files/pivot_request.py) and the live proxy serves it
(proxy/supervision/pivots.py, docs/pivots.md#live-runs); on a stopped run the command carries it
out itself (docs/pivots.md#stopped-runs).

What it is not: the bandit's reset (proxy/mixture/controller.py `next_phase`), the mixture
rebuild (proxy/mixture/rebuild.py), resume planning (proxy/supervision/resume_planning.py).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable

from proxy.mixture.bandit import BanditConfigError, parse_arm_values, resolve_bounds
from proxy.observation.progress import fmt_duration, wall_seconds_per_update
from proxy.run_files.checkpoint_lookup import run_dir_problem
from proxy.run_files.phases import bounds_text, read_phases
from proxy.run_files.pivot_request import (
    RequestLockTimeout,
    pending_request,
    read_archived_request,
    read_request,
    remove_request,
    request_lock,
    write_request,
)
from proxy.run_files.run_lock import RunLock, lock_is_free, owner_pid, read_owner
from proxy.run_files.status_file import read_status
from proxy.supervision.launch import wait_for_earlier_workers
from proxy.supervision.pivots import next_boundary, take_back_pivot_stop
from proxy.supervision.report_salvage import salvage_step_reports
from proxy.supervision.resume_planning import ResumeError, plan_resume
from proxy.supervision.run_options import ProxyOptions
from shared.checkpoint.manifest import read_manifest
from shared.exit_codes import EXIT_FAILED, EXIT_USAGE
from shared.processes import alive
from shared.run.config import ConfigError, RunConfig, load_run_config
from shared.run.handshake import update_handshake
from shared.run.layout import RunLayout
from shared.run.loss_history import LossHistory, tail_records

WAIT_LINE_EVERY_S = 30.0  # a waiting `pivot` repeats its "waiting for boundary" line (seconds)


def _boundary_written(layout: RunLayout, b: int) -> bool:
    """Whether the worker wrote its boundary checkpoint at step `b` (the manifest's entry for
    `b` was written for a pivot or as the run's final one): filed steps past `b` alone do not
    say so, since a worker past `b` when the request reached it stops at its next step."""
    entry = read_manifest(layout.root).get(b)
    return entry is not None and entry.reason in ("pivot", "final")


def _last_filed(layout: RunLayout) -> int:
    recs = tail_records(layout.loss, 8192)
    return recs[-1]["step"] if recs else 0


def when(layout: RunLayout, togo: int) -> str:
    """ ", about H:MM:SS at the recent S s per update" for `togo` steps, or "" when the rate is
    not known yet (wall seconds per update over the history's last 50 steps, the progress
    line's ETA window: proxy/observation/progress.py)."""
    spu = wall_seconds_per_update(tail_records(layout.loss))
    if not spu:
        return ""
    return f", about {fmt_duration(togo * spu)} at the recent {spu:.1f} s per update"


def _refuse(msg: str) -> int:
    print(f"pivot refused: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _fail(msg: str) -> int:
    print(msg, file=sys.stderr)
    return EXIT_FAILED


def _say(msg: str) -> None:
    """One line of the pivot's progress, at once (a caller may be following it)."""
    print(f"pivot: {msg}", flush=True)


def cmd_pivot(a) -> int:
    """The `pivot` command: 0 the new phase is in force (live: its worker filed its first step;
    stopped: recorded, the next `run` trains in it) or the request was accepted (--no-wait);
    1 the pivot did not complete (the message says what state it left); 2 refused before
    anything changed (bad bounds, a pending pivot, a finished run)."""
    layout = RunLayout(a.run_dir)
    if (problem := run_dir_problem(layout.root)) is not None:  # every command's words, exit 2
        return _refuse(problem[1])
    try:
        return _pivot(layout, a)
    except RequestLockTimeout as e:  # a `pivot` command suspended inside it, say
        return _refuse(f"{e}; nothing was changed, ask again once it is free")


def _pivot(layout: RunLayout, a) -> int:
    """cmd_pivot's body; raises RequestLockTimeout when the request lock stays held."""
    given = bool(a.caps or a.floors)
    if a.withdraw:
        if given or a.keep_bounds or a.no_bounds or a.now or a.label or a.decay:
            return _refuse(
                "--withdraw takes no bounds, --now, --label or --decay: it withdraws the "
                "pending request whatever it asks"
            )
        return withdraw(layout)
    if given + a.keep_bounds + a.no_bounds != 1:
        try:
            ph = read_phases(layout)[-1]
            now = f"caps {bounds_text(ph.caps)}, floors {bounds_text(ph.floors)}"
        except (ConfigError, OSError, ValueError):  # named by the run that reads it
            now = "see `status`"
        return _refuse(
            (
                "give the new phase's bounds: --caps and/or --floors, --keep-bounds "
                "(a fresh bandit under the bounds in force) or --no-bounds (none at all)"
                if not (given or a.keep_bounds or a.no_bounds)
                else "--caps/--floors, --keep-bounds and --no-bounds exclude one another"
            )
            + f"; the phase in force has {now}"
        )
    try:
        cfg = load_run_config(layout.run_json)
        if a.keep_bounds:
            ph = read_phases(layout)[-1]
            caps, floors = dict(ph.caps), dict(ph.floors)
        else:  # as given (arms not named: floor 0, cap 1), checked (docs/bandit.md#polish-pivot)
            names = [x.name for x in cfg.arms]
            caps = parse_arm_values(a.caps, names, "--caps")
            floors = parse_arm_values(a.floors, names, "--floors")
            resolve_bounds(names, caps, floors)
    except (ConfigError, BanditConfigError) as e:
        return _refuse(f"{e}")
    if a.decay and cfg.schedule != "wsd":
        return _refuse(
            f"--decay starts a warmup-stable-decay run's final decay; this run's schedule is "
            f"{cfg.schedule} (run.json), whose decay spans the whole plan already: pivot "
            "without --decay"
        )
    label = a.label or "pivot"
    with request_lock(layout):  # the check and the write are one step (docs/pivots.md)
        then = _request(layout, cfg, caps, floors, label, a)
    return then() if callable(then) else then  # following it must not hold the lock


def _request(
    layout: RunLayout, cfg: RunConfig, caps: dict, floors: dict, label: str, a
) -> int | Callable[[], int]:
    """Under `.pivot.request.lock`: refuse (the exit code) when a request is pending or cannot
    be served, else write it and return what follows it: `_wait` on a live run, or on a stopped
    one `_pivot_stopped` (which writes it itself under the run lock)."""
    old = pending_request(layout)
    if old is not None:
        return _refuse(
            f"a pivot is already pending ({layout.pivot_request.name}: label {old.get('label')!r}, "
            f"state {old.get('state')}, step {old.get('step')}); wait for it (`status` "
            "shows it; on a stopped run `python -m proxy run` puts it in force) and "
            "ask again once it is in force, or withdraw it (`pivot --withdraw`)"
        )
    req = {
        "label": label,
        "caps": caps,
        "floors": floors,
        "requested_by": os.getpid(),
        "requested_at": time.time(),
        "state": "requested",
        "step": None,
    }
    if lock_is_free(layout):
        return lambda: _pivot_stopped(layout, cfg, req, a)
    other = pivot_in_progress(layout)
    if other is not None:
        return _refuse(
            f"another `pivot` command (pid {other.get('pid')}) is putting a pivot in force on "
            "this stopped run; wait for it to finish (then `status` shows the phase) and ask "
            "again"
        )
    try:  # the live proxy's --max-steps for this start
        planned = int(read_status(layout)["max_steps"])
    except (KeyError, TypeError, ValueError):
        planned = cfg.max_steps
    last = _last_filed(layout)
    if last >= planned:
        return _refuse(
            f"{layout.root} already finished at step {last:,} (max steps {planned:,}); "
            "nothing would train under the new policy"
        )
    b = next_boundary(cfg, last, a.now)
    if b >= planned:
        return _refuse(
            f"the {'next step' if a.now else 'next checkpoint boundary'}, step {b}, "
            f"is not before the run's last step {planned} (last filed {last}, "
            f"checkpoints every {cfg.checkpoint_every}): nothing would train in the new "
            "phase; "
            + (
                "run longer (`run --max-steps N`) and pivot then"
                if a.now
                else "use --now (checkpoint at the next step and pivot there), or "
                "run longer (`run --max-steps N`)"
            )
        )
    if a.now:
        req["now"] = True
    if a.decay:
        req["decay_to"] = planned
    pid = owner_pid(layout)
    write_request(layout, req)
    where = (
        "at the next step"
        if a.now
        else f"at the next checkpoint boundary (checkpoints every {cfg.checkpoint_every} steps)"
    )
    _say(
        f"request {label!r} caps {caps} floors {floors} written to "
        f"{layout.pivot_request.name}; live proxy pid {pid} pivots {where}: about step {b}, "
        f"{b - last} step{'' if b - last == 1 else 's'} after the last filed step {last}"
        f"{when(layout, b - last)}"
        + ("" if a.now else "; `pivot --now` would checkpoint at the next step and pivot there")
    )
    if a.no_wait:
        _say(
            "accepted (--no-wait); `python -m proxy status --run-dir DIR` shows its "
            "progress; `pivot --withdraw` withdraws it until its new phase is recorded"
        )
        return 0
    return lambda: _wait(layout, pid, a.timeout)


def pivot_in_progress(layout: RunLayout) -> dict | None:
    """The run lock's owner record when a `pivot` command holds the lock (a stopped run's pivot
    being carried out, docs/pivots.md#stopped-runs), else None (no holder, or a proxy)."""
    owner = read_owner(layout) or {}
    return owner if owner.get("command") == "pivot" and not lock_is_free(layout) else None


def withdraw(layout: RunLayout) -> int:
    """`pivot --withdraw`: remove the pending request, in state "requested" or "boundary", under
    `.pivot.request.lock` (docs/pivots.md#withdrawing-a-pivot). 0 withdrawn; 2 nothing to
    withdraw or too late (a later state: the phase change itself)."""
    with request_lock(layout):
        req = pending_request(layout)
        if req is None:
            return _refuse(f"no pivot is pending in {layout.root}; nothing to withdraw")
        other = pivot_in_progress(layout)
        if other is not None:
            return _refuse(
                f"a `pivot` command (pid {other.get('pid')}) is putting the pivot "
                f"{req.get('label')!r} in force on this stopped run: too late to withdraw; once "
                "it is, a pivot with the old phase's bounds (`status` shows them) pivots back"
            )
        state, b = req.get("state"), req.get("step")
        if state not in ("requested", "boundary"):
            return _refuse(
                f"the pivot {req.get('label')!r} at step {b} is being put in force (state "
                f"{state}): too late to withdraw; once it is, `pivot --caps ... --floors ...` "
                "with the old phase's bounds (`status` shows them) pivots back"
            )
        if state == "boundary":
            update_handshake(layout, lambda d: take_back_pivot_stop(d["control"], b))
        remove_request(layout)
    _say(
        f"withdrew {req.get('label')!r} (state {state}"
        + (f", boundary step {b}" if b is not None else "")
        + "); the run goes on in the phase in force"
    )
    return 0


def _wait(
    layout: RunLayout, pid: int | None, timeout: float, line_every: float = WAIT_LINE_EVERY_S
) -> int:
    """Follow the live proxy through the pivot, printing each state once. The line "waiting for
    boundary step B (n steps to go...)" is printed when the wait starts, when B changes, and
    then at most once every `line_every` seconds."""
    end, told, b = time.monotonic() + timeout, set(), None
    waited_for, waited_at = None, -math.inf  # the boundary of the last waiting line, its time
    while True:
        req = read_request(layout)
        if req is None and b is not None:  # moved into the archive: running
            req = read_archived_request(layout, b)
        if req is None:
            return _fail(
                "pivot: the request was withdrawn (`pivot --withdraw`); nothing changed, the "
                "phase in force runs on"
            )
        state = req.get("state")
        if state == "failed":
            print(
                f"pivot failed: {req.get('error')}; nothing changed, the old phase runs on",
                file=sys.stderr,
            )
            with request_lock(layout):
                remove_request(layout)
            return EXIT_FAILED
        if req.get("step") is not None:
            if b is not None and req["step"] != b:
                _say(
                    f"the worker was past step {b} when the request reached it; the "
                    f"boundary is its next checkpoint, step {req['step']}"
                )
                told.discard("at-boundary")
            b = req["step"]
        order = ["boundary", "archived", "recorded", "running"]
        reached = order.index(state) if state in order else -1
        if reached >= 0 and "boundary" not in told:
            told.add("boundary")
            # the proxy may have been quicker than this poll: still name the step
            if reached > 0:
                _say(f"boundary step {b} reached")
                told.add("at-boundary")
        if reached == 0 and b is not None and "at-boundary" not in told:
            if _boundary_written(layout, b):
                _say(f"boundary step {b} reached; the worker wrote step_{b:06d}.bin and exits")
                told.add("at-boundary")
            elif b != waited_for or time.monotonic() - waited_at >= line_every:
                togo = b - _last_filed(layout)
                waited_for, waited_at = b, time.monotonic()
                _say(
                    f"waiting for boundary step {b} ({togo} step"
                    f"{'' if togo == 1 else 's'} to go{when(layout, togo)})"
                    if togo > 0  # else the worker was past B: its next checkpoint is the boundary
                    else f"waiting for the worker's boundary checkpoint (step {b} or, if it "
                    f"was past it, its next step)"
                )
        if reached >= 1 and "archived" not in told:
            _say(f"archived to archive/pivot-{b}")
            told.add("archived")
        if reached >= 2 and "recorded" not in told:
            ph = read_phases(layout)[-1]
            _say(
                f"phase {ph.index} {ph.label!r} recorded (starts at step {ph.start_step}, "
                f"caps {ph.caps}, floors {ph.floors})"
            )
            told.add("recorded")
            _say("waiting for the new worker's first step")
        if reached == 3:
            _say(
                f"new worker pid {req.get('worker_pid')} filed step "
                f"{req.get('first_step')}; the new phase is in force"
            )
            return 0
        if pid is not None and not alive(pid):
            return _fail(
                f"pivot failed: proxy pid {pid} exited during the pivot (request state "
                f"{state}); `python -m proxy run --run-dir {layout.root}` resumes "
                + (
                    "in the new phase"
                    if reached >= 2
                    else "in the old phase and serves the request again"
                )
            )
        if time.monotonic() > end:
            return _fail(
                f"pivot: not in force after {timeout:.0f} s (request state {state}, boundary "
                f"{b}); the live proxy still holds the request and will finish it (see "
                "`status`); nothing was undone"
            )
        time.sleep(0.2)


def _pivot_stopped(layout: RunLayout, cfg: RunConfig, req: dict, a) -> int:
    """A stopped run: the same steps in this command's foreground, under the run lock; the next
    `run` resumes in the new phase from the newest valid checkpoint."""
    lock = RunLock(layout, command="pivot")
    try:
        lock.acquire()
    except Exception as e:  # noqa: BLE001 - a proxy started in between
        return _refuse(f"{e}")
    try:
        # a proxy killed by SIGKILL leaves its worker writing its last checkpoint and reports:
        # pivot at that checkpoint, not at an older one the worker then trains past
        # (docs/pivots.md#stopped-runs), as a resuming `run` waits (docs/signals.md#kill--9)
        wait_for_earlier_workers(layout, ProxyOptions.stop_timeout)
        with request_lock(layout):  # a request written since this command looked
            old = pending_request(layout)
        if old is not None:
            return _refuse(
                f"a pivot is already pending ({layout.pivot_request.name}: label "
                f"{old.get('label')!r}, state {old.get('state')}); `python -m proxy run` puts "
                "it in force, or `pivot --withdraw` withdraws it"
            )
        history = LossHistory(layout.loss)
        try:
            # the steps that worker reported after its proxy died belong to the old phase: file
            # them first, as a resuming `run` does, so the archived bandit is the one at B
            salvage_step_reports(layout, history, read_phases(layout))
            last = history.last_step or 0
            planned = a.max_steps or cfg.max_steps
            if last >= planned:
                return _refuse(
                    f"{layout.root} already finished at step {last:,} (max steps "
                    f"{planned:,}); nothing would train under the new policy. Pass "
                    f"--max-steps N with N > {last} here and to the next `run`"
                )
            req.update(state="boundary", step=None)
            if a.decay:
                req["decay_to"] = planned
            try:
                plan = plan_resume(layout, cfg, history, False, stopped_pivot=req)
            except ResumeError as e:
                remove_request(layout)
                return _fail(f"pivot failed: {e}")
        finally:
            history.close()
        if plan.pivot_step is None:  # not carried out (the request went meanwhile)
            return _fail(
                "pivot failed: the request was gone before its phase was recorded; nothing "
                "changed, the phase in force runs on"
            )
        ph = read_phases(layout)[-1]
        more = f" --max-steps {a.max_steps}" if a.max_steps else ""  # not stored: pass it on
        _say(f"archived to archive/pivot-{plan.step}")
        _say(
            f"phase {ph.index} {ph.label!r} recorded (starts at step {ph.start_step}, "
            f"caps {ph.caps}, floors {ph.floors}); the run is stopped: `python -m proxy run "
            f"--run-dir {layout.root}{more}` trains in it from step_{plan.step:06d}.bin"
        )
        return 0
    finally:
        lock.release()


def add_pivot_args(p) -> None:
    """The `pivot` command's options (docs/pivots.md)."""
    p.add_argument(
        "--run-dir",
        required=True,
        metavar="DIR",
        help="the run to pivot: live (its proxy does it in place) or stopped",
    )
    p.add_argument("--caps", default="", help="per-arm caps, arm=value,...")
    p.add_argument("--floors", default="", help="per-arm floors, arm=value,...")
    p.add_argument(
        "--keep-bounds",
        action="store_true",
        help="the new phase keeps the caps and floors in force (a fresh bandit only)",
    )
    p.add_argument(
        "--no-bounds", action="store_true", help="the new phase has no caps or floors at all"
    )
    p.add_argument("--label", help="the new phase's label (default 'pivot')")
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the live pivot to be in force (%(default)g)",
    )
    p.add_argument(
        "--no-wait", action="store_true", help="return once the live proxy has the request"
    )
    p.add_argument(
        "--now",
        action="store_true",
        help="live run: checkpoint at the next step and pivot there, instead of at the "
        "next checkpoint boundary (the default); docs/pivots.md#the-boundary",
    )
    p.add_argument(
        "--decay",
        action="store_true",
        help="--schedule wsd: start the final learning-rate decay at the pivot's step, "
        "linear to the floor at the run's last step; docs/pivots.md#a-decay-at-the-pivot",
    )
    p.add_argument(
        "--withdraw",
        action="store_true",
        help="withdraw the pending pivot instead (until its new phase is recorded); "
        "docs/pivots.md#withdrawing-a-pivot",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        help="stopped run only, when it reached run.json's: the --max-steps to "
        "pass to the next `run` (checked here, and in the command printed)",
    )
