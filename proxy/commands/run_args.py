"""Every option of `python -m proxy run`, in one place: definition, help, checks, and what each
becomes (docs/operations.md#start-and-resume). The command layer's: the argparse Namespace
stops here, and what goes below is typed (`RunConfig`, `ProxyOptions`, `LaunchOptions`).
Creation options (`config_from_args`, `check_resume_args`) and per-start options
(`ProxyOptions`): docs/configuration.md.

What it is not: the run's creation (proxy/supervision/run_setup.py), the arms' parsing (shared/data/arms.py), the
bounds' rules (proxy/mixture/arm_bounds.py) or the supervision itself (proxy/supervision/supervisor.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re

from proxy.mixture.arm_bounds import parse_arm_values
from proxy.observation.tensorboard_log import check_available as check_tensorboard
from proxy.observation.wandb_log import check_available as check_wandb
from proxy.run_files.phases import bounds_text, read_phases
from proxy.supervision.launch import LaunchOptions
from proxy.supervision.run_options import ProxyOptions
from shared.data.arms import parse_arm_option
from shared.run.config import (
    DEFAULT_ARMS,
    PRESETS,
    ConfigError,
    RunConfig,
    accumulation_steps,
    count_parameters,
    default_eval_every,
    default_sample_every,
    load_run_config,
)
from shared.run.layout import RunLayout

log = logging.getLogger("proxy")

# Options that define the run and are fixed at creation (run.json); on resume a different value
# is refused (preset) or ignored with a warning (the rest). RunConfig fields of the same names.
CREATION_ONLY = (
    "preset",
    "tokenizer",
    "seed",
    "batch_size",
    "lr",
    "checkpoint_every",
    "sample_every",
    "eval_every",
    "schedule",
    "decay_fraction",
    "warmup_steps",
    "probe_every",
    "reward",
    "bandit_warmup",
    "bpe_sample_bytes",
    "arm_max_tokens",
)
_SET_AS_GIVEN = tuple(n for n in CREATION_ONLY if n not in ("preset", "sample_every", "eval_every"))


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """Define every `run` option on parser `ap`, each with its help text and default. The
    defaults are stated once: run.json's in RunConfig (these options default to None, so that a
    resume can tell an option given from one left out), the rest in ProxyOptions."""
    ap.add_argument(
        "--run-dir",
        required=True,
        metavar="DIR",
        help="run directory: created with the run, resumed when it holds run.json",
    )
    ap.add_argument(
        "--config",
        metavar="FILE.toml",
        help="read any of these options from a TOML file (keys: the long names, "
        "with _ or -); the command line overrides it (docs/configuration.md)",
    )
    rc, po = RunConfig(), ProxyOptions()
    _add_run_json_args(ap.add_argument_group("the run (fixed at creation in run.json)"), rc)
    _add_arm_args(ap.add_argument_group("arms and the bandit"), rc)
    _add_start_args(ap.add_argument_group("this start (may change at every start)"), po)
    _add_launch_args(ap.add_argument_group("several ranks (torchrun) and speed"))


def _number(
    g: argparse._ArgumentGroup, flag: str, text: str, metavar="N", default=None, kind=int
) -> None:
    """Define option `flag` of group `g`: one number of type `kind`, help `text`."""
    g.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)


def _add_run_json_args(g: argparse._ArgumentGroup, rc: RunConfig) -> None:
    """The options fixed at creation in run.json (defaults: `rc`'s, shown in the help)."""
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help=f"model shape (default {rc.preset}); the architecture cannot change later",
    )
    g.add_argument(
        "--seed",
        type=int,
        help=f"run seed: every random choice of update k derives from (seed, k, rank) ({rc.seed})",
    )
    _number(
        g,
        "--batch-size",
        f"sequences per optimizer update, global over all ranks ({rc.batch_size})",
    )
    lr = f"{rc.lr:.0e}".replace("e-0", "e-")  # 3e-3, as the docs write it
    g.add_argument("--lr", type=float, help=f"peak learning rate (AdamW) ({lr})")
    _number(
        g,
        "--warmup-steps",
        "linear learning-rate warm-up, steps (then cosine to --max-steps) "
        f"({rc.warmup_steps}; a tenth of a run shorter than that)",
    )
    _number(g, "--checkpoint-every", f"checkpoint cadence in steps ({rc.checkpoint_every})")
    g.add_argument(
        "--schedule",
        choices=("cosine", "wsd"),
        help=f"learning-rate schedule after the warm-up: cosine to the floor, or wsd "
        f"(warmup-stable-decay: the peak, then a linear decay over the last --decay-fraction) "
        f"({rc.schedule})",
    )
    _number(
        g,
        "--decay-fraction",
        f"wsd: the share of the plan spent in the final decay ({rc.decay_fraction})",
        metavar="F",
        kind=float,
    )
    _number(
        g,
        "--sample-every",
        "sample audit cadence in steps (default: the checkpoint cadence, or the "
        "smallest multiple of it that keeps audits within 0.5%% of training FLOPs)",
    )
    _number(
        g,
        "--eval-every",
        "validation cadence in steps: held-out loss per arm on fixed windows (default: "
        "the smallest multiple of 10 that keeps it within 1%% of training FLOPs; 0: none)",
    )
    _number(
        g,
        "--probe-every",
        f"held-out probe cadence = the bandit's policy period, steps ({rc.probe_every})",
    )
    g.add_argument(
        "--tokenizer",
        metavar="bpe|bytes|PATH",
        help=f"bpe: byte-level BPE trained on the arms at creation ({rc.vocab_size} tokens); "
        "bytes: 256 byte ids, nothing trained; PATH: an existing tokenizer.json "
        "(e.g. GPT-2's 50,257 tokens)",
    )
    _number(
        g,
        "--bpe-sample-bytes",
        "BPE training sample drawn from across all text arms, characters "
        f"({rc.bpe_sample_bytes:,}; stored in run.json)",
    )
    _number(
        g,
        "--arm-max-tokens",
        "explicit cap on tokens per arm, said in the log (default: every token of every arm)",
    )


