"""`python -m proxy status --run-dir DIR [--json]`: how a run is doing, live or stopped
(docs/operations.md#status, which lists the files it reads). Reads only; takes no lock, so it
never disturbs a running proxy. Exit 0, or 2 when DIR is not a run directory.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time

from proxy.mixture.bandit import Bandit, BanditConfigError
from proxy.observation.progress import wall_seconds_per_update
from proxy.run_files.checkpoint_lookup import run_dir_problem
from proxy.run_files.loss_ema import loss_ema
from proxy.run_files.phases import bounds_text, phase_entries
from proxy.run_files.pivot_request import pending_request
from proxy.run_files.run_lock import read_owner
from proxy.run_files.sidecars import read_state
from proxy.run_files.status_file import read_status
from proxy.supervision.nodes import node_records, read_node_record, record_alive
from shared.checkpoint.directory import list_checkpoints, scan_for_resume
from shared.checkpoint.manifest import manifest_checksums, read_manifest
from shared.exit_codes import EXIT_USAGE
from shared.processes import alive, process_state
from shared.run.config import ConfigError, accumulation_steps, load_run_config
from shared.run.handshake import read_handshake
from shared.run.layout import RunLayout, creating_proxy
from shared.run.loss_history import holes, tail_records

STALE_S = 30.0  # no step for this long (and 10x the usual step time): stalled


def _proxy_alive(owner: dict | None, run_dir) -> bool:
    """True if the lock holder named in .proxy.owner.json is a live process on this host that
    started before it wrote the file (so not a recycled pid); the owner of a multi-node job on
    another host: its node record's heartbeat is fresh (proxy/supervision/nodes.py)."""
    if owner and owner.get("job") and owner.get("host") != socket.gethostname():
        rec = read_node_record(RunLayout(run_dir), owner["host"], owner["pid"])
        return rec is not None and record_alive(rec)
    if not owner or owner.get("host") != socket.gethostname():
        return False
    return alive(owner.get("pid"), owner.get("started_at", 0))


def collect_status(run_dir) -> dict:
    """Everything `status` shows, as a dict (the `--json` output): the plan, progress,
    checkpoints, arms, phase, processes and a one-line health, in that order."""
    layout = RunLayout(run_dir)
    cfg = load_run_config(layout.run_json)
    st = read_status(layout)
    owner = read_owner(layout)
    worker = read_handshake(layout).get("worker") or {}
    recs = tail_records(layout.loss)
    now = time.time()

    # the run's plan is run.json's; a live proxy may have been given another --max-steps
    # for this start, which the ETA uses while it runs
    d: dict = {
        "run_dir": str(layout.root),
        "preset": cfg.preset,
        "n_params": cfg.n_params,
        "max_steps": cfg.max_steps,
        "start_max_steps": st.get("max_steps") or cfg.max_steps,
    }
    d.update(_progress(cfg, recs, now))
    d["validation"] = _validation(cfg, recs)
    d["history_holes"] = holes(layout.loss)  # steps a repair of .loss.json dropped
    d.update(_checkpoints(layout, now))
    state = read_state(layout.state, garbage="default")
    d["arms"] = _arms(state, recs[-1] if recs else None)
    d["policy"] = _policy(state, st)
    d.update(_phase_and_pivot(layout))
    proxy_alive = _proxy_alive(owner, layout.root)
    d["target_steps"] = d["start_max_steps"] if proxy_alive else d["max_steps"]
    d.update(_batch_and_eta(cfg, worker, recs, d["step"], d["target_steps"]))
    wpid = st.get("worker_pid") or worker.get("pid")
    wstate = process_state(wpid) if wpid else None  # R, S, D, T, Z...; None: no such process
    worker_alive = wstate not in (None, "Z", "X")
    d.update(
        proxy_pid=(owner or {}).get("pid"),
        proxy_host=(owner or {}).get("host"),
        lock_holder=(owner or {}).get("command", "run"),
        proxy_alive=proxy_alive,
        worker_pid=wpid if worker_alive else None,
        worker_pids=worker.get("pids") if worker_alive else [],
        worker_state=wstate,
    )
    d["nodes"] = _nodes(layout, owner)
    # the proxy writes proxy_alive false as it ends, whatever ended it but SIGKILL, the OOM
    # killer or a power loss: a dead proxy whose last word says alive never ran its end
    d["proxy_ended_cleanly"] = None if proxy_alive else not st.get("proxy_alive", False)
    d["health"] = _health(d, recs, worker, run_dir)
    return d


