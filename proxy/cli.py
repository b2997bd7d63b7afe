"""`python -m proxy COMMAND`: the operator's interface (SPEC section 6).

  run      create or resume a run and supervise its worker
  status   step, loss and EMA, tokens/s, last checkpoint, arm probabilities, worker health
  inspect  a checkpoint: header, validity, checksum, parameter table, norms
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
    ap.add_argument("--tokenizer", choices=("bpe", "bytes"), default=None)
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=KIND:SOURCE",
                    help="add an arm: text:PATH|GLOB, jsonl:PATH[:FIELD], tokens:PATH (repeatable); "
                         "replaces the three defaults unless --default-arms is given")
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


def _config_from_args(a) -> RunConfig:
    from proxy.bandit import parse_arm_values
    from shared.arms import parse_arm_option
    cfg = RunConfig()
    if a.preset:
        cfg.preset = a.preset
        cfg.model = PRESETS[a.preset]
    for name in ("seed", "batch_size", "lr", "checkpoint_every", "probe_every", "warmup_steps",
                 "tokenizer", "reward", "bandit_warmup"):
        v = getattr(a, name, None)
        if v is not None:
            setattr(cfg, name, v)
    if a.max_steps is not None:
        cfg.max_steps = cfg.lr_decay_steps = a.max_steps
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
    if a.max_steps is not None and a.max_steps != cfg.max_steps:
        log.warning("--max-steps %d differs from the planned %d: the learning-rate schedule stays "
                    "the one planned at creation (cosine to step %d, flat after)",
                    a.max_steps, cfg.max_steps, cfg.lr_decay_steps)


def cmd_run(a) -> int:
    from proxy.run_lock import RunLock, RunLockError
    from proxy.run_setup import create_run
    from proxy.supervisor import ProxyOptions, Supervisor, SupervisorError
    from proxy.bandit import BanditConfigError

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
        if opts.keep_last < 2:
            raise ConfigError(f"--keep-last {opts.keep_last}: must be >= 2 (the newest checkpoint "
                              "may still be being written)")
        sup = Supervisor(layout, cfg, opts)
        sup.install_signal_handlers()
        return sup.run()
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
    layout = RunLayout(a.run_dir)
    if not layout.run_json.exists():
        print(f"{layout.root}: not a run directory (no run.json)", file=sys.stderr)
        return 2
    from proxy.sidecars import read_json_tolerant
    st = {}
    try:
        st = json.loads((layout.root / ".status.json").read_text())
    except (OSError, ValueError):
        pass
    state = {}
    try:
        state = json.loads(layout.state.read_text())
    except (OSError, ValueError):
        pass

    def alive(pid):
        if not pid:
            return False
        try:
            os.kill(pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    proxy_alive = st.get("proxy_alive") and alive(st.get("proxy_pid"))
    worker_pid = st.get("worker_pid")
    age = time.time() - st["time"] if st.get("time") else None
    health = ("running" if proxy_alive and alive(worker_pid) and age is not None and age < 30
              else "stalled?" if proxy_alive else "stopped")
    print(f"run        {layout.root}")
    print(f"health     {health}  (proxy pid {st.get('proxy_pid')}, worker pid {worker_pid})")
    print(f"step       {st.get('step')} / {st.get('max_steps')}")
    if st.get("loss") is not None:
        print(f"loss       {st['loss']:.4f}  (EMA {st.get('loss_ema') or 0:.4f})")
    if st.get("tokens_per_s"):
        print(f"tokens/s   {st['tokens_per_s']:,.0f}")
    print(f"checkpoint {st.get('last_checkpoint')}")
    if state.get("arms"):
        print("arms       " + "  ".join(f"{n}: p={v['p']:.3f} pulls={v['pulls']}"
                                        for n, v in sorted(state["arms"].items())))
    return 0


def cmd_inspect(a) -> int:
    import numpy as np
    from shared.checkpoint_format import CheckpointError, load_checkpoint, read_header, \
        file_checksum, parse_checkpoint_name
    from shared.checkpoint_manifest import read_manifest
    from shared.config import parameter_table
    path = Path(a.path)
    try:
        step, n = read_header(path)
    except CheckpointError as e:
        print(f"INVALID: {e}")
        return 1
    print(f"file       {path}\nheader     step {step:,}, n_params {n:,}")
    print(f"size       {path.stat().st_size:,} bytes (expected {8 + 12 * n:,})")
    entries = read_manifest(path.parent)
    s = parse_checkpoint_name(path.name)
    want = entries[s].checksum if s in entries else None
    cfg = None
    try:
        cfg = load_run_config(path.parent / "run.json")
    except ConfigError:
        pass
    try:
        _, w, m, v = load_checkpoint(path, cfg.n_params if cfg else None, want)
    except CheckpointError as e:
        print(f"INVALID    {e}")
        return 1
    print(f"checksum   {file_checksum(path)} "
          + (f"(manifest: match, reason {entries[s].reason}, pinned {entries[s].pinned})" if want
             else "(no manifest entry)"))
    print("valid      yes")
    for name, arr in (("weights", w), ("m", m), ("v", v)):
        print(f"|{name}|".ljust(11) + f"L2 {float(np.linalg.norm(arr)):.6g}  max|x| {float(np.abs(arr).max()):.6g}")
    if cfg is not None:
        print(f"\nparameter table ({cfg.preset}, vocabulary {cfg.vocab_size}):")
        print(f"{'name':<40} {'shape':<16} {'offset':>12} {'|w|':>10}")
        for name, shp, off in parameter_table(cfg.model, cfg.vocab_size):
            size = int(np.prod(shp))
            print(f"{name:<40} {str(tuple(shp)):<16} {off:>12,} {float(np.linalg.norm(w[off:off + size])):>10.4f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # SIGUSR1's default action kills: ignore it until the supervisor installs its handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    ap = argparse.ArgumentParser(prog="python -m proxy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_run_args(sub.add_parser("run", help="create or resume a run and supervise it"))
    p = sub.add_parser("status", help="show a run's progress and health")
    p.add_argument("--run-dir", required=True)
    p = sub.add_parser("inspect", help="check and describe a checkpoint file")
    p.add_argument("path")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        return cmd_run(a)
    if a.cmd == "status":
        return cmd_status(a)
    return cmd_inspect(a)