def _add_arm_args(g: argparse._ArgumentGroup, rc: RunConfig) -> None:
    """The arms and the bandit's options."""
    g.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=KIND:SOURCE",
        help="an arm: text:PATH|DIR|GLOB, jsonl:PATH|DIR|GLOB[:FIELD] (.gz/.zst too), "
        "parquet:PATH|DIR|GLOB[:COLUMN], tokens:PATH[:u16|u32] (repeatable); "
        "replaces the three defaults unless --default-arms is given; on a restart "
        "the run's new arm list, matched by name: new names join, names left out "
        "are retired, statistics stay with each name",
    )
    g.add_argument(
        "--default-arms", action="store_true", help="keep the three default arms alongside --arm"
    )
    g.add_argument(
        "--caps",
        default="",
        metavar="ARM=P,...",
        help="per-arm caps on the sampling probability (at creation; later: pivot)",
    )
    g.add_argument(
        "--floors",
        default="",
        metavar="ARM=P,...",
        help="per-arm floors on the sampling probability (at creation; later: pivot)",
    )
    g.add_argument(
        "--reward",
        choices=("train_slope", "heldout_progress", "train_loss"),
        help="mixture policy: train_slope (default: free, from the training losses, "
        "moves from stratified only as far as a confidence bound allows), "
        "heldout_progress (EXP3 on a held-out probe, costs up to 1.5%% of "
        "training), or train_loss (ODM-style; favours hard data)",
    )
    _number(
        g,
        "--bandit-warmup",
        f"steps sampled from the prior before the bandit adapts ({rc.bandit_warmup})",
    )