def _step_times(recs: list[dict]) -> list[float]:
    """The worker's own seconds per update over the last 20 records that have one."""
    return [r["step_time"] for r in recs[-20:] if isinstance(r.get("step_time"), (int, float))]


def _progress(cfg, recs: list[dict], now: float) -> dict:
    """step, loss and its EMA, tokens/s, the last step's age (s) and the recent skipped updates,
    from the history's tail `recs`."""
    last = recs[-1] if recs else None
    recent = recs[-20:]
    times = _step_times(recs)
    tok_per_step = cfg.batch_size * cfg.model.block_size
    tps = [r["tokens_per_s"] for r in recent if isinstance(r.get("tokens_per_s"), (int, float))]
    wall = wall_seconds_per_update(recs)
    # wall-clock tokens/s over the ETA's window (checkpoints and audits included, as the progress
    # line's ETA); too few records for a window: the worker's own figures, averaged by time
    tokens_per_s = (
        tok_per_step / wall
        if wall
        else tok_per_step * len(tps) / sum(tok_per_step / t for t in tps)
        if tps and all(t > 0 for t in tps)
        else tok_per_step * len(times) / sum(times)
        if times and sum(times) > 0
        else None
    )
    return {
        "step": last["step"] if last else 0,
        "loss": last.get("loss") if last else None,
        "loss_ema": loss_ema(recs),
        "tokens_per_s": tokens_per_s,
        "last_step_age_s": now - last["time"] if last and last.get("time") else None,
        "skipped_recent": sum(1 for r in recent if r.get("skipped")),
    }


def _validation(cfg, recs: list[dict]) -> dict:
    """The newest validation in the history's tail: {"every": steps (0: none), "step": its step
    or None, "arms": {arm: held-out loss}} (docs/history.md#record, the `eval` field)."""
    r: dict = next((r for r in reversed(recs) if isinstance(r.get("eval"), dict) and r["eval"]), {})
    return {"every": cfg.eval_every, "step": r.get("step"), "arms": r.get("eval", {})}


def _checkpoints(layout: RunLayout, now: float) -> dict:
    """The invalid checkpoints found above the newest valid one (each message names its file),
    the newest valid one with its manifest entry, and every checkpoint step present."""
    entries = read_manifest(layout.root)
    info, rejected = scan_for_resume(layout.root, None, manifest_checksums(entries))
    newest = None
    if info is not None:
        e = entries.get(info.step)
        newest = {
            "step": info.step,
            "file": info.path.name,
            "reason": e.reason if e else None,
            "pinned": e.pinned if e else None,
            "age_s": now - e.time if e else None,
        }
    return {
        "invalid_checkpoints": [str(exc) for exc in rejected],  # each names its file
        "last_checkpoint": newest,
        "checkpoints": [step for step, _ in list_checkpoints(layout.root)],
    }


def _arms(state: dict | None, last: dict | None) -> dict:
    """Each arm's probability, pulls and repetition hold, from `.state.json`'s `state`; else the
    newest record's probabilities; else nothing."""
    if state and state.get("arms"):
        held = (state.get("repetition") or {}).get("held") or {}
        return {
            n: {"p": a.get("p"), "pulls": a.get("pulls"), "held": held.get(n)}
            for n, a in sorted(state["arms"].items())
        }
    if last and last.get("p"):
        return {n: {"p": p, "pulls": None} for n, p in sorted(last["p"].items())}
    return {}


def _policy(state: dict | None, st: dict) -> dict | None:
    """Why the mixture is what it is (`Bandit.explain()`, docs/bandit.md#reading-the-policy): the
    live proxy's from `.status.json` `st`, or the one `.state.json`'s `state` gives when that is
    missing or older (a stopped run since pivoted, say); a file of the wrong shape is skipped."""

    def at(d: dict, phase) -> tuple[int, ...]:
        return tuple(k if isinstance(k, int) else -1 for k in (phase, d.get("step")))

    live = st.get("policy") if isinstance(st.get("policy"), dict) else None
    if live is not None and not isinstance(live.get("arms"), dict):
        live = None
    if isinstance(state, dict) and state:
        phase = state.get("phase")
        index = phase.get("index") if isinstance(phase, dict) else None
        if live is None or at(live, live.get("phase")) < at(state, index):
            with contextlib.suppress(
                ValueError, KeyError, TypeError, AttributeError, BanditConfigError
            ):
                return Bandit.from_dict(state).explain()
    return live


