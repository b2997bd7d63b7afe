"""`python -m proxy run`: create or resume a run and supervise it
(docs/operations.md#start-and-resume), with the settings table it prints at the start.

What it is not: the command list (proxy/cli.py), the `run` options
(proxy/commands/run_args.py), the several-node owner election (proxy/supervision/election.py)
or the supervision (proxy/supervision/supervisor.py).
"""

from __future__ import annotations

import itertools
import logging
import logging.handlers
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from proxy.commands.run_args import (
    add_run_args as add_run_args,  # `run`'s options, for proxy/cli.py
)
from proxy.commands.run_args import (
    check_resume_args,
    check_run_options,
    config_from_args,
    launch_options,
    proxy_options,
)
from proxy.mixture.arm_changes import commit_arm_set, plan_arm_set
from proxy.mixture.bandit import BanditConfigError
from proxy.run_files.phases import read_phases
from proxy.run_files.run_lock import RunLock, RunLockError
from proxy.supervision.election import OwnedJob, Yielded, gather_job
from proxy.supervision.follower import follow
from proxy.supervision.proc_tree import EarlySignals
from proxy.supervision.run_setup import create_run
from proxy.supervision.supervisor import Supervisor, SupervisorError
from shared.data.arms import ArmSourceError, parse_arm_option
from shared.data.token_files import read_arm_index
from shared.exit_codes import EXIT_OK, EXIT_USAGE
from shared.processes import seconds_since_start
from shared.run.config import (
    AUDIT_BUDGET,
    AUDIT_TOKENS,
    DEFAULT_ARMS,
    POLICY_BUDGET,
    ConfigError,
    RunConfig,
    accumulation_steps,
    audit_cost,
    default_eval_every,
    default_sample_every,
    eval_cost,
    load_run_config,
    policy_cost,
    probe_plan,
)
from shared.run.layout import RunLayout, foreign_entries
from shared.run.stop_request import StopRequested

log = logging.getLogger("proxy")

LOG_BYTES = 16 * 2**20  # logs/proxy.log rotates at this size ...
LOG_BACKUPS = 4  # ... keeping this many older files (proxy.log.1 .. .4)


def setup_logging(layout: RunLayout | None) -> None:
    fmt = logging.Formatter("%(asctime)s proxy[%(process)d] %(levelname)s %(message)s")
    root = logging.getLogger()
    # INFO, or the level named by ANDREA_LOG_LEVEL (e.g. DEBUG: the start-up stage times,
    # docs/operations.md#benchmarks), which the worker inherits and reads too
    level = logging.getLevelName(os.environ.get("ANDREA_LOG_LEVEL", "INFO").upper())
    root.setLevel(level if isinstance(level, int) else logging.INFO)
    logging.getLogger("filelock").setLevel(max(logging.INFO, root.level))  # one line per lock
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(fmt)
    root.handlers[:] = [h]
    logging.captureWarnings(True)  # library warnings (e.g. a garbage manifest) as log lines
    if layout is not None:
        layout.logs.mkdir(parents=True, exist_ok=True)
        fh = logging.handlers.RotatingFileHandler(
            layout.proxy_log, maxBytes=LOG_BYTES, backupCount=LOG_BACKUPS
        )
        fh.setFormatter(fmt)
        root.addHandler(fh)


def _apply_arm_list(a, cfg: RunConfig, layout: RunLayout, notes: list[str]) -> RunConfig:
    """`--arm ...` on a restart is the run's new arm list, matched by name
    (docs/operations.md#changing-the-arms); without --arm the arms stay. Raises ConfigError
    (nothing written) for a changed source under an old name or bounds the arms left cannot meet.
    `notes` (warnings about the options) are logged once the new arm list is valid, before
    anything is tokenized; without --arm they, and an ignored --default-arms, are left in `notes`
    for the caller to log."""
    if not a.arm:
        if a.default_arms:
            notes.append(
                "--default-arms without --arm ignored: the run keeps its arms ("
                + ", ".join(x.name for x in cfg.arms)
                + ")"
            )
        return cfg
    specs = (list(DEFAULT_ARMS) if a.default_arms else []) + [parse_arm_option(t) for t in a.arm]
    phase = read_phases(layout)[-1]
    plan = plan_arm_set(layout, cfg, specs, phase.caps, phase.floors)
    for message in notes:  # the resume is valid: said before the new arms are tokenized
        log.warning("%s", message)
    notes.clear()
    if not plan.changes_anything:
        return cfg
    return commit_arm_set(layout, cfg, plan)