def _add_start_args(g: argparse._ArgumentGroup, po: ProxyOptions) -> None:
    """The options of this start (they may change at every start; defaults: `po`'s)."""
    _number(
        g,
        "--max-steps",
        "stop after this many updates (at creation: also the end of the schedule; on a "
        "resume, with --replan: the schedule's new end)",
    )
    g.add_argument(
        "--replan",
        action="store_true",
        help="on a resume: re-plan the learning-rate schedule to end at --max-steps, from the "
        "step it resumes at, keeping the rate continuous (recorded in run.json; "
        "docs/configuration.md#the-schedule)",
    )
    _number(
        g,
        "--decay-at",
        "with --replan and --schedule wsd: start the final decay at STEP (default: the "
        "last --decay-fraction of the new plan)",
        metavar="STEP",
    )
    _number(
        g,
        "--micro-batch-size",
        "sequences per forward/backward on each rank; the update's batch runs as "
        "(--batch-size / ranks) / N micro-batches with gradient accumulation "
        "(default: the rank's whole share in one pass). Changes speed and "
        "memory, not the data; a bit-exact resume needs the same value",
    )
    g.add_argument("--device", default=po.device, help="auto, cpu, cuda, cuda:N")
    g.add_argument(
        "--usr1-at",
        choices=("step", "boundary"),
        default=po.usr1_at,
        help="SIGUSR1 checkpoint after the current step, or at the next cadence boundary",
    )
    _number(
        g,
        "--keep-last",
        "retention: newest checkpoints kept (>= 2; %(default)s)",
        default=po.keep_last,
    )
    _number(
        g,
        "--keep-every",
        "retention: also keep every M-th step (%(default)s; 0 = off)",
        metavar="M",
        default=po.keep_every,
    )
    _number(
        g,
        "--max-restarts",
        "worker crashes or hangs in a row restarted from the newest checkpoint; "
        "one that wrote a new checkpoint first starts the count again (%(default)s)",
        default=po.max_restarts,
    )
    _number(
        g,
        "--hang-timeout",
        f"seconds without a report before the worker counts as hung ({po.hang_timeout:g})",
        metavar="S",
        default=po.hang_timeout,
        kind=float,
    )
    _number(
        g,
        "--stop-timeout",
        f"seconds a stopping worker gets for its checkpoint before SIGKILL ({po.stop_timeout:g})",
        metavar="S",
        default=po.stop_timeout,
        kind=float,
    )
    _number(
        g,
        "--print-every",
        "steps between progress lines (%(default)s); the first step of a start "
        "is printed at once, and a line comes at least every 30 s",
        default=po.print_every,
    )
    _number(
        g,
        "--samples-keep",
        "sample audits kept in .samples.json (the last N of the phase; %(default)s)",
        default=po.samples_keep,
    )
    g.add_argument(
        "--stop-on-collapse",
        action="store_true",
        help="stop the run when the collapse alarm goes off (two degenerate audits)",
    )
    g.add_argument(
        "--tensorboard",
        action="store_true",
        help="write live TensorBoard scalars (loss, EMA, lr, grad norm, tokens/s, "
        "per-arm p and held-out loss, checkpoints) under RUN/tensorboard/; "
        "view with `tensorboard --logdir RUN/tensorboard`; needs the "
        "[tensorboard] extra (pip install -e '.[tensorboard]')",
    )
    g.add_argument(
        "--wandb",
        action="store_true",
        help="log the same scalars and sample audits to Weights & Biases: one W&B run per "
        "run directory (id in RUN/wandb/andrea-run.json), resumed on every start and "
        "backfilled from the history; project WANDB_PROJECT (default andrea), "
        "WANDB_MODE=offline to log without a network; needs the [wandb] extra "
        "(pip install -e '.[wandb]')",
    )
    g.add_argument(
        "--from-scratch",
        action="store_true",
        help="start at step 0 even though the history has records but no checkpoint",
    )


def _add_launch_args(g: argparse._ArgumentGroup) -> None:
    """The options of several ranks (torchrun's) and of speed."""
    _number(
        g,
        "--nproc-per-node",
        "ranks on this node; > 1 launches the worker with torchrun (DDP)",
        default=1,
    )
    g.add_argument("--nnodes", metavar="N|MIN:MAX", help="torchrun --nnodes")
    g.add_argument("--node-rank", type=int, metavar="R", help="torchrun --node-rank")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="torchrun --rdzv-endpoint")
    g.add_argument("--rdzv-id", metavar="ID", help="torchrun --rdzv-id (the same on every node)")
    g.add_argument(
        "--rdzv-backend",
        metavar="NAME",
        help="torchrun --rdzv-backend (c10d when an endpoint is given; several nodes "
        "always use the static rendezvous, docs/architecture.md#several-nodes)",
    )
    _number(
        g,
        "--rdzv-timeout",
        "several nodes: seconds the owner waits for every node to join before it "
        "stops naming the missing node ranks (600)",
        metavar="S",
        default=600.0,
        kind=float,
    )
    g.add_argument(
        "--compile",
        nargs="?",
        const="on",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile the training step (model and loss, static shapes): auto = on for "
        "CUDA, off for CPU; --compile alone = on (docs/operations.md#compile)",
    )
    g.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="forward arithmetic: auto = bf16 autocast on CUDA, fp32 on CPU; bf16 = "
        "bf16 autocast on any device; fp32 = no autocast. Weights, AdamW m/v "
        "and checkpoints stay fp32 (worker/precision.py)",
    )