def _phase_and_pivot(layout: RunLayout) -> dict:
    """The current phase (phases.json's newest entry) and the pivot request waiting, if any."""
    entries = phase_entries(layout)
    if not entries and layout.phases.exists():  # never silent: `run` refuses such a file
        print(
            f"status: warning: {layout.phases}: unreadable; the phase is not shown", file=sys.stderr
        )
    ph = (entries or [{}])[-1]
    req = pending_request(layout)
    return {
        "phase": {k: ph.get(k) for k in ("index", "label", "start_step", "caps", "floors")},
        "pivot_request": (
            {k: req.get(k) for k in ("label", "caps", "floors", "state", "step", "requested_at")}
            if req
            else None
        ),
    }


def _health(d: dict, recs: list[dict], worker: dict, run_dir) -> str:
    """One line on the run's health from the collected status `d` (processes, step, plan), the
    history's tail `recs` and the handshake's worker entry."""
    last = recs[-1] if recs else None
    times = _step_times(recs)
    usual = (sum(times) / len(times)) if times else 0.0
    age = d["last_step_age_s"]
    wpid, wstate = d["worker_pid"], d["worker_state"]
    worker_alive = wstate not in (None, "Z", "X")
    if d["proxy_alive"] and worker_alive:
        if wstate == "T":
            return f"STOPPED (worker pid {wpid} is stopped: SIGSTOP?); the proxy's hang timeout will act"
        if age is None or (
            worker.get("started_at") and last and last.get("time", 0) < worker["started_at"]
        ):
            return "starting (worker up, no step yet)"
        if age > max(STALE_S, 10 * usual):
            return f"STALLED: no step for {age:.0f} s (worker state {wstate})"
        return "running"
    if d["proxy_alive"]:
        return "proxy up, no worker (starting, restarting or finishing)"
    if worker_alive:
        return (
            f"PROXY GONE but worker pid {wpid} still runs (it should checkpoint and exit "
            "within seconds)"
        )
    if d["step"] >= d["max_steps"]:
        return "finished"
    if d["start_max_steps"] != d["max_steps"] and d["step"] >= d["start_max_steps"]:
        return (
            f"stopped at the last start's --max-steps {d['start_max_steps']:,}, before the "
            f"plan's {d['max_steps']:,} (resume with `python -m proxy run --run-dir "
            f"{run_dir}`)"
        )
    if d.get("proxy_ended_cleanly") is False:
        ckpt = (d.get("last_checkpoint") or {}).get("step") or 0
        lost = (
            f"steps {ckpt + 1:,}..{d['step']:,} after the newest checkpoint are trained again"
            if d["step"] > ckpt
            else "the newest checkpoint holds the last step: nothing is lost"
        )
        return (
            f"stopped uncleanly: proxy pid {d['proxy_pid']} ended without its stop (kill -9, "
            f"the OOM killer, a reboot?); {lost} (resume with `python -m proxy run --run-dir "
            f"{run_dir}`)"
        )
    return f"stopped (resume with `python -m proxy run --run-dir {run_dir}`)"


def _nodes(layout: RunLayout, owner: dict | None) -> list[dict]:
    """The nodes of a multi-node run's current job (docs/architecture.md#several-nodes): each
    node record of the owner's job (host, pid, role, node rank, its ranks' pids, heartbeat age,
    alive); [] for a single-node run."""
    token = ((owner or {}).get("job") or {}).get("token")
    if not token:
        return []
    now = time.time()
    return [
        {
            **{
                k: r.get(k)
                for k in ("node_rank", "role", "host", "pid", "agent_pid", "incarnation")
            },
            "ranks": r.get("ranks") or [],
            "alive": record_alive(r),
            "heartbeat_age_s": now - float(r.get("heartbeat") or 0),
        }
        for r in node_records(layout)
        if r.get("token") == token
    ]


def _batch_and_eta(cfg, worker: dict, recent: list[dict], step: int, max_steps: int) -> dict:
    """Tokens per update, micro-batches per update (docs/configuration.md#batch-and-accumulation:
    the running worker's figures, else run.json's) and the projected seconds to `max_steps` at
    `wall_seconds_per_update` (proxy/observation/progress.py; None before 3 steps)."""
    world = worker.get("world_size") or 1
    accum = worker.get("accumulation_steps")
    micro = worker.get("micro_batch_size")
    if accum is None:
        try:
            accum = accumulation_steps(cfg.batch_size, cfg.micro_batch_size, world)
        except ConfigError:
            accum = None
        micro = cfg.micro_batch_size or cfg.batch_size // world
    per_step = wall_seconds_per_update(recent) if len(recent) >= 3 else None
    return {
        "tokens_per_update": cfg.batch_size * cfg.model.block_size,
        "micro_batches_per_update": accum,
        "micro_batch_size": micro,
        "world_size": world,
        "seconds_per_update": per_step,
        "eta_s": per_step * max(0, max_steps - step) if per_step is not None else None,
    }