def _entries(root: Path) -> set[str] | None:
    """The names in `root` when it is a directory (what a refused start leaves), else None."""
    try:
        return set(os.listdir(root))
    except OSError:
        return None


def _remove_refused(layout: RunLayout, made: list[Path], before: set[str] | None) -> None:
    """A start refused before it wrote any data leaves nothing it created: the run directory
    and the parents made for it are removed; in a directory that already existed (`before`: its
    names then), what this start added (its lock and owner file) but logs/, whose log `status`
    quotes (shared/run/layout.py `last_creation_error`). A directory that holds a tokenizer or
    token files (work a rerun keeps) is left as it is."""
    if layout.tokenizer.exists() or (layout.data.is_dir() and any(layout.data.iterdir())):
        return
    for h in list(logging.getLogger().handlers):  # the log file inside it
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename).is_relative_to(layout.root):
            logging.getLogger().removeHandler(h)
            h.close()
    if made:
        shutil.rmtree(made[0], ignore_errors=True)
        for p in made[1:]:
            try:
                p.rmdir()
            except OSError:
                break
        log.info("%s removed: this refused start had created it", made[-1])
        return
    added = sorted((_entries(layout.root) or set()) - (before or set()) - {layout.logs.name})
    for name in added:
        p = layout.root / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if added:
        log.info(
            "removed what this refused start had added to %s: %s", layout.root, ", ".join(added)
        )


def cmd_run(a) -> int:
    """The `run` command: create or resume the run in --run-dir and supervise its training
    (docs/operations.md). Exit codes: shared/exit_codes.py (0 done or stopped cleanly, 2 refused
    before training, others from the supervisor)."""
    EarlySignals.install()  # stop/SIGUSR1 during creation: remembered, never fatal

    setup_logging(None)
    layout = RunLayout(a.run_dir)
    if _prepare_directory(a, layout) is not None:
        return EXIT_USAGE
    # what a refusal below removes again: the directories mkdir(parents=True) creates, deepest first
    root = layout.root.absolute()
    made = list(itertools.takewhile(lambda d: not d.exists(), [root, *root.parents]))
    before = _entries(layout.root)  # (in a directory that exists: what it held)
    if _make_directory(layout) is not None:
        return EXIT_USAGE
    launch = launch_options(a)
    job = None
    if launch.multi_node:  # several nodes: the first proxy to take the lock owns the run
        job = {
            "token": uuid.uuid4().hex,
            "rdzv_id": launch.rdzv_id,
            "nnodes": launch.nodes,
            "nproc_per_node": launch.nproc_per_node,
        }
    lock = RunLock(layout, job=job)
    try:
        lock.acquire()
    except RunLockError as e:
        if job is not None:  # the owner of this job holds it: follow (nothing written but
            return follow(layout, launch, a.stop_timeout, job, e)
        setup_logging(layout)
        log.error("%s", e)
        return EXIT_USAGE
    setup_logging(layout)
    log.debug(
        "start-up: proxy interpreter, imports and run lock %.3f s since launch",
        seconds_since_start() or 0.0,
    )
    owned = OwnedJob()
    code = None  # the exit code, for the owner's node record (None: an exception escaped)
    try:
        code = _run_locked(a, layout, lock, job, owned, made, before)
        return code
    finally:
        if owned.node is not None:
            owned.node.leave(exit_code=code)
        lock.release()


