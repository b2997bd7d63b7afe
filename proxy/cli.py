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
import logging
import signal
import sys

from proxy.run_options import add_run_args, check_resume_args, check_run_options, \
    config_from_args, proxy_options
from shared.config import ConfigError, DEFAULT_ARMS, RunConfig, load_run_config, probe_plan
from shared.exit_codes import EXIT_USAGE
from shared.run_layout import RunLayout

log = logging.getLogger("proxy")

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


def cmd_run(a) -> int:
    from proxy.proc_tree import EarlySignals
    EarlySignals.install()  # stop/SIGUSR1 during creation: remembered, never fatal (issue 4)
    from proxy.run_lock import RunLock, RunLockError
    from proxy.run_setup import create_run
    from proxy.supervisor import Supervisor, SupervisorError
    from proxy.bandit import BanditConfigError

    _setup_logging(None)
    try:
        check_run_options(a)
    except ConfigError as e:
        log.error("%s", e)
        return EXIT_USAGE
    layout = RunLayout(a.run_dir)
    layout.root.mkdir(parents=True, exist_ok=True)
    _setup_logging(layout)
    lock = RunLock(layout)
    try:
        lock.acquire()
    except RunLockError as e:
        log.error("%s", e)
        return EXIT_USAGE
    try:
        if layout.run_json.exists():
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
        _print_settings(cfg, a)
        opts = proxy_options(a, cfg)  # torchrun: the world size must divide the batch
        sup = Supervisor(layout, cfg, opts)
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
            ("held-out probe", _probe_row(cfg)),
            ("arms", ", ".join(x.name for x in cfg.arms)), ("reward", cfg.reward),
            ("seed", cfg.seed)]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        log.info("  %s  %s", k.ljust(w), v)


def _probe_row(cfg: RunConfig) -> str:
    """The probe's size and its cost in training compute (shared/config.py probe_plan)."""
    pp = probe_plan(cfg)
    return (f"{pp.sequences} x {cfg.model.block_size} tokens per arm every {pp.every} steps = "
            f"{pp.cost:.1%} of training FLOPs (budget {cfg.probe_budget:.0%})")


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
    add_run_args(p)
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