def _duration(s: float) -> str:
    s = int(s)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return f"{d}d {h}h {m}m" if d else f"{h}h {m}m" if h else f"{m}m {s % 60}s"


def format_status(d: dict) -> str:
    """The human-readable table of `collect_status`'s dict: who runs it, the phase, training
    progress, the newest checkpoint and the arms, one line each (`nodes`: one per node)."""
    return "\n".join(
        _run_lines(d)
        + _phase_lines(d)
        + _progress_lines(d)
        + _checkpoint_lines(d)
        + _arm_lines(d)
        + _policy_lines(d)
    )


def _holder(d: dict) -> str:
    """Who holds (or last held) the run lock, in words."""
    if not d["proxy_pid"]:
        return "no proxy (none has held the run lock)"
    if d.get("lock_holder", "run") == "run":
        return (
            f"proxy pid {d['proxy_pid']} on {d['proxy_host']} "
            f"({'alive' if d['proxy_alive'] else 'not running'})"
        )
    # a stopped run's pivot took the lock last: that pid was never a proxy
    return (
        f"no proxy since the `{d['lock_holder']}` command (pid {d['proxy_pid']}, "
        f"{'running' if d['proxy_alive'] else 'done'}) last held the run lock"
    )


def _run_lines(d: dict) -> list[str]:
    """run, health, processes, step, and each node of a multi-node run."""
    lines = [
        f"run         {d['run_dir']}  ({d['preset']}, {d['n_params']:,} parameters)",
        f"health      {d['health']}",
        f"processes   {_holder(d)}, worker pid {d['worker_pid'] or '-'}"
        + (f" (state {d['worker_state']})" if d["worker_pid"] else ""),
        f"step        {d['step']:,} / {d['max_steps']:,}"
        + (
            f" (this start: --max-steps {d['target_steps']:,})"
            if d["target_steps"] != d["max_steps"]
            else ""
        )
        + (
            f"  (last step {d['last_step_age_s']:.0f} s ago)"
            if d["last_step_age_s"] is not None
            else ""
        ),
    ]
    for n in d.get("nodes") or []:
        lines.append(
            f"node {n['node_rank']}      {n['role']} proxy pid {n['pid']} on {n['host']} "
            f"({'alive' if n['alive'] else 'gone'}, heartbeat {n['heartbeat_age_s']:.0f} s "
            f"ago), ranks {', '.join(map(str, n['ranks'])) or '-'}"
        )
    return lines


def _phase_lines(d: dict) -> list[str]:
    """The current phase and a pending pivot request."""
    lines = []
    ph = d.get("phase") or {}
    if ph.get("index") is not None:
        lines.append(
            f"phase       {ph['index']} {ph['label']!r} from step {ph['start_step']:,}  "
            f"caps {bounds_text(ph.get('caps'))}  floors {bounds_text(ph.get('floors'))}"
        )
    pr = d.get("pivot_request")
    if pr:
        at = f", at step {pr['step']:,}" if pr.get("step") is not None else ""
        lines.append(
            f"pivot       pending: {pr['label']!r} ({pr['state']}{at}) caps "
            f"{bounds_text(pr.get('caps'))} floors {bounds_text(pr.get('floors'))}"
        )
    return lines


def _progress_lines(d: dict) -> list[str]:
    """loss and its EMA, skipped updates, tokens/s, the update's shape and the projection."""
    lines = []
    if d["loss"] is not None:
        ema = f"{d['loss_ema']:.4f}" if d["loss_ema"] is not None else "-"
        lines.append(f"loss        {d['loss']:.4f}  (EMA {ema})")
    elif d["step"]:
        lines.append("loss        non-finite (update skipped)")
    if d["skipped_recent"]:
        lines.append(f"skipped     {d['skipped_recent']} of the last 20 updates (non-finite loss)")
    if d.get("history_holes"):
        gaps = d["history_holes"]
        lines.append(
            f"history     {sum(b - a + 1 for a, b in gaps):,} steps missing from .loss.json: "
            + ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in gaps[:5])
            + (f" (+{len(gaps) - 5} more)" if len(gaps) > 5 else "")
            + " (a repair dropped damaged records; see the .loss.json.damaged-* copy)"
        )
    v = d.get("validation") or {}
    if v.get("arms"):
        lines.append(
            f"validation  (step {v['step']:,}) "
            + ", ".join(f"{a} {x:.3f}" for a, x in sorted(v["arms"].items()))
        )
    elif v.get("every"):
        lines.append(f"validation  none yet (every {v['every']} steps)")
    if d["tokens_per_s"]:
        lines.append(f"tokens/s    {d['tokens_per_s']:,.0f}")
    if d.get("tokens_per_update"):
        acc = d.get("micro_batches_per_update")
        lines.append(
            f"update      {d['tokens_per_update']:,} tokens"
            + (
                f", {acc} micro-batch(es) of {d['micro_batch_size']} sequences on each of "
                f"{d['world_size']} rank(s)"
                if acc
                else ""
            )
        )
    if d.get("eta_s") is not None:
        lines.append(
            f"projected   {_duration(d['eta_s'])} to step {d['target_steps']:,} "
            f"({d['seconds_per_update']:.2f} s per update)"
        )
    return lines