def check_run_options(a) -> None:
    """Refuse bad supervision numbers before anything is created or started
    (docs/architecture.md#bad-input-and-faults). Raises ConfigError naming the option, the value
    and the rule."""
    device = a.device
    rules = [
        (
            "--keep-last",
            a.keep_last,
            a.keep_last >= 2,
            "must be >= 2 (the newest checkpoint may still be being written)",
        ),
        ("--keep-every", a.keep_every, a.keep_every >= 0, "must be >= 0 (0 = off)"),
        ("--max-restarts", a.max_restarts, a.max_restarts >= 0, "must be >= 0"),
        ("--hang-timeout", a.hang_timeout, a.hang_timeout > 0, "must be > 0 seconds"),
        ("--stop-timeout", a.stop_timeout, a.stop_timeout > 0, "must be > 0 seconds"),
        ("--print-every", a.print_every, a.print_every >= 1, "must be >= 1 step"),
        ("--samples-keep", a.samples_keep, a.samples_keep >= 1, "must be >= 1"),
        ("--nproc-per-node", a.nproc_per_node, a.nproc_per_node >= 1, "must be >= 1"),
        ("--rdzv-timeout", a.rdzv_timeout, a.rdzv_timeout > 0, "must be > 0 seconds"),
        (
            "--seed",
            a.seed,
            a.seed is None or 0 <= a.seed < 2**63,
            "must be in [0, 2**63) (numpy seeds are non-negative)",
        ),
        (
            "--micro-batch-size",
            a.micro_batch_size,
            a.micro_batch_size is None or a.micro_batch_size >= 1,
            "must be >= 1 (sequences per forward/backward on one rank)",
        ),
        ("--max-steps", a.max_steps, a.max_steps is None or a.max_steps >= 1, "must be >= 1"),
        (
            "--device",
            device,
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(device)) is not None,
            "choose auto, cpu, cuda or cuda:N",
        ),
    ]
    for name, value, ok, rule in rules:
        if not ok:
            raise ConfigError(f"{name} {value}: {rule}")
    if a.replan and a.max_steps is None:
        raise ConfigError(
            "--replan needs --max-steps N: the step the re-planned schedule ends at "
            "(docs/configuration.md#the-schedule)"
        )
    if a.decay_at is not None and not a.replan:
        raise ConfigError(
            f"--decay-at {a.decay_at} goes with --replan (it re-plans the schedule's decay); "
            "at creation the decay is set by --decay-fraction"
        )
    _check_nnodes(a.nnodes)  # well-formed before launch_options below reads it
    if str(device).startswith("cuda") and (why := check_cuda_device(str(device))):
        raise ConfigError(why)  # before anything is created: the worker would exit 3 later
    if a.tensorboard and (why := check_tensorboard()):  # before anything is created
        raise ConfigError(why)
    if a.wandb and (why := check_wandb()):
        raise ConfigError(why)
    # the batch / ranks / micro-batch split: the options', else run.json's, else the defaults
    layout = RunLayout(a.run_dir)
    cfg = load_run_config(layout.run_json) if layout.run_json.exists() else RunConfig()
    batch = cfg.batch_size if layout.run_json.exists() else (a.batch_size or cfg.batch_size)
    world = launch_options(a).world_size()
    accumulation_steps(batch, a.micro_batch_size or cfg.micro_batch_size, world)


