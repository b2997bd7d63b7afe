"""`python -m proxy COMMAND`: the operator's interface (SPEC section 6).

  run      create or resume a run and supervise its worker
  status   step, loss and EMA, tokens/s, last checkpoint, arm probabilities, worker health
  inspect  a checkpoint: header, validity, checksum, parameter table, norms
  sample   text from a checkpoint
  pivot    polish pivot: stop at the next boundary, restart with new caps/floors (SPEC 8)
  fork     audit fork: a new run from another run's checkpoint and history
  plot     PNG of loss and EMA, pivots, held-out loss per arm, the arm mixture
  export   a checkpoint's weights as model.safetensors (named tensors)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from shared.config import PRESETS, ArmSpec, ConfigError, RunConfig, DEFAULT_ARMS, load_run_config
from shared.run_layout import RunLayout

log = logging.getLogger("proxy")

# Options that define the run and are fixed at creation (run.json); on resume they must match.
CREATION_ONLY = ("preset", "tokenizer", "seed", "batch_size", "lr", "checkpoint_every",
                 "sample_every", "warmup_steps")


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
        fh = logging.FileHandler(layout.logs / "proxy.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--run-dir", required=True, help="run directory (created if missing)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="model shape (default andrea-tiny; fixed at creation)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many updates")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="cadence in steps (100)")
    ap.add_argument("--sample-every", type=int, default=None,
                    help="sample audit cadence in steps (default: the checkpoint cadence)")
    ap.add_argument("--probe-every", type=int, default=None,
                    help="held-out probe cadence = bandit policy period, steps (25)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per update")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate")
    ap.add_argument("--warmup-steps", type=int, default=None, help="learning-rate warm-up, steps")
    ap.add_argument("--caps", default="", help="per-arm caps, arm=value,...")
    ap.add_argument("--floors", default="", help="per-arm floors, arm=value,...")
    ap.add_argument("--tokenizer", default=None, metavar="bpe|bytes|PATH",
                    help="bpe (trained at creation), bytes, or an existing tokenizer.json")
    ap.add_argument("--bpe-sample-bytes", type=int, default=None,
                    help="BPE training sample over all text arms, characters (8,000,000)")
    ap.add_argument("--arm-max-tokens", type=int, default=None,
                    help="explicit cap on tokens per arm (default: every token of every arm)")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=KIND:SOURCE",
                    help="add an arm: text:PATH|DIR|GLOB, jsonl:PATH|DIR|GLOB[:FIELD] (.gz/.zst too), "
                         "parquet:PATH|DIR|GLOB[:COLUMN], tokens:PATH[:u16|u32] (repeatable); "
                         "replaces the three defaults unless --default-arms is given; on a restart "
                         "the run's new arm list, matched by name: new names join, names left out "
                         "are retired, statistics stay with each name")
    ap.add_argument("--default-arms", action="store_true", help="keep the default arms with --arm")
    ap.add_argument("--reward", choices=("heldout_progress", "train_loss"), default=None)
    ap.add_argument("--bandit-warmup", type=int, default=None, help="steps on the prior (200)")
    ap.add_argument("--usr1-at", choices=("step", "boundary"), default="step",
                    help="SIGUSR1 checkpoint after the current step, or at the next cadence boundary")
    ap.add_argument("--keep-last", type=int, default=3, help="checkpoints kept (>= 2)")
    ap.add_argument("--keep-every", type=int, default=10000, help="also keep every M-th step (0 = off)")
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--hang-timeout", type=float, default=300.0, help="seconds without a report")
    ap.add_argument("--stop-timeout", type=float, default=120.0, help="seconds for a clean stop")
    ap.add_argument("--print-every", type=int, default=10, help="steps between progress lines")
    ap.add_argument("--from-scratch", action="store_true",
                    help="start at step 0 even though the history has records but no checkpoint")
    from proxy.launch import add_launch_args
    add_launch_args(ap)  # --nproc-per-node, --nnodes, --node-rank, --rdzv-*, --compile (issue 6)


def _config_from_args(a) -> RunConfig:
    from proxy.bandit import parse_arm_values
    from shared.arms import parse_arm_option
    cfg = RunConfig()
    if a.preset:
        cfg.preset = a.preset
        cfg.model = PRESETS[a.preset]
    for name in ("seed", "batch_size", "lr", "checkpoint_every", "probe_every", "warmup_steps",
                 "tokenizer", "reward", "bandit_warmup", "bpe_sample_bytes", "arm_max_tokens"):
        v = getattr(a, name, None)
        if v is not None:
            setattr(cfg, name, v)
    if a.max_steps is not None:
        cfg.max_steps = cfg.lr_decay_steps = a.max_steps
    if cfg.warmup_steps >= cfg.lr_decay_steps:
        if a.warmup_steps is not None:
            raise ConfigError(f"--warmup-steps {cfg.warmup_steps} must be below --max-steps "
                              f"{cfg.max_steps} (the cosine schedule ends there)")
        cfg.warmup_steps = cfg.lr_decay_steps // 10
        log.warning("a %d-step run: learning-rate warm-up shortened to %d steps",
                    cfg.max_steps, cfg.warmup_steps)
    cfg.sample_every = a.sample_every if a.sample_every is not None else cfg.checkpoint_every
    if a.arm:
        arms = [parse_arm_option(t) for t in a.arm]
        cfg.arms = (list(DEFAULT_ARMS) if a.default_arms else []) + arms
    names = [x.name for x in cfg.arms]
    cfg.caps = parse_arm_values(a.caps, names, "--caps")
    cfg.floors = parse_arm_values(a.floors, names, "--floors")
    return cfg


def _check_resume_args(a, cfg: RunConfig, layout: RunLayout) -> None:
    """Creation-only options given on a resume must match run.json (SPEC section 3)."""
    if a.preset and a.preset != cfg.preset:
        from shared.config import count_parameters
        n_new = count_parameters(PRESETS[a.preset], cfg.vocab_size)
        raise ConfigError(f"{layout.run_json}: this run is {cfg.preset} ({cfg.n_params:,} "
                          f"parameters); --preset {a.preset} has {n_new:,}: the architecture "
                          "cannot change on resume; use a new --run-dir (or `fork`)")
    for name in CREATION_ONLY[1:]:
        v = getattr(a, name, None)
        if v is not None and v != getattr(cfg, name):
            log.warning("--%s %s ignored: this run was created with %s (run.json); the value "
                        "is fixed for the life of the run", name.replace("_", "-"), v,
                        getattr(cfg, name))
    if a.caps or a.floors:
        raise ConfigError("--caps/--floors on an existing run would change the policy mid-phase; "
                          "use `python -m proxy pivot --run-dir DIR --caps ... --floors ...`")


def _apply_arm_list(a, cfg: RunConfig, layout: RunLayout) -> RunConfig:
    """`--arm ...` on a restart is the run's new arm list, matched by name (issue 5): new names
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


