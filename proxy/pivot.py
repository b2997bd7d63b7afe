"""`python -m proxy pivot`: a polish pivot on a live or stopped run (SPEC section 8).

Sequence on a LIVE run (a proxy holds the run lock):
  1. validate --caps/--floors against run.json's arms (nothing is touched when they are bad);
  2. write `.pivot.request.json` naming the live proxy's pid; the proxy polls it
     (`poll_pivot_request`), picks the next cadence boundary B past the last filed step and posts
     handshake control {stop_at_step: B, reason: "pivot"}; the worker, which reads control every
     step, checkpoints `step_B.bin` (reason pivot) and exits 0, and the proxy exits 0;
  3. wait for both to be gone (the lock is free), check the newest valid checkpoint;
  4. start a new proxy detached (own session, output in logs/proxy.console.log; its log records
     go to logs/proxy.log as always) with `run --run-dir DIR` plus the hidden --pivot-* options.
     That proxy resumes from step_B.bin, moves `.samples.json`/`.state.json` to
     archive/pivot-B/, appends the new phase to phases.json (prior = the old phase's final
     mixture projected into the new box) and leaves `.loss.json` where it is.
On a STOPPED run the same happens without steps 2-3: the pivot step is the newest valid checkpoint.
The restarted proxy reuses the stopped proxy's command-line options (read from /proc) unless
--run-args is given; --caps/--floors/--from-scratch are never carried over.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from shared.atomic_io import atomic_write_json
from shared.config import ConfigError, RunConfig, load_run_config
from shared.handshake import update_handshake
from shared.run_layout import RunLayout
from proxy.proc_tree import pid_alive

log = logging.getLogger("proxy.pivot")
PROJECT_ROOT = Path(__file__).resolve().parent.parent
REQUEST_NAME = ".pivot.request.json"
# options of the old proxy that must not be carried into the restarted one (name -> takes value)
_DROP = {"--run-dir": True, "--caps": True, "--floors": True, "--pivot-label": True,
         "--pivot-caps": True, "--pivot-floors": True, "--from-scratch": False}


def request_path(layout: RunLayout) -> Path:
    return layout.root / REQUEST_NAME


# ------------------------------------------------------------------------------ proxy side

def poll_pivot_request(layout: RunLayout, cfg: RunConfig, filed_step: int) -> int | None:
    """Called by the supervisor's watch loop: answer a pending pivot request addressed to this
    proxy. Posts handshake control stop_at_step = B (the next multiple of the checkpoint cadence
    after `filed_step` + 1), reason "pivot", records B in the request file and returns it; None
    when there is nothing to do. A request for another pid (stale) is removed with a warning."""
    path = request_path(layout)
    if not path.exists():
        return None
    try:
        req = json.loads(path.read_text())
    except (OSError, ValueError):
        return None                      # being written (atomic replace): next poll
    if req.get("stop_at_step") is not None:
        return None
    if req.get("proxy_pid") != os.getpid():
        log.warning("%s addresses proxy pid %s, not this one (%d): stale, removed",
                    path.name, req.get("proxy_pid"), os.getpid())
        path.unlink(missing_ok=True)
        return None
    every = cfg.checkpoint_every
    b = ((filed_step + 1) // every + 1) * every
    update_handshake(layout, lambda d: d["control"].update(stop_at_step=b, reason="pivot"))
    req.update(stop_at_step=b, posted_at=time.time())
    atomic_write_json(path, req)
    log.info("pivot requested (by pid %s, label %r): the worker checkpoints and stops at step %d",
             req.get("by_pid"), req.get("label"), b)
    return b


# ------------------------------------------------------------------------------ bounds

def validated_bounds(cfg: RunConfig, caps_text: str, floors_text: str) -> tuple[dict, dict]:
    """Parse and check pivot bounds against the run's arms: (caps, floors) as given (arms not
    named get floor 0 and cap 1). Raises BanditConfigError naming the arm, value and rule."""
    from proxy.bandit import parse_arm_values, resolve_bounds
    names = [a.name for a in cfg.arms]
    caps = parse_arm_values(caps_text, names, "--caps")
    floors = parse_arm_values(floors_text, names, "--floors")
    resolve_bounds(names, caps, floors)
    return caps, floors


# ------------------------------------------------------------------------------ the command

def _old_run_args(pid: int) -> list[str]:
    """The `run` options of proxy `pid` (from /proc), minus the ones a pivot must not repeat."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []
    argv = [x for x in argv if x]
    if "run" not in argv:
        return []
    rest, out, i = argv[argv.index("run") + 1:], [], 0
    while i < len(rest):
        name = rest[i].split("=", 1)[0]
        if name in _DROP:
            i += 1 + (_DROP[name] and "=" not in rest[i])
            continue
        out.append(rest[i])
        i += 1
    return out


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