def _run_locked(
    a,
    layout: RunLayout,
    lock: RunLock,
    job: dict | None,
    owned: OwnedJob,
    made: list[Path],
    before: set[str] | None,
) -> int:
    """cmd_run once the run lock is held: gather the nodes, open or create the run,
    supervise; returns the exit code (the caller releases the lock and leaves the job)."""
    try:
        if job is not None:
            try:
                code = gather_job(layout, lock, job, launch_options(a), owned)
            except Yielded as y:  # an earlier claim of this directory won: follow it
                setup_logging(None)  # a follower writes nothing in the run directory
                return follow(
                    layout, launch_options(a), a.stop_timeout, job, RunLockError("", y.owner)
                )
            if code is not None:
                return code
        cfg, resumed, creation_s = _open_run(a, layout)
        _print_settings(cfg, a, resumed, layout)
        opts = proxy_options(a, cfg)  # torchrun: the world size must divide the batch
        sup = Supervisor(layout, cfg, opts, creation_s=creation_s, node=owned.node)
        sup.install_signal_handlers()
        code = sup.run()
        log.info("proxy exiting with code %d at step %s", code, sup.stats.step)
        return code
    except (ConfigError, BanditConfigError) as e:
        log.error("%s", e)
        lock.release()
        _remove_refused(layout, made, before)
        return EXIT_USAGE
    except SupervisorError as e:
        log.error("%s", e)
        return e.code
    except StopRequested as e:
        log.info(
            "%s; nothing is lost: the same command goes on from there, keeping the "
            "tokenizer, every complete arm and the tokenized part of the arm in progress "
            "while their source files (list, sizes, modification times) are unchanged",
            e,
        )
        return EXIT_OK


def _prepare_directory(a, layout: RunLayout) -> int | None:
    """Refusals before anything is written: bad options, or a --run-dir that holds what is not
    a run's. Returns EXIT_USAGE (logged) or None."""
    try:
        check_run_options(a)
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_USAGE
    if not layout.run_json.exists() and (alien := foreign_entries(layout.root)):
        log.error(
            "--run-dir %s: holds files that are not a run's (%s%s); a new run needs a new "
            "or empty directory (or one whose creation was interrupted): give another "
            "--run-dir",
            layout.root,
            ", ".join(alien[:5]),
            f" and {len(alien) - 5} more" if len(alien) > 5 else "",
        )
        return EXIT_USAGE
    return None


def _make_directory(layout: RunLayout) -> int | None:
    """Create the run directory and logs/; EXIT_USAGE (logged, naming the path and the cause)
    when it cannot be, else None."""
    try:
        layout.root.mkdir(parents=True, exist_ok=True)
        layout.logs.mkdir(exist_ok=True)
    except OSError as e:  # a file in the way, no permission, a read-only filesystem
        what = (
            "is a file, not a directory"
            if layout.root.is_file()
            else f"cannot be created ({e.strerror or e})"
        )
        log.error(
            "--run-dir %s: %s; give a directory path (an existing run, or a new path "
            "whose parent you may write to)",
            layout.root,
            what,
        )
        return EXIT_USAGE
    return None


def _open_run(a, layout: RunLayout) -> tuple[RunConfig, bool, float | None]:
    """(config, resumed, creation seconds or None): the run in `layout` resumed with the
    options it may change, or created from the options (shared/data/token_files, run_setup). Raises
    ConfigError / BanditConfigError (refused) and StopRequested (stopped during creation)."""
    notes: list[str] = []  # warnings about the settings: logged once they are known valid
    if layout.run_json.exists():
        cfg = load_run_config(layout.run_json)
        check_resume_args(a, cfg, layout, notes)
        cfg = _apply_arm_list(a, cfg, layout, notes)
        for message in notes:
            log.warning("%s", message)
        log.info(
            "resuming run %s (%s, %s parameters)", layout.root, cfg.preset, f"{cfg.n_params:,}"
        )
        return cfg, True, None
    cfg = config_from_args(a, notes)
    log.info("creating run %s (%s)", layout.root, cfg.preset)
    t_create = time.monotonic()
    cfg = create_run(layout, cfg, notes)
    creation_s = time.monotonic() - t_create
    log.info(
        "created: %s parameters, vocabulary %d, checkpoint %s bytes",
        f"{cfg.n_params:,}",
        cfg.vocab_size,
        f"{cfg.checkpoint_bytes:,}",
    )
    return cfg, False, creation_s