def check_run_options(a) -> None:
    """Refuse bad supervision numbers before anything is created or started (SPEC section 9).
    Raises ConfigError naming the option, the value and the rule."""
    rules = [("--keep-last", a.keep_last, a.keep_last >= 2,
              "must be >= 2 (the newest checkpoint may still be being written)"),
             ("--keep-every", a.keep_every, a.keep_every >= 0, "must be >= 0 (0 = off)"),
             ("--max-restarts", a.max_restarts, a.max_restarts >= 0, "must be >= 0"),
             ("--hang-timeout", a.hang_timeout, a.hang_timeout > 0, "must be > 0 seconds"),
             ("--stop-timeout", a.stop_timeout, a.stop_timeout > 0, "must be > 0 seconds"),
             ("--print-every", a.print_every, a.print_every >= 1, "must be >= 1 step"),
             ("--seed", a.seed, a.seed is None or 0 <= a.seed < 2**63,
              "must be in [0, 2**63) (numpy seeds are non-negative)")]
    if a.max_steps is not None:
        rules.append(("--max-steps", a.max_steps, a.max_steps >= 1, "must be >= 1"))
    keep = getattr(a, "samples_keep", 1)
    rules.append(("--samples-keep", keep, keep >= 1, "must be >= 1"))
    for name, value, ok, rule in rules:
        if not ok:
            raise ConfigError(f"{name} {value}: {rule}")