def start_detached(layout: RunLayout, run_args: list[str]) -> subprocess.Popen:
    """`python -m proxy run --run-dir DIR *run_args` in its own session, detached from this
    terminal; stdout/stderr appended to logs/proxy.console.log."""
    layout.logs.mkdir(parents=True, exist_ok=True)
    out = open(layout.logs / "proxy.console.log", "ab")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "proxy", "run", "--run-dir", str(layout.root), *run_args]
    try:
        return subprocess.Popen(argv, cwd=PROJECT_ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                close_fds=True)
    finally:
        out.close()


def cmd_pivot(a) -> int:
    """The `pivot` command; returns the exit code (0 done, 1 the stop failed, 2 bad input)."""
    from proxy.bandit import BanditConfigError
    from shared.checkpoint_format import find_latest_valid
    from shared.checkpoint_manifest import manifest_checksums, read_manifest
    layout = RunLayout(a.run_dir)
    try:
        cfg = load_run_config(layout.run_json)
        caps, floors = validated_bounds(cfg, a.caps, a.floors)
    except (ConfigError, BanditConfigError) as e:
        print(f"pivot refused: {e}", file=sys.stderr)
        return 2
    label = a.label or "pivot"
    run_args = shlex.split(a.run_args) if a.run_args is not None else None
    if not _lock_free(layout):
        pid = _owner_pid(layout)
        if pid is None:
            print(f"pivot: {layout.root} is locked but {layout.proxy_owner.name} names no pid; "
                  "stop the proxy first", file=sys.stderr)
            return 1
        if run_args is None:
            run_args = _old_run_args(pid)
        atomic_write_json(request_path(layout), {"proxy_pid": pid, "by_pid": os.getpid(),
                                                 "label": label, "requested_at": time.time()})
        print(f"pivot: asked proxy pid {pid} to checkpoint and stop at the next cadence boundary",
              flush=True)
        end, told = time.monotonic() + a.timeout, False
        while pid_alive(pid) or not _lock_free(layout):
            if not told:
                try:
                    b = json.loads(request_path(layout).read_text()).get("stop_at_step")
                except (OSError, ValueError):
                    b = None
                if b is not None:
                    print(f"pivot: the worker stops at step {b}", flush=True)
                    told = True
            if time.monotonic() > end:
                request_path(layout).unlink(missing_ok=True)
                print(f"pivot: proxy pid {pid} did not stop within {a.timeout:.0f} s; request "
                      "withdrawn, nothing changed (stop it with kill -TERM and pivot again)",
                      file=sys.stderr)
                return 1
            time.sleep(0.1)
        request_path(layout).unlink(missing_ok=True)
    run_args = run_args or []
    info, _ = find_latest_valid(layout.root, cfg.n_params, manifest_checksums(read_manifest(layout.root)))
    if info is None:
        print(f"pivot: {layout.root} has no valid checkpoint to pivot at", file=sys.stderr)
        return 1
    planned = cfg.max_steps
    if "--max-steps" in run_args[:-1]:
        planned = int(run_args[run_args.index("--max-steps") + 1])
    if info.step >= planned:
        print(f"pivot refused: {layout.root} already finished at step {info.step:,} (max steps "
              f"{planned:,}); nothing would train under the new policy. Pass --run-args "
              f"'--max-steps N' with N > {info.step}", file=sys.stderr)
        return 2
    entry = read_manifest(layout.root).get(info.step)
    print(f"pivot: resuming from {info.path.name} (step {info.step}, reason "
          f"{entry.reason if entry else '?'}) under phase {label!r} caps {caps} floors {floors}",
          flush=True)
    proc = start_detached(layout, [*run_args, "--pivot-label", label,
                                   "--pivot-caps", a.caps, "--pivot-floors", a.floors])
    print(f"pivot: new proxy pid {proc.pid} (detached; output in "
          f"{layout.logs / 'proxy.console.log'}), training to step {planned:,} with run options: "
          f"{' '.join(shlex.quote(x) for x in run_args) or '(none: run.json settings)'}",
          flush=True)
    return 0


def add_pivot_args(p) -> None:
    """`pivot --run-dir DIR [--caps ...] [--floors ...] [--label L] [--timeout S] [--run-args ...]`."""
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the run to pivot (live or stopped)")
    p.add_argument("--caps", default="", help="per-arm caps, arm=value,...")
    p.add_argument("--floors", default="", help="per-arm floors, arm=value,...")
    p.add_argument("--label", default=None, help="the new phase's label (default 'pivot')")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the live run to stop at the boundary")
    p.add_argument("--run-args", default=None,
                   help="options for the restarted `run` (default: the stopped proxy's own)")