def _check_nnodes(nnodes: str | None) -> None:
    """--nnodes is N (or N:N): several nodes form one fixed job with one owner
    (docs/architecture.md#several-nodes); elastic MIN:MAX is refused. Raises ConfigError."""
    if nnodes is None:
        return
    parts = str(nnodes).split(":")
    if len(parts) > 2 or not all(x.strip().isdigit() and int(x) >= 1 for x in parts):
        raise ConfigError(f"--nnodes {nnodes!r}: give N or MIN:MAX (integers >= 1)")
    if len(parts) == 2 and int(parts[0]) != int(parts[1]):
        raise ConfigError(
            f"--nnodes {nnodes}: a run trains on a fixed number of nodes (one owner, "
            f"one history, rank 0 on the owner); give --nnodes {parts[1]} on every "
            "node"
        )


def check_cuda_device(device: str) -> str | None:
    """Why `--device cuda[:N]` cannot run here (a sentence with the fix), or None when it can.
    Imports torch (a second or two), which the proxy otherwise never does: no other check tells
    a CPU-only torch build or a missing GPU apart from a working one."""
    import torch

    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA (" + torch.__version__ + ")"
            if torch.version.cuda is None
            else "torch sees no CUDA device (no GPU, or no driver)"
        )
        return (
            f"--device {device}: {why}; use --device cpu, or auto to take a GPU when there is one"
        )
    n = torch.cuda.device_count()
    if ":" in device and int(device.split(":")[1]) >= n:
        return f"--device {device}: only {n} CUDA device(s) here (cuda:0 .. cuda:{n - 1})"
    return None


def config_from_args(a, notes: list[str] | None = None) -> RunConfig:
    """The RunConfig of a new run from the parsed options `a` (defaults from shared/run/config.py).
    Raises ConfigError (a warm-up not below --max-steps) and BanditConfigError (bad bounds).
    A warning about a derived setting (a warm-up shortened to fit the run) is appended to
    `notes` when given, for the caller to log once the configuration is valid, else logged."""
    said: list[str] = [] if notes is None else notes
    cfg = RunConfig()
    if a.preset:
        cfg.preset = a.preset
        cfg.model = PRESETS[a.preset]
    for name in _SET_AS_GIVEN:
        v = getattr(a, name, None)
        if v is not None:
            setattr(cfg, name, v)
    if a.max_steps is not None:
        cfg.max_steps = cfg.lr_decay_steps = a.max_steps
    cfg.micro_batch_size = a.micro_batch_size
    cfg.config_file = a.config
    cfg.sources = dict(getattr(a, "sources", {}))  # where each resolved value came from
    if cfg.warmup_steps >= cfg.lr_decay_steps:
        # an error when given, unless a --config file's met the command line's shorter run
        # (docs/configuration.md#the-config-file)
        src = cfg.sources.get("warmup_steps")
        from_file = src == "file" and cfg.sources.get("max_steps") == "command line"
        if a.warmup_steps is not None and not from_file:
            raise ConfigError(
                f"--warmup-steps {cfg.warmup_steps} must be below --max-steps "
                f"{cfg.max_steps} (the cosine schedule ends there)"
            )
        was = cfg.warmup_steps
        cfg.warmup_steps = cfg.lr_decay_steps // 10
        if from_file:  # the start-up table says where the value came from
            for d in (cfg.sources, a.sources):  # from_file: `a` has sources, copied above
                d["warmup_steps"] = "file, shortened to a tenth of max steps"
        said.append(
            f"a {cfg.max_steps}-step run: learning-rate warm-up shortened to "
            f"{cfg.warmup_steps} steps"
            + (f" (from the --config file's {was})" if from_file else "")
        )
    if a.arm:
        arms = [parse_arm_option(t) for t in a.arm]
        cfg.arms = (list(DEFAULT_ARMS) if a.default_arms else []) + arms
    cfg.sample_every = a.sample_every if a.sample_every is not None else default_sample_every(cfg)
    cfg.eval_every = a.eval_every if a.eval_every is not None else default_eval_every(cfg)
    names = [x.name for x in cfg.arms]
    cfg.caps = parse_arm_values(a.caps, names, "--caps")
    cfg.floors = parse_arm_values(a.floors, names, "--floors")
    if notes is None:
        for message in said:
            log.warning("%s", message)
    return cfg