def _checkpoint_lines(d: dict) -> list[str]:
    """The newest valid checkpoint, then every invalid one above it."""
    c = d["last_checkpoint"]
    if c:
        extra = ", ".join(
            x
            for x in (
                c["reason"],
                "pinned" if c["pinned"] else None,
                f"{c['age_s']:.0f} s ago" if c["age_s"] is not None else None,
            )
            if x
        )
        lines = [f"checkpoint  {c['file']} (step {c['step']:,}" + (f", {extra})" if extra else ")")]
    else:
        lines = ["checkpoint  none yet"]
    return lines + [f"INVALID     {bad}" for bad in d.get("invalid_checkpoints", [])]


def _arm_lines(d: dict) -> list[str]:
    """Each arm's probability, pulls and repetition hold, on one line."""
    if not d["arms"]:
        return []
    return [
        "arms        "
        + "  ".join(
            f"{n}: p={a['p']:.3f}"
            + (f" pulls={a['pulls']}" if a.get("pulls") is not None else "")
            + (f" held<={a['held']:.3f} (repetitive)" if a.get("held") is not None else "")
            for n, a in d["arms"].items()
            if a.get("p") is not None
        )
    ]


def _policy_lines(d: dict) -> list[str]:
    """The policy's evidence: for the default, what it waits for or why it moved, then per arm
    the fitted slope and its standard error, fitted periods, epochs, share-steps owed, target
    and posted share;
    for an EXP3 reward, per arm the log-weight, the reward EMA and the posted share."""
    pol = d.get("policy")
    if not pol or "why" not in pol:
        return []

    def num(x, fmt: str) -> str:
        ok = isinstance(x, (int, float)) and not isinstance(x, bool)
        return format(x, fmt) if ok else "-"

    lines = [f"policy      {pol.get('reward')} at step {pol.get('step')}: {pol['why']}"]
    arms = {n: a for n, a in pol["arms"].items() if isinstance(a, dict)}
    # (heading, key, format, width) per column, then the note a row may end with
    if pol.get("reward") != "train_slope":  # EXP3: the log-weights and the rewards behind them
        cols = [("log-weight", "log_weight", ".4f", 10), ("reward ema", "reward_ema", ".4f", 10)]
        note = "held", "  held at {:.3f} (repetition)"
    else:
        cols = [("slope", "slope", ".4f", 8), ("se", "slope_se", ".4f", 8)]
        cols += [("periods", "periods", "d", 7), ("epochs", "epochs", ".2f", 7)]
        cols += [("owed", "owed", ".1f", 7), ("target", "target", ".3f", 7)]
        note = "repeated_at", "  past one epoch at step {}"
    cols.append(("posted", "posted", ".3f", 7))
    lines.append(f"            {'arm':<20}" + "".join(f" {h:>{w}}" for h, _, _, w in cols))
    for n, a in arms.items():
        lines.append(
            f"            {n:<20}"
            + "".join(f" {num(a.get(k), f):>{w}}" for _, k, f, w in cols)
            + (note[1].format(a[note[0]]) if a.get(note[0]) else "")
        )
    return lines


def add_status_args(p) -> None:
    """`status --run-dir DIR [--json]`."""
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the run to describe")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")


def cmd_status(a) -> int:
    """`python -m proxy status --run-dir DIR [--json]`."""
    layout = RunLayout(a.run_dir)
    if (problem := run_dir_problem(layout.root)) is not None:
        if layout.root.is_dir() and creating_proxy(layout.root) is not None:
            print(problem[1])  # alive and creating: not an error
            return 0
        print(problem[1], file=sys.stderr)
        return problem[0]
    try:
        d = collect_status(layout.root)
    except ConfigError as e:  # run.json unreadable: one line naming it, as `run` says it
        print(f"status: {e}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(a, "json", False):
        print(json.dumps(d, indent=1, sort_keys=True))
    else:
        print(format_status(d))
    return 0