def _print_settings(cfg: RunConfig, a, resumed: bool, layout: RunLayout) -> None:
    """llm.c habit: one table of every setting the run uses, at start, with where each value
    came from: the command line, the --config file, the default, or run.json (a resumed run's
    creation settings; docs/configuration.md#where-a-value-came-from)."""
    sources = getattr(a, "sources", {})
    world = launch_options(a).world_size()
    micro = a.micro_batch_size or cfg.micro_batch_size or cfg.batch_size // world
    accum = accumulation_steps(cfg.batch_size, micro, world)

    def src(*dests: str, per_start: bool = False) -> str:
        """Where the row's values came from: on a resume, run.json for every value fixed at
        creation (a command-line value for one of them was ignored with a warning)."""
        if resumed and not per_start:
            return "run.json"
        got = [sources.get(d, "default") for d in dests]
        return next((g for g in got if g != "default"), "default")

    def kept(dest: str, from_run_json: bool) -> str:
        """A per-start value: the command line's when given, else on a resume run.json's (when
        the value shown is run.json's), else the default."""
        got = src(dest, per_start=True)
        return "run.json" if resumed and got == "default" and from_run_json else got

    micro_src = kept("micro_batch_size", not a.micro_batch_size and bool(cfg.micro_batch_size))
    arms_src = kept("arm", True)  # --arm on a resume is the run's new arm list
    warm_src = src("warmup_steps")
    if not resumed and warm_src == "default" and cfg.warmup_steps != RunConfig.warmup_steps:
        warm_src = "shortened to a tenth of max steps"  # a short run (config_from_args)
    audit_src = src("sample_every")
    if not resumed and audit_src == "default" and cfg.sample_every != cfg.checkpoint_every:
        audit_src = (
            f"checkpoint cadence x {cfg.sample_every // cfg.checkpoint_every}, "
            f"to stay within {AUDIT_BUDGET:.1%}"
        )
    rows = [
        ("preset", cfg.preset, src("preset")),
        ("parameters", f"{cfg.n_params:,}", ""),
        (
            "layers/heads/width/context",
            f"{cfg.model.n_layer}/{cfg.model.n_head}/{cfg.model.n_embd}/{cfg.model.block_size}",
            src("preset"),
        ),
        ("tokenizer", f"{cfg.tokenizer} ({cfg.vocab_size} tokens)", src("tokenizer")),
        ("batch (sequences/update)", cfg.batch_size, src("batch_size")),
        ("micro-batch (sequences/rank)", micro, micro_src),
        (
            "micro-batches per update",
            f"{accum} on each of {world} rank(s)",
            micro_src if micro_src != "default" else src("nproc_per_node", per_start=True),
        ),
        ("tokens per update", f"{cfg.batch_size * cfg.model.block_size:,}", src("batch_size")),
        ("max steps", a.max_steps or cfg.max_steps, kept("max_steps", not a.max_steps)),
        ("lr peak", cfg.lr, src("lr")),
        (
            f"lr warm-up / {cfg.schedule} end (steps)",
            f"{cfg.warmup_steps}/{cfg.lr_decay_steps}"
            + "".join(f", re-planned at {r['at']} to {r['lr_decay_steps']}" for r in cfg.replans),
            warm_src
            if warm_src == src("max_steps")
            else f"warm-up {warm_src}, end {src('max_steps')}",
        ),
        (
            "weight decay / grad clip",
            f"{cfg.weight_decay}/{cfg.grad_clip}",
            src("weight_decay", "grad_clip"),
        ),
        (
            "checkpoint/sample/probe every",
            f"{cfg.checkpoint_every}/{cfg.sample_every}/{cfg.probe_every}",
            src("checkpoint_every", "sample_every", "probe_every"),
        ),
        ("held-out probe", _probe_row(cfg), src("probe_sequences", "probe_budget")),
        ("sample audit", _audit_row(cfg), audit_src),
        ("validation", _eval_row(cfg), src("eval_every")),
        ("policy overhead", _policy_row(cfg), src("probe_budget", "sample_every")),
        (
            "retention keep-last/keep-every",
            f"{a.keep_last}/{a.keep_every}",
            src("keep_last", "keep_every", per_start=True),
        ),
        (
            "device / precision",
            f"{a.device}/{a.precision}",
            src("device", "precision", per_start=True),
        ),
        ("arms", _arms_row(cfg, layout), arms_src),
        (
            "phase / caps / floors",
            _bounds_row(layout),
            "phases.json" if resumed else src("caps", "floors"),
        ),
        ("reward", cfg.reward, src("reward")),
        ("seed", cfg.seed, src("seed")),
    ]
    if getattr(a, "config", None):
        rows.insert(0, ("config file", a.config, "command line"))
    w = max(len(k) for k, _, _ in rows)
    vw = max(len(str(v)) for _, v, _ in rows)
    for k, v, where in rows:
        log.info("  %s  %s  %s", k.ljust(w), str(v).ljust(vw), f"[{where}]" if where else "")