def cmd_run(a) -> int:
    from proxy.proc_tree import EarlySignals
    EarlySignals.install()  # stop/SIGUSR1 during creation: remembered, never fatal (issue 4)
    from proxy.run_lock import RunLock, RunLockError
    from proxy.run_setup import create_run
    from proxy.supervisor import ProxyOptions, Supervisor, SupervisorError
    from proxy.bandit import BanditConfigError

    _setup_logging(None)
    try:
        check_run_options(a)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    layout = RunLayout(a.run_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    _setup_logging(layout)
    lock = RunLock(layout)
    try:
        lock.acquire()
    except RunLockError as e:
        log.error("%s", e)
        return 2
    try:
        if layout.run_json.exists():
            cfg = load_run_config(layout.run_json)
            _check_resume_args(a, cfg, layout)
            cfg = _apply_arm_list(a, cfg, layout)
            log.info("resuming run %s (%s, %s parameters)", layout.root, cfg.preset, f"{cfg.n_params:,}")
        else:
            cfg = _config_from_args(a)
            log.info("creating run %s (%s)", layout.root, cfg.preset)
            cfg = create_run(layout, cfg)
            log.info("created: %s parameters, vocabulary %d, checkpoint %s bytes",
                     f"{cfg.n_params:,}", cfg.vocab_size, f"{cfg.checkpoint_bytes:,}")
        _print_settings(cfg, a)
        opts = ProxyOptions(max_steps=a.max_steps, usr1_at=a.usr1_at, device=a.device,
                            keep_last=a.keep_last, keep_every=a.keep_every,
                            max_restarts=a.max_restarts, hang_timeout=a.hang_timeout,
                            stop_timeout=a.stop_timeout, print_every=a.print_every,
                            from_scratch=a.from_scratch)
        from proxy.pivot import apply_run_extras
        apply_run_extras(a, opts, cfg)  # --samples-keep, --stop-on-collapse, hidden --pivot-*
        from proxy.launch import apply_launch_args
        apply_launch_args(a, opts, cfg)  # torchrun options; world size must divide the batch
        sup = Supervisor(layout, cfg, opts)
        sup.install_signal_handlers()
        code = sup.run()
        log.info("proxy exiting with code %d at step %s", code, sup.stats.step)
        return code
    except (ConfigError, BanditConfigError) as e:
        log.error("%s", e)
        return 2
    except SupervisorError as e:
        log.error("%s", e)
        return e.code
    finally:
        lock.release()


def _print_settings(cfg: RunConfig, a) -> None:
    """llm.c habit: one table of every setting the run uses, at start."""
    rows = [("preset", cfg.preset), ("parameters", f"{cfg.n_params:,}"),
            ("layers/heads/width/context", f"{cfg.model.n_layer}/{cfg.model.n_head}/"
                                           f"{cfg.model.n_embd}/{cfg.model.block_size}"),
            ("tokenizer", f"{cfg.tokenizer} ({cfg.vocab_size} tokens)"),
            ("batch (sequences/step)", cfg.batch_size), ("max steps", a.max_steps or cfg.max_steps),
            ("lr peak/warm-up/decay end", f"{cfg.lr}/{cfg.warmup_steps}/{cfg.lr_decay_steps}"),
            ("weight decay / grad clip", f"{cfg.weight_decay}/{cfg.grad_clip}"),
            ("checkpoint/sample/probe every", f"{cfg.checkpoint_every}/{cfg.sample_every}/{cfg.probe_every}"),
            ("arms", ", ".join(x.name for x in cfg.arms)), ("reward", cfg.reward),
            ("seed", cfg.seed)]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        log.info("  %s  %s", k.ljust(w), v)


def cmd_status(a) -> int:
    from proxy.status import cmd_status as status  # issue 4: proxy/status.py
    return status(a)


def main(argv: list[str] | None = None) -> int:
    # SIGUSR1's default action kills: ignore it until the supervisor installs its handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    ap = argparse.ArgumentParser(prog="python -m proxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    from proxy import fork, pivot, plot
    p = sub.add_parser("run", help="create or resume a run and supervise it")
    _add_run_args(p)
    pivot.add_run_extras(p)
    pivot.add_pivot_parser(sub)
    fork.add_fork_parser(sub)
    plot.add_plot_parser(sub)
    p = sub.add_parser("status", help="show a run's progress and health")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    from proxy import checkpoint_tools
    checkpoint_tools.add_inspect_args(sub.add_parser("inspect", help="check and describe a checkpoint file"))
    checkpoint_tools.add_export_args(sub.add_parser("export", help="write a checkpoint's weights as safetensors"))
    from proxy import sample_cmd
    sample_cmd.add_sample_parser(sub)
    a = ap.parse_args(argv)
    if a.cmd == "sample":
        return sample_cmd.cmd_sample(a)
    if a.cmd == "run":
        return cmd_run(a)
    if a.cmd in ("pivot", "fork", "plot"):
        return {"pivot": pivot.cmd_pivot, "fork": fork.cmd_fork, "plot": plot.cmd_plot}[a.cmd](a)
    if a.cmd == "status":
        return cmd_status(a)
    if a.cmd == "inspect":
        return checkpoint_tools.cmd_inspect(a)
    if a.cmd == "export":
        return checkpoint_tools.cmd_export(a)
