"""Polish pivots (docs/pivots.md): the request file, the in-place pivot the
supervisor runs, and the `python -m proxy pivot` command.

A pivot is a durable state machine in `.pivot.request.json` = {label, caps, floors,
requested_by, requested_at, state, step, ...}; `state` moves requested -> boundary (step B
chosen, handshake control stop_at_step = B posted) -> archived (archive/pivot-B/ complete) ->
recorded (phase in phases.json: the commit point) -> running (the new worker filed step B+1; the
file then moves to archive/pivot-B/pivot.request.json). A refused request gets state "failed"
and an "error". The live proxy serves the request itself (proxy/supervisor.py): the worker
checkpoints B and exits 0, the proxy archives, records the phase and starts a new worker from
step_B.bin; its pid never changes. On a stopped run the command runs the same steps in its own
foreground and the next `run` trains in the new phase.

What it is not: the bandit's reset (proxy/mixture.py `next_phase`), the mixture rebuild
(proxy/mixture_rebuild.py), resume planning (proxy/resume_planning.py).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from shared.atomic_io import atomic_write_json
from shared.config import ConfigError, RunConfig, load_run_config
from shared.handshake import update_handshake
from shared.run_layout import RunLayout, missing_run_json
from shared.exit_codes import EXIT_FAILED, EXIT_USAGE

log = logging.getLogger("proxy.pivot")
REQUEST_NAME = ".pivot.request.json"
ARCHIVED_REQUEST = "pivot.request.json"   # the finished request, inside archive/pivot-B/
PENDING = ("requested", "boundary", "archived", "recorded")
FAULT_ENV = "ANDREA_FAULT_PIVOT"          # test hook: the proxy SIGKILLs itself at that moment


def request_path(layout: RunLayout) -> Path:
    """`.pivot.request.json` of the run."""
    return layout.root / REQUEST_NAME


def read_request(layout: RunLayout) -> dict | None:
    """The request, or None when there is none (or it is being replaced: atomic writes)."""
    try:
        d = json.loads(request_path(layout).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def write_request(layout: RunLayout, req: dict) -> None:
    """Replace the request atomically (fsynced: it is what a restart reads)."""
    atomic_write_json(request_path(layout), req)


def pending_request(layout: RunLayout) -> dict | None:
    """The request when it is still pending (state requested .. recorded), else None."""
    req = read_request(layout)
    return req if req and req.get("state") in PENDING else None


def fault_point(moment: str) -> None:
    """Test hook (docs/pivots.md#crash-safety): SIGKILL this process when the environment
    variable ANDREA_FAULT_PIVOT names `moment`. Off unless set; production never sets it."""
    if os.environ.get(FAULT_ENV) == moment:
        log.warning("%s=%s: killing this proxy (SIGKILL) for a crash test", FAULT_ENV, moment)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------------ bounds

def validated_bounds(cfg: RunConfig, caps_text: str, floors_text: str) -> tuple[dict, dict]:
    """Parse and check pivot bounds against the run's arms: (caps, floors) as given (arms not
    named get floor 0 and cap 1). Raises BanditConfigError naming the arm, value and rule
    (docs/bandit.md#polish-pivot)."""
    from proxy.mixture.bandit import parse_arm_values, resolve_bounds
    names = [a.name for a in cfg.arms]
    caps = parse_arm_values(caps_text, names, "--caps")
    floors = parse_arm_values(floors_text, names, "--floors")
    resolve_bounds(names, caps, floors)
    return caps, floors


# ------------------------------------------------------------------------------ proxy side

def poll_pivot_request(layout: RunLayout, cfg: RunConfig, filed_step: int,
                       max_steps: int) -> int | None:
    """Called by the live proxy's watch loop. A request in state "requested" gets its boundary
    B = the next multiple of the checkpoint cadence after `filed_step` + 1 (the worker may be a
    step ahead of what is filed): handshake control stop_at_step = B (reason "pivot") is posted
    and the request moves to state "boundary". Returns B, or None when there is nothing to do.
    A request that can no longer be served (B would not be before `max_steps`) gets state
    "failed" with the reason; nothing else changes."""
    req = read_request(layout)
    if not req or req.get("state") != "requested":
        return None
    every = cfg.checkpoint_every
    b = ((filed_step + 1) // every + 1) * every
    if b >= max_steps:
        _fail(layout, req, f"the next checkpoint boundary, step {b}, is not before the last "
                           f"step {max_steps}")
        return None
    posted = update_handshake(layout, lambda d: _post_pivot_stop(d["control"], b))["control"]
    if posted.get("reason") != "pivot":  # a collapse alarm's stop is pending: it goes first
        if req.get("waiting_for") != "alarm":
            req.update(waiting_for="alarm")
            write_request(layout, req)
            log.warning("pivot %r waits: a collapse alarm is stopping the run at step %s; the "
                        "request stays pending and is served at the next start (`python -m "
                        "proxy run --run-dir %s`)", req.get("label"), posted.get("stop_at_step"),
                        layout.root)
        return None
    req.pop("waiting_for", None)
    req.update(state="boundary", step=b, proxy_pid=os.getpid(), posted_at=time.time())
    write_request(layout, req)
    log.info("pivot requested (by pid %s, label %r): the worker checkpoints and stops at step %d",
             req.get("requested_by"), req.get("label"), b)
    fault_point("before-boundary")
    return b


def _post_pivot_stop(control: dict, b: int) -> None:
    """Post the pivot's stop at B into the handshake's `control`, unless a collapse alarm's stop
    is pending there: the alarm stops the run now, and replacing it would turn that stop into a
    pivot at a later boundary after which training goes on (docs/pivots.md#the-boundary)."""
    if control.get("reason") == "alarm" and control.get("stop_at_step") is not None:
        return
    control.update(stop_at_step=b, reason="pivot")


def follow_worker_boundary(layout: RunLayout, step: int) -> int | None:
    """The worker started its pivot checkpoint at `step`. B was chosen from the last step the
    proxy had filed, and the worker may already have been past it when the control request
    reached it; it then stops at its next checkpoint boundary instead (shared/handshake.py
    `control_stops_at`). The request's B becomes that step, so the pivot happens where the
    worker really stopped (docs/pivots.md#the-boundary). Returns the new B when it moved, else
    None."""
    req = read_request(layout)
    if not req or req.get("state") != "boundary" or req.get("step") == step:
        return None
    old = req.get("step")
    req.update(step=step, planned_step=old)
    write_request(layout, req)
    log.info("pivot %r: the worker was past step %s when the request reached it; it stops at the "
             "next checkpoint boundary, step %d, and the pivot happens there", req.get("label"),
             old, step)
    return step


def fail_unserved(layout: RunLayout, last_step: int, max_steps: int) -> bool:
    """The run ended at its last step (`last_step` >= `max_steps`) with a pivot's boundary still
    ahead: nothing would train in the new phase, so the request gets state "failed" with the
    reason (the `pivot` command prints it). Returns True when it did."""
    req = pending_request(layout)
    if not req or req.get("state") != "boundary" or last_step < max_steps:
        return False
    _fail(layout, req, f"the run reached its last step {max_steps} before the pivot's "
                       f"boundary (step {req.get('step')})")
    return True


def _fail(layout: RunLayout, req: dict, why: str) -> None:
    """Give the request state "failed" with `why` and the remedy; nothing else changes."""
    req.update(state="failed", error=f"{why}: nothing would train in the new phase; run longer "
               "(run --max-steps N) and pivot again")
    write_request(layout, req)
    log.warning("pivot %r not served: %s", req.get("label"), req["error"])


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
    shutil.rmtree(_tmp_archive(layout, b), ignore_errors=True)
    shutil.rmtree(layout.pivot_archive(b), ignore_errors=True)
    log.warning("pivot %r was to happen at step %s but the run resumes from step %d: the old "
                "phase goes on and the request is served again at the next boundary",
                req.get("label"), b, step)
    req.update(state="requested", step=None)
    write_request(layout, req)
    return None


def _tmp_archive(layout: RunLayout, step) -> Path:
    return layout.archive / f"pivot-{step}.tmp"


def archive_sidecars(layout: RunLayout, step: int) -> Path:
    """Copy `.samples.json` and `.state.json` into archive/pivot-<step>/ via pivot-<step>.tmp/
    and one rename, so the archive is complete or absent (docs/pivots.md#crash-safety). The
    originals stay until the phase is recorded. Idempotent: an existing archive is kept."""
    from shared.atomic_io import fsync_dir
    dest = layout.pivot_archive(step)
    if dest.exists():
        return dest
    tmp = _tmp_archive(layout, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for p in (layout.samples, layout.state):
        if p.exists():
            shutil.copyfile(p, tmp / p.name)
            with open(tmp / p.name, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(tmp)
    tmp.replace(dest)
    fsync_dir(layout.archive)
    log.info("archived .samples.json and .state.json to %s", dest.relative_to(layout.root))
    return dest


def mark_running(layout: RunLayout, step: int, worker_pid: int | None, first_step: int) -> bool:
    """The new worker filed `first_step` after the pivot at `step`: state "running", and the
    request moves into archive/pivot-<step>/ (the record of what was asked). True if done."""
    req = read_request(layout)
    if not req or req.get("state") != "recorded" or req.get("step") != step:
        return False
    req.update(state="running", worker_pid=worker_pid, first_step=first_step,
               running_at=time.time())
    write_request(layout, req)
    dest = layout.pivot_archive(step)
    dest.mkdir(parents=True, exist_ok=True)
    request_path(layout).replace(dest / ARCHIVED_REQUEST)
    log.info("pivot %r: new worker pid %s filed step %d; phase in force", req.get("label"),
             worker_pid, first_step)
    return True


# ------------------------------------------------------------------------------ the command

def _lock_free(layout: RunLayout) -> bool:
    """True when no proxy holds the run lock (tried and released at once)."""
    from filelock import FileLock, Timeout
    lock = FileLock(str(layout.proxy_lock), timeout=0)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return False
    lock.release()
    return True


def _owner_pid(layout: RunLayout) -> int | None:
    try:
        return int(json.loads(layout.proxy_owner.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _last_filed(layout: RunLayout) -> int:
    from proxy.commands.status import tail_records
    recs = tail_records(layout.loss, 8192)
    return recs[-1]["step"] if recs else 0


def _planned_steps(layout: RunLayout, cfg: RunConfig) -> int:
    try:
        return int(json.loads((layout.root / ".status.json").read_text())["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return cfg.max_steps


def _fmt(bounds: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in sorted(bounds.items())) or "none"


def _refuse(msg: str) -> int:
    print(f"pivot refused: {msg}", file=sys.stderr)
    return EXIT_USAGE


def cmd_pivot(a) -> int:
    """The `pivot` command: 0 the new phase is in force (live: its worker filed its first step;
    stopped: recorded, the next `run` trains in it) or the request was accepted (--no-wait);
    1 the pivot did not complete (the message says what state it left); 2 refused before
    anything changed (bad bounds, a pending pivot, a finished run)."""
    from proxy.mixture.bandit import BanditConfigError
    layout = RunLayout(a.run_dir)
    if not layout.run_json.exists():
        return _refuse(missing_run_json(layout.root))
    given = bool(a.caps or a.floors)
    if given + a.keep_bounds + a.no_bounds != 1:
        from proxy.supervision.run_setup import read_phases
        try:
            ph = read_phases(layout)[-1]
            now = f"caps {_fmt(ph.caps)}, floors {_fmt(ph.floors)}"
        except (ConfigError, OSError, ValueError):  # named by the run that reads it
            now = "see `status`"
        return _refuse(("give the new phase's bounds: --caps and/or --floors, --keep-bounds "
                        "(a fresh bandit under the bounds in force) or --no-bounds (none at all)"
                        if not (given or a.keep_bounds or a.no_bounds) else
                        "--caps/--floors, --keep-bounds and --no-bounds exclude one another")
                       + f"; the phase in force has {now}")
    try:
        cfg = load_run_config(layout.run_json)
        if a.keep_bounds:
            from proxy.supervision.run_setup import read_phases
            ph = read_phases(layout)[-1]
            caps, floors = dict(ph.caps), dict(ph.floors)
        else:
            caps, floors = validated_bounds(cfg, a.caps, a.floors)
    except (ConfigError, BanditConfigError) as e:
        return _refuse(f"{e}")
    label = a.label or "pivot"
    old = pending_request(layout)
    if old is not None:
        return _refuse(f"a pivot is already pending ({REQUEST_NAME}: label {old.get('label')!r}, "
                       f"state {old.get('state')}, step {old.get('step')}); wait for it (`status` "
                       "shows it; on a stopped run `python -m proxy run` puts it in force) and "
                       "ask again once it is in force")
    req = {"label": label, "caps": caps, "floors": floors, "requested_by": os.getpid(),
           "requested_at": time.time(), "state": "requested", "step": None}
    if _lock_free(layout):
        return _pivot_stopped(layout, cfg, req, a)
    planned, last = _planned_steps(layout, cfg), _last_filed(layout)
    if last >= planned:
        return _refuse(f"{layout.root} already finished at step {last:,} (max steps {planned:,}); "
                       "nothing would train under the new policy")
    pid = _owner_pid(layout)
    write_request(layout, req)
    print(f"pivot: request {label!r} caps {caps} floors {floors} written to {REQUEST_NAME}; "
          f"live proxy pid {pid} picks the next boundary", flush=True)
    if a.no_wait:
        print("pivot: accepted (--no-wait); `python -m proxy status --run-dir DIR` shows its "
              "progress", flush=True)
        return 0
    return _wait(layout, pid, a.timeout)


def _wait(layout: RunLayout, pid: int | None, timeout: float) -> int:
    """Follow the live proxy through the pivot, printing each state once."""
    from proxy.supervision.proc_tree import pid_alive
    end, told, b, last_print = time.monotonic() + timeout, set(), None, 0.0
    while True:
        req = read_request(layout)
        if req is None and b is not None:  # moved into the archive: running
            try:
                req = json.loads((layout.pivot_archive(b) / ARCHIVED_REQUEST).read_text())
            except (OSError, ValueError):
                req = None
        state = (req or {}).get("state")
        if state == "failed":
            print(f"pivot failed: {req.get('error')}; nothing changed, the old phase runs on",
                  file=sys.stderr)
            request_path(layout).unlink(missing_ok=True)
            return EXIT_FAILED
        if req and req.get("step") is not None:
            if b is not None and req["step"] != b:
                print(f"pivot: the worker was past step {b} when the request reached it; the "
                      f"boundary is its next checkpoint, step {req['step']}", flush=True)
                told.discard("at-boundary")
            b = req["step"]
        order = ["boundary", "archived", "recorded", "running"]
        reached = order.index(state) if state in order else -1
        if reached >= 0 and "boundary" not in told:
            told.add("boundary")
            if reached > 0 or _last_filed(layout) >= b:  # the proxy was quicker than this poll:
                print(f"pivot: boundary step {b} reached", flush=True)  # still name the step
                told.add("at-boundary")
        if reached == 0 and "at-boundary" not in told and time.monotonic() - last_print >= 2.0:
            last = _last_filed(layout)
            if last >= b:
                print(f"pivot: boundary step {b} reached; the worker writes step_{b:06d}.bin and "
                      f"exits", flush=True)
                told.add("at-boundary")
            else:
                togo = b - last
                print(f"pivot: waiting for boundary step {b} ({togo} step"
                      f"{'' if togo == 1 else 's'} to go)", flush=True)
            last_print = time.monotonic()
        if reached >= 1 and "archived" not in told:
            print(f"pivot: archived to archive/pivot-{b}", flush=True)
            told.add("archived")
        if reached >= 2 and "recorded" not in told:
            from proxy.supervision.run_setup import read_phases
            ph = read_phases(layout)[-1]
            print(f"pivot: phase {ph.index} {ph.label!r} recorded (starts at step {ph.start_step}, "
                  f"caps {ph.caps}, floors {ph.floors})", flush=True)
            told.add("recorded")
            print("pivot: waiting for the new worker's first step", flush=True)
        if reached == 3:
            print(f"pivot: new worker pid {req.get('worker_pid')} filed step "
                  f"{req.get('first_step')}; the new phase is in force", flush=True)
            return 0
        if pid is not None and not pid_alive(pid):
            print(f"pivot failed: proxy pid {pid} exited during the pivot (request state "
                  f"{state}); `python -m proxy run --run-dir {layout.root}` resumes "
                  + ("in the new phase" if reached >= 2 else
                     "in the old phase and serves the request again"), file=sys.stderr)
            return EXIT_FAILED
        if time.monotonic() > end:
            print(f"pivot: not in force after {timeout:.0f} s (request state {state}, boundary "
                  f"{b}); the live proxy still holds the request and will finish it (see "
                  "`status`); nothing was undone", file=sys.stderr)
            return EXIT_FAILED
        time.sleep(0.2)


def _pivot_stopped(layout: RunLayout, cfg: RunConfig, req: dict, a) -> int:
    """A stopped run: the same steps in this command's foreground, under the run lock; the next
    `run` resumes in the new phase from the newest valid checkpoint."""
    from proxy.supervision.resume_planning import ResumeError, plan_resume
    from proxy.run_files.run_lock import RunLock
    from proxy.supervision.run_setup import read_phases
    from shared.loss_history import LossHistory
    lock = RunLock(layout, command="pivot")
    try:
        lock.acquire()
    except Exception as e:  # noqa: BLE001 - a proxy started in between
        return _refuse(f"{e}")
    try:
        history = LossHistory(layout.loss)
        try:
            last = history.last_step or 0
            planned = a.max_steps or cfg.max_steps
            if last >= planned:
                return _refuse(f"{layout.root} already finished at step {last:,} (max steps "
                               f"{planned:,}); nothing would train under the new policy. Pass "
                               f"--max-steps N with N > {last} here and to the next `run`")
            req.update(state="boundary", step=None)
            try:
                plan = plan_resume(layout, cfg, history, False, stopped_pivot=req)
            except ResumeError as e:
                request_path(layout).unlink(missing_ok=True)
                print(f"pivot failed: {e}", file=sys.stderr)
                return EXIT_FAILED
        finally:
            history.close()
        ph = read_phases(layout)[-1]
        more = f" --max-steps {a.max_steps}" if a.max_steps else ""   # not stored: pass it on
        print(f"pivot: archived to archive/pivot-{plan.step}", flush=True)
        print(f"pivot: phase {ph.index} {ph.label!r} recorded (starts at step {ph.start_step}, "
              f"caps {ph.caps}, floors {ph.floors}); the run is stopped: `python -m proxy run "
              f"--run-dir {layout.root}{more}` trains in it from step_{plan.step:06d}.bin",
              flush=True)
        return 0
    finally:
        lock.release()


def add_pivot_args(p) -> None:
    """The `pivot` command's options (docs/pivots.md)."""
    p.add_argument("--run-dir", required=True, metavar="DIR",
                   help="the run to pivot: live (its proxy does it in place) or stopped")
    p.add_argument("--caps", default="", help="per-arm caps, arm=value,...")
    p.add_argument("--floors", default="", help="per-arm floors, arm=value,...")
    p.add_argument("--keep-bounds", action="store_true",
                   help="the new phase keeps the caps and floors in force (a fresh bandit only)")
    p.add_argument("--no-bounds", action="store_true",
                   help="the new phase has no caps or floors at all")
    p.add_argument("--label", default=None, help="the new phase's label (default 'pivot')")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds to wait for the live pivot to be in force (900)")
    p.add_argument("--no-wait", action="store_true",
                   help="return once the live proxy has the request")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stopped run only, when it reached run.json's: the --max-steps to "
                        "pass to the next `run` (checked here, and in the command printed)")
