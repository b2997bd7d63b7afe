"""`python -m proxy COMMAND`: the operator's interface (docs/operations.md#start-and-resume).

The commands are listed in COMMANDS below, once; each module defines its own command's options
(`add_*_args`) and its `cmd_*` function. `run` is here: create or resume a run, supervise it.

What it is not: the `run` options (proxy/run_options.py) or the supervision (proxy/supervisor.py).
"""
from __future__ import annotations

import argparse
import logging
import logging.handlers
import signal
import sys

from proxy.run_options import add_run_args, check_resume_args, check_run_options, \
    config_from_args, proxy_options
from shared.config import (AUDIT_BUDGET, AUDIT_TOKENS, POLICY_BUDGET, ConfigError, DEFAULT_ARMS,
                           RunConfig, audit_cost, default_sample_every, load_run_config,
                           policy_cost, probe_plan)
from shared.exit_codes import EXIT_OK, EXIT_USAGE
from shared.run_layout import RunLayout, foreign_entries

log = logging.getLogger("proxy")

LOG_BYTES = 16 * 2**20   # logs/proxy.log rotates at this size ...
LOG_BACKUPS = 4          # ... keeping this many older files (proxy.log.1 .. .4)

def _setup_logging(layout: RunLayout | None) -> None:
    fmt = logging.Formatter("%(asctime)s proxy[%(process)d] %(levelname)s %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(fmt)
    root.handlers[:] = [h]
    logging.captureWarnings(True)  # library warnings (e.g. a garbage manifest) as log lines
    if layout is not None:
        layout.logs.mkdir(parents=True, exist_ok=True)
        # bounded: a weeks-long run's log rotates at LOG_BYTES into LOG_BACKUPS older files
        fh = logging.handlers.RotatingFileHandler(layout.logs / "proxy.log", maxBytes=LOG_BYTES,
                                                  backupCount=LOG_BACKUPS)
        fh.setFormatter(fmt)
        root.addHandler(fh)


def _apply_arm_list(a, cfg: RunConfig, layout: RunLayout) -> RunConfig:
    """`--arm ...` on a restart is the run's new arm list, matched by name: new names
    are tokenized and join at the resume step, names left out are retired there, names listed
    again after a removal re-join with their statistics (proxy/arm_changes.py). Without --arm
    the arms stay as they are. Raises ConfigError (nothing written) for a changed source under
    an old name or bounds the arms left cannot meet."""
    if not a.arm:
        if a.default_arms:
            log.warning("--default-arms without --arm ignored: the run keeps its arms (%s)",
                        ", ".join(x.name for x in cfg.arms))
        return cfg
    from proxy.arm_changes import commit_arm_set, plan_arm_set
    from proxy.run_setup import read_phases
    from shared.arms import parse_arm_option
    specs = (list(DEFAULT_ARMS) if a.default_arms else []) + [parse_arm_option(t) for t in a.arm]
    phase = read_phases(layout)[-1]
    plan = plan_arm_set(layout, cfg, specs, phase.caps, phase.floors)
    if not plan.changes_anything:
        return cfg
    return commit_arm_set(layout, cfg, plan)


def cmd_run(a) -> int:
    from proxy.proc_tree import EarlySignals
    EarlySignals.install()  # stop/SIGUSR1 during creation: remembered, never fatal
    from proxy.run_lock import RunLock, RunLockError
    from proxy.run_setup import create_run
    from proxy.supervisor import Supervisor, SupervisorError
    from proxy.bandit import BanditConfigError
    from shared.stop_request import StopRequested

    _setup_logging(None)
    try:
        check_run_options(a)
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_USAGE
    layout = RunLayout(a.run_dir)
    if not layout.run_json.exists() and (alien := foreign_entries(layout.root)):
        log.error("--run-dir %s: holds files that are not a run's (%s%s); a new run needs a new "
                  "or empty directory (or one whose creation was interrupted): give another "
                  "--run-dir", layout.root, ", ".join(alien[:5]),
                  f" and {len(alien) - 5} more" if len(alien) > 5 else "")
        return EXIT_USAGE
    try:
        layout.root.mkdir(parents=True, exist_ok=True)
        layout.logs.mkdir(exist_ok=True)
    except OSError as e:  # a file in the way, no permission, a read-only filesystem
        what = ("is a file, not a directory" if layout.root.is_file()
                else f"cannot be created ({e.strerror or e})")
        log.error("--run-dir %s: %s; give a directory path (an existing run, or a new path "
                  "whose parent you may write to)", layout.root, what)
        return EXIT_USAGE
    nodes = _nodes_of(a)
    job = None
    if nodes > 1:  # several nodes: the first proxy to take the lock owns the run
        import uuid
        job = {"token": uuid.uuid4().hex, "rdzv_id": a.rdzv_id, "nnodes": nodes,
               "nproc_per_node": a.nproc_per_node}
    lock = RunLock(layout, job=job)
    try:
        lock.acquire()
    except RunLockError as e:
        if job is not None:  # the owner of this job holds it: follow (nothing written but
            from proxy.follower import follow  # this node's record)
            return follow(layout, a, job, e)
        _setup_logging(layout)
        log.error("%s", e)
        return EXIT_USAGE
    _setup_logging(layout)
    node = None
    try:
        if job is not None:
            from proxy.nodes import NodeRecord, NodeSetupError, wait_for_followers
            from proxy.nodes import write_job
            idle = _owner_checks(a, job, layout)
            if idle is None:
                return EXIT_USAGE
            node = NodeRecord(layout, "owner", 0, job["token"], a.nproc_per_node)
            node.write()
            node.start_heartbeat()  # also through creation, resume planning, back-off
            write_job(layout, {**job, "state": "gathering", "incarnation": 0})  # not the last owner's
            log.info("owner of %s (node rank 0 of %d, global rank 0 here): waiting up to %.0f s "
                     "for the other node(s)", layout.root, nodes, a.rdzv_timeout)
            try:  # before anything of the run is written: a job that cannot form writes nothing
                if wait_for_followers(layout, job["token"], nodes, a.rdzv_timeout,
                                      lambda: EarlySignals.stop is not None,
                                      lambda: (node.heartbeat(), idle())) is None:
                    log.info("%s received while the nodes gathered: nothing started", EarlySignals.stop)
                    return EXIT_OK
            except NodeSetupError as e:
                log.error("%s", e)
                return EXIT_USAGE
        resumed = layout.run_json.exists()
        if resumed:
            cfg = load_run_config(layout.run_json)
            check_resume_args(a, cfg, layout)
            cfg = _apply_arm_list(a, cfg, layout)
            log.info("resuming run %s (%s, %s parameters)", layout.root, cfg.preset, f"{cfg.n_params:,}")
        else:
            cfg = config_from_args(a)
            log.info("creating run %s (%s)", layout.root, cfg.preset)
            cfg = create_run(layout, cfg)
            log.info("created: %s parameters, vocabulary %d, checkpoint %s bytes",
                     f"{cfg.n_params:,}", cfg.vocab_size, f"{cfg.checkpoint_bytes:,}")
        _print_settings(cfg, a, resumed=resumed, layout=layout)
        opts = proxy_options(a, cfg)  # torchrun: the world size must divide the batch
        sup = Supervisor(layout, cfg, opts)
        sup.node = node
        sup.install_signal_handlers()
        code = sup.run()
        log.info("proxy exiting with code %d at step %s", code, sup.stats.step)
        return code
    except (ConfigError, BanditConfigError) as e:
        log.error("%s", e)
        return EXIT_USAGE
    except SupervisorError as e:
        log.error("%s", e)
        return e.code
    except StopRequested as e:
        log.info("%s; nothing is lost: the same command goes on from there, keeping the "
                 "tokenizer and every complete arm whose source files (list, sizes, modification "
                 "times) are unchanged", e)
        return EXIT_OK
    finally:
        if node is not None:
            node.leave()
        lock.release()


def _owner_checks(a, job: dict, layout: RunLayout):
    """The owner of a multi-node job serves the job beacon at --rdzv-endpoint when that is its
    host (proxy/beacon.py), else asks it: a beacon of the same job id for another owner means
    this --run-dir is not the job's directory. Returns None (refused, logged) or the check to
    repeat while the nodes gather (it raises NodeSetupError)."""
    import os
    import socket
    import time
    from proxy import beacon
    from proxy.nodes import NodeSetupError
    info = {"rdzv_id": a.rdzv_id, "token": job["token"], "run_dir": str(layout.root),
            "host": socket.gethostname(), "pid": os.getpid()}
    if beacon.serve(a.rdzv_endpoint, info):
        return lambda: None
    why = beacon.second_owner(a.rdzv_endpoint, a.rdzv_id, job["token"], layout.root)
    if why:
        log.error("%s", why)
        return None
    last = [time.monotonic()]

    def again() -> None:  # the endpoint's node may start later
        if time.monotonic() - last[0] > 2.0:
            last[0] = time.monotonic()
            why = beacon.second_owner(a.rdzv_endpoint, a.rdzv_id, job["token"], layout.root)
            if why:
                raise NodeSetupError(why)
    return again


def _nodes_of(a) -> int:
    """Nodes of the job from --nnodes (checked by check_run_options)."""
    return int(str(a.nnodes).split(":")[-1]) if a.nnodes else 1


def _print_settings(cfg: RunConfig, a, resumed: bool = False, layout: RunLayout | None = None) -> None:
    """llm.c habit: one table of every setting the run uses, at start, with where each value
    came from: the command line, the --config file, the default, or run.json (a resumed run's
    creation settings; docs/configuration.md#where-a-value-came-from)."""
    from shared.config import accumulation_steps
    sources = getattr(a, "sources", {})
    world = a.nproc_per_node * (int(str(a.nnodes).split(":")[-1]) if a.nnodes else 1)
    micro = a.micro_batch_size or cfg.micro_batch_size or cfg.batch_size // world
    accum = accumulation_steps(cfg.batch_size, micro, world)

    def src(*dests: str, per_start: bool = False) -> str:
        """Where the row's values came from: on a resume, run.json for every value fixed at
        creation (a command-line value for one of them was ignored with a warning)."""
        if resumed and not per_start:
            return "run.json"
        got = [sources.get(d, "default") for d in dests]
        return next((g for g in got if g != "default"), "default")

    arms_src = src("arm", per_start=True)  # --arm on a resume is the run's new arm list
    if resumed and arms_src == "default":
        arms_src = "run.json"
    warm_src = src("warmup_steps")
    if not resumed and warm_src == "default" and cfg.warmup_steps != RunConfig.warmup_steps:
        warm_src = "shortened to a tenth of max steps"  # a short run (config_from_args)
    audit_src = src("sample_every")
    if not resumed and audit_src == "default" and cfg.sample_every != cfg.checkpoint_every:
        audit_src = (f"checkpoint cadence x {cfg.sample_every // cfg.checkpoint_every}, "
                     f"to stay within {AUDIT_BUDGET:.1%}")
    rows = [("preset", cfg.preset, src("preset")), ("parameters", f"{cfg.n_params:,}", ""),
            ("layers/heads/width/context", f"{cfg.model.n_layer}/{cfg.model.n_head}/"
                                           f"{cfg.model.n_embd}/{cfg.model.block_size}", src("preset")),
            ("tokenizer", f"{cfg.tokenizer} ({cfg.vocab_size} tokens)", src("tokenizer")),
            ("batch (sequences/update)", cfg.batch_size, src("batch_size")),
            ("micro-batch (sequences/rank)", micro, src("micro_batch_size", per_start=True)),
            ("micro-batches per update", f"{accum} on each of {world} rank(s)",
             src("micro_batch_size", "nproc_per_node", per_start=True)),
            ("tokens per update", f"{cfg.batch_size * cfg.model.block_size:,}", src("batch_size")),
            ("max steps", a.max_steps or cfg.max_steps, src("max_steps", per_start=True)),
            ("lr peak", cfg.lr, src("lr")),
            ("lr warm-up / cosine end (steps)", f"{cfg.warmup_steps}/{cfg.lr_decay_steps}",
             warm_src if warm_src == src("max_steps") else
             f"warm-up {warm_src}, end {src('max_steps')}"),
            ("weight decay / grad clip", f"{cfg.weight_decay}/{cfg.grad_clip}",
             src("weight_decay", "grad_clip")),
            ("checkpoint/sample/probe every", f"{cfg.checkpoint_every}/{cfg.sample_every}/{cfg.probe_every}",
             src("checkpoint_every", "sample_every", "probe_every")),
            ("held-out probe", _probe_row(cfg), src("probe_sequences", "probe_budget")),
            ("sample audit", _audit_row(cfg), audit_src),
            ("policy overhead", _policy_row(cfg), src("probe_budget", "sample_every")),
            ("retention keep-last/keep-every", f"{a.keep_last}/{a.keep_every}",
             src("keep_last", "keep_every", per_start=True)),
            ("device / precision", f"{a.device}/{a.precision}", src("device", "precision", per_start=True)),
            ("arms", _arms_row(cfg, layout), arms_src),
            ("phase / caps / floors", _bounds_row(layout), "phases.json" if resumed
             else src("caps", "floors")),
            ("reward", cfg.reward, src("reward")), ("seed", cfg.seed, src("seed"))]
    if getattr(a, "config", None):
        rows.insert(0, ("config file", a.config, "command line"))
    w = max(len(k) for k, _, _ in rows)
    vw = max(len(str(v)) for _, v, _ in rows)
    for k, v, where in rows:
        log.info("  %s  %s  %s", k.ljust(w), str(v).ljust(vw), f"[{where}]" if where else "")


def _arms_row(cfg: RunConfig, layout: RunLayout | None) -> str:
    """The configured arms, those retired (a zombie whose source went, an arm left out) named
    apart: run.json keeps a zombie in its list, and showing it as trained would be a lie."""
    from shared.arm_data import read_arm_index
    from shared.arms import ArmSourceError
    names = [x.name for x in cfg.arms]
    try:
        index = read_arm_index(layout, include_retired=True) if layout is not None else {}
    except (ArmSourceError, OSError, ValueError):  # no data/ yet, or unreadable: the resume names it
        index = {}
    retired = [n for n in names if n in index and index[n].retired]
    active = ", ".join(n for n in names if n not in retired) or "none"
    return active + (f" (retired: {', '.join(retired)})" if retired else "")


def _bounds_row(layout: RunLayout | None) -> str:
    """The phase in force (the last one in phases.json: a pivot recorded on a stopped run is in
    force from this start) with its caps and floors; "-" when there is no run directory yet."""
    from proxy.run_setup import read_phases
    if layout is None or not layout.phases.exists():
        return "-"
    ph = read_phases(layout)[-1]

    def fmt(d: dict, op: str) -> str:
        return ", ".join(f"{k}{op}{v:g}" for k, v in sorted(d.items())) or "none"
    return (f"{ph.index} {ph.label!r} (from step {ph.start_step}): caps {fmt(ph.caps, '<=')}; "
            f"floors {fmt(ph.floors, '>=')}")


def _probe_row(cfg: RunConfig) -> str:
    """The probe's size and its cost in training compute (shared/config.py probe_plan)."""
    pp = probe_plan(cfg)
    return (f"{pp.sequences} x {cfg.model.block_size} tokens per arm every {pp.every} steps = "
            f"{pp.cost:.2%} of training FLOPs (budget {cfg.probe_budget:.1%})")


def _audit_row(cfg: RunConfig) -> str:
    """The sample audits' size and cost (shared/config.py audit_cost)."""
    cost = audit_cost(cfg)
    row = (f"{len(cfg.arms)} arms x {AUDIT_TOKENS} tokens every {cfg.sample_every} steps <= "
           f"{cost:.2%} of training FLOPs")
    if cost > AUDIT_BUDGET + 1e-9:
        row += f" (over {AUDIT_BUDGET:.1%}: --sample-every {default_sample_every(cfg)} keeps it within)"
    return row


def _policy_row(cfg: RunConfig) -> str:
    """Probe plus audits, the compute the mixture policy spends (shared/config.py policy_cost)."""
    pp, audits = probe_plan(cfg).cost, audit_cost(cfg)
    row = f"probe {pp:.2%} + audits {audits:.2%} = {policy_cost(cfg):.2%} of training FLOPs"
    if policy_cost(cfg) > POLICY_BUDGET + 1e-9:
        row += f" (over the default {POLICY_BUDGET:.0%})"
    return row


COMMANDS = (  # name, one line of help; each command's options are defined by its own module
    ("run", "create or resume a run and supervise its worker"),
    ("status", "step, loss and EMA, tokens/s, last checkpoint, arm probabilities, worker health"),
    ("inspect", "check and describe a checkpoint: header, validity, checksum, parameters, norms"),
    ("sample", "generate text from a checkpoint"),
    ("pivot", "polish pivot in place: new caps and floors, a fresh bandit, same weights, "
              "history and proxy"),
    ("fork", "audit fork: a new run from another run's checkpoint and its history"),
    ("plot", "PNG of loss and EMA, pivots, held-out loss per arm, the arm mixture"),
    ("export", "a checkpoint as safetensors, or as a Hugging Face model folder (--format hf)"),
)


def build_parser() -> argparse.ArgumentParser:
    """The `python -m proxy` parser: one sub-command per COMMANDS entry, each with `func`."""
    from proxy import checkpoint_tools, fork, pivot, plot, sample_cmd, status
    ap = argparse.ArgumentParser(
        prog="python -m proxy",
        description="ANDREA's training system: the supervising proxy and its tools "
                    "(docs/README.md).")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    helps = dict(COMMANDS)
    setup = {"run": (add_run_args, cmd_run),
             "status": (status.add_status_args, status.cmd_status),
             "inspect": (checkpoint_tools.add_inspect_args, checkpoint_tools.cmd_inspect),
             "sample": (sample_cmd.add_sample_args, sample_cmd.cmd_sample),
             "pivot": (pivot.add_pivot_args, pivot.cmd_pivot),
             "fork": (fork.add_fork_args, fork.cmd_fork),
             "plot": (plot.add_plot_args, plot.cmd_plot),
             "export": (checkpoint_tools.add_export_args, checkpoint_tools.cmd_export)}
    for name, _ in COMMANDS:
        add_args, func = setup[name]
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        add_args(p)
        p.set_defaults(func=func)
    return ap


def main(argv: list[str] | None = None) -> int:
    # SIGUSR1's default action kills: ignore it until the supervisor installs its handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # --config FILE.toml: command line > file > default
        from proxy.run_config_file import parse_run_args
        _setup_logging(None)
        sub = next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction))
        try:
            a = parse_run_args(sub.choices["run"], argv[1:])
        except ConfigError as e:
            log.error("%s", e)
            return EXIT_USAGE
        a.cmd, a.func = "run", cmd_run
    else:
        a = ap.parse_args(argv)
    return a.func(a)