def check_resume_args(a, cfg: RunConfig, layout: RunLayout, notes: list[str]) -> None:
    """Creation-only options given on a resume must match run.json (docs/architecture.md#the-run-directory):
    a different preset is refused (ConfigError naming both parameter counts), other creation
    options (CREATION_ONLY) are ignored with a warning naming run.json's value, caps/floors are
    refused (that is a pivot). The warnings are appended to `notes`, for the caller to log once
    the resume is known to be valid."""
    if a.preset and a.preset != cfg.preset:
        n_new = count_parameters(PRESETS[a.preset], cfg.vocab_size)
        raise ConfigError(
            f"{layout.run_json}: this run is {cfg.preset} ({cfg.n_params:,} "
            f"parameters); --preset {a.preset} has {n_new:,}: the architecture "
            "cannot change on resume; use a new --run-dir (or `fork`)"
        )
    for name in CREATION_ONLY[1:]:
        v, was = getattr(a, name, None), getattr(cfg, name)
        if v is not None and v != was:
            shown = "no cap (0)" if name == "arm_max_tokens" and not was else was
            notes.append(
                f"--{name.replace('_', '-')} {v} ignored: this run was created with {shown} "
                "(run.json); the value is fixed for the life of the run"
            )
    if a.caps or a.floors:
        _check_same_bounds(a, cfg, layout)


def _check_same_bounds(a, cfg: RunConfig, layout: RunLayout) -> None:
    """--caps/--floors on a resume: the same values as the phase in force are what the creating
    command (or its config file, a Slurm requeue, a systemd restart) gave, and go on; other
    values would change the policy mid-phase and are refused (that is a pivot, docs/pivots.md).
    After a pivot, the first phase's values (the creating command run again: a systemd unit, a
    requeued job) are accepted too, and the pivot's bounds stay in force. Raises ConfigError
    naming the phase's values, the remedy and the pivot command."""
    phases = read_phases(layout)
    phase, first = phases[-1], phases[0]
    names = sorted({x.name for x in cfg.arms} | set(phase.caps) | set(phase.floors))
    for opt, text, have, created in (
        ("--caps", a.caps, phase.caps, first.caps),
        ("--floors", a.floors, phase.floors, first.floors),
    ):
        if not text:
            continue
        got = parse_arm_values(text, names, opt)
        shown = bounds_text(have)
        if got == have:
            continue
        if phase.index > 0 and got == created:  # the creating command again, after a pivot
            log.info(
                "%s %s is the creating command's; the phase in force, %d '%s', has %s %s "
                "and keeps it (docs/pivots.md)",
                opt,
                text,
                phase.index,
                phase.label,
                opt,
                shown,
            )
            continue
        raise ConfigError(
            f"{opt} {text} on an existing run would change the policy mid-phase (phase "
            f"{phase.index} '{phase.label}' has {opt} {shown}); to resume, drop {opt} from the "
            f"command (or give the phase's values); to change the bounds, pivot: python -m proxy "
            f"pivot --run-dir {layout.root} {opt} {text}"
        )


def launch_options(a) -> LaunchOptions:
    """The torchrun options of namespace `a` (checked by `check_run_options`): every field of
    LaunchOptions is the option of the same name."""
    return LaunchOptions(**{f.name: getattr(a, f.name) for f in dataclasses.fields(LaunchOptions)})


def proxy_options(a, cfg: RunConfig) -> ProxyOptions:
    """The per-start options of namespace `a` (checked by `check_run_options`) for the run
    `cfg`. Raises ConfigError when the world size does not divide the run's global batch (each
    rank takes an equal slice) or the micro-batch does not divide a rank's slice
    (shared/run/config.py `accumulation_steps`)."""
    lo = launch_options(a)
    accumulation_steps(cfg.batch_size, a.micro_batch_size or cfg.micro_batch_size, lo.world_size())
    if a.micro_batch_size is not None and a.micro_batch_size != cfg.micro_batch_size:
        log.warning(
            "--micro-batch-size %d: run.json says %s; the data and the mean gradient are "
            "the same, the float rounding is not: this start matches the run's earlier "
            "steps within float tolerance, not bit for bit",
            a.micro_batch_size,
            cfg.micro_batch_size or "none (one pass)",
        )
    per_start = {
        f.name: getattr(a, f.name)
        for f in dataclasses.fields(ProxyOptions)
        if f.name not in ("backoff", "launch")  # every other field: the option of its name
    }
    return ProxyOptions(**per_start, launch=lo)