def _arms_row(cfg: RunConfig, layout: RunLayout) -> str:
    """The configured arms, those retired (a zombie whose source went, an arm left out) named
    apart: run.json keeps a zombie in its list, and showing it as trained would be a lie."""
    names = [x.name for x in cfg.arms]
    try:
        index = read_arm_index(layout, include_retired=True)
    except (ArmSourceError, OSError, ValueError):  # no data/ yet, or unreadable: resume names it
        index = {}
    retired = [n for n in names if n in index and index[n].retired]
    active = ", ".join(n for n in names if n not in retired) or "none"
    return active + (f" (retired: {', '.join(retired)})" if retired else "")


def _bounds_row(layout: RunLayout) -> str:
    """The phase in force (the last one in phases.json: a pivot recorded on a stopped run is in
    force from this start) with its caps and floors; "-" when there is no phases.json yet."""
    if not layout.phases.exists():
        return "-"
    ph = read_phases(layout)[-1]

    def fmt(d: dict, op: str) -> str:
        return ", ".join(f"{k}{op}{v:g}" for k, v in sorted(d.items())) or "none"

    return (
        f"{ph.index} {ph.label!r} (from step {ph.start_step}): caps {fmt(ph.caps, '<=')}; "
        f"floors {fmt(ph.floors, '>=')}"
    )


def _probe_row(cfg: RunConfig) -> str:
    """The probe's size and its cost in training compute (shared/run/config.py probe_plan)."""
    pp = probe_plan(cfg)
    if not pp.active:
        return f"none: reward {cfg.reward} reads the training losses (0% of training FLOPs)"
    return (
        f"{pp.sequences} x {cfg.model.block_size} tokens per arm every {pp.every} steps = "
        f"{pp.cost:.2%} of training FLOPs (budget {cfg.probe_budget:.1%})"
    )


def _audit_row(cfg: RunConfig) -> str:
    """The sample audits' size and cost (shared/run/config.py audit_cost)."""
    cost = audit_cost(cfg)
    row = (
        f"{len(cfg.arms)} arms x {AUDIT_TOKENS} tokens every {cfg.sample_every} steps <= "
        f"{cost:.2%} of training FLOPs"
    )
    if cost > AUDIT_BUDGET + 1e-9:
        row += f" (over {AUDIT_BUDGET:.1%}: --sample-every {default_sample_every(cfg)} keeps it within)"
    return row


def _eval_row(cfg: RunConfig) -> str:
    """The validation curve's size and cost (shared/run/config.py eval_cost)."""
    if not cfg.eval_every:
        return f"none (--eval-every 0; {default_eval_every(cfg)} keeps it within 1% of training)"
    return (
        f"held-out loss of {len(cfg.arms)} arms x {cfg.eval_sequences} windows every "
        f"{cfg.eval_every} steps = {eval_cost(cfg):.2%} of training FLOPs"
    )


def _policy_row(cfg: RunConfig) -> str:
    """Probe plus audits, the compute the mixture policy spends (shared/run/config.py policy_cost)."""
    plan, audits = probe_plan(cfg), audit_cost(cfg)
    probe = f"probe {plan.cost:.2%}" if plan.active else "no probe"
    row = f"{probe} + audits {audits:.2%} = {policy_cost(cfg):.2%} of training FLOPs"
    if policy_cost(cfg) > POLICY_BUDGET + 1e-9:
        row += f" (over the default {POLICY_BUDGET:.0%})"
    return row
