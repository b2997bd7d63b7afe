"""Creating a run directory (docs/architecture.md#the-run-directory, docs/data.md): the
tokenizer, every arm tokenized whole into `data/`, `data/arms.json`, `phases.json` (phase 0) and
finally `run.json`, whose presence marks a complete run. An interrupted creation is resumed by
the same command (docs/data.md#crash-safe-creation); also the `--replan` of the schedule.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from proxy.fault_injection import tokenize_pause
from proxy.mixture.bandit import resolve_bounds
from proxy.run_files.phases import Phase, write_phases
from shared.atomic_io import atomic_write_json, clean_stale_writes, read_json
from shared.data.arms import ArmSourceError, source_fingerprint
from shared.data.checks import check_arms
from shared.data.sources import open_arm, sample_text
from shared.data.token_files import prepare_arm, write_arm_index
from shared.data.tokenization import pin_mmap_threshold, release_free_memory
from shared.data.tokenizer import RunTokenizer
from shared.run import stop_request
from shared.run.config import ConfigError, RunConfig
from shared.run.layout import RunLayout

log = logging.getLogger("proxy.supervision.run_setup")


def make_tokenizer(layout: RunLayout, cfg: RunConfig) -> RunTokenizer:
    """The run's tokenizer, saved as `tokenizer.json` (docs/data.md#the-tokenizer): bytes, a
    copy of the given tokenizer.json, or a BPE trained on a deterministic sample of at most
    `cfg.bpe_sample_bytes` characters spread evenly over the text arms (each arm's share drawn
    from across the whole arm). Reused as it is when `data/tokenizer.recipe.json` matches.
    Raises ConfigError."""
    text_arms = [a for a in cfg.arms if a.kind != "tokens"]
    for a in text_arms:
        open_arm(a)  # missing files, a Parquet file without the column: refused before any work
    given = cfg.tokenizer
    if cfg.tokenizer not in ("bpe", "bytes"):
        given = str(Path(cfg.tokenizer).expanduser().resolve())
    recipe = {  # what the tokenizer is a function of
        "tokenizer": given,
        "vocab_size": cfg.vocab_size,
        "bpe_sample_bytes": cfg.bpe_sample_bytes,
        "arms": [
            [a.name, a.kind, a.source, a.field, source_fingerprint(a)]
            for a in sorted(text_arms, key=lambda a: a.name)
        ],
    }
    recipe_file = layout.data / "tokenizer.recipe.json"
    if layout.tokenizer.exists() and read_json(recipe_file) == recipe:
        tok = RunTokenizer.load(layout.tokenizer)
        log.info(
            "tokenizer: kept %s from an interrupted creation (%d tokens)",
            layout.tokenizer,
            tok.vocab_size,
        )
        return tok
    if cfg.tokenizer == "bytes":
        tok = RunTokenizer.bytes()
        tok.save(layout.tokenizer)
    elif cfg.tokenizer != "bpe":
        src = Path(cfg.tokenizer).expanduser()
        tok = RunTokenizer.from_file(src)
        shutil.copyfile(src, layout.tokenizer)
        log.info("tokenizer: %s (%d tokens), used as given", src, tok.vocab_size)
    else:
        if not text_arms:
            raise ConfigError(
                "--tokenizer bpe needs at least one text arm to train on; "
                "use --tokenizer bytes with pre-tokenized arms"
            )
        t0 = time.perf_counter()
        share = cfg.bpe_sample_bytes // len(text_arms)
        texts = []
        for a in sorted(text_arms, key=lambda a: a.name):
            stop_request.check(f"the BPE sample of arm {a.name}")
            texts += sample_text(a, share)
        log.info(
            "BPE sample: %s characters from %d arms (at most %s per arm, drawn from across "
            "each arm; --bpe-sample-bytes %s) in %.1f s",
            f"{sum(len(t) for t in texts):,}",
            len(text_arms),
            f"{share:,}",
            f"{cfg.bpe_sample_bytes:,}",
            time.perf_counter() - t0,
        )
        t0 = time.perf_counter()
        tok = RunTokenizer.train_bpe(texts, cfg.vocab_size)
        del texts
        release_free_memory()  # the trainer's working set, before the arms are tokenized
        log.info(
            "trained BPE tokenizer: %d tokens in %.1f s", tok.vocab_size, time.perf_counter() - t0
        )
        tok.save(layout.tokenizer)
    atomic_write_json(recipe_file, recipe)
    # BPE training is one call into the tokenizers library: a stop that came during it acts
    # here, with the tokenizer saved and its recipe recorded, so the next attempt keeps it
    stop_request.check("the tokenizer's creation (kept for the next attempt)")
    return tok


def check_new_run(cfg: RunConfig) -> list[str]:
    """Every check of a new run's configuration that needs no writing: the numbers, the
    caps/floors box, each arm's source (all problems in one ArmSourceError,
    docs/data.md#checks-before-any-work). Raises ConfigError; returns the warnings about a valid
    configuration (two arms reading one source), for the caller to log once all checks passed."""
    cfg.validate()
    names = [a.name for a in cfg.arms]
    resolve_bounds(names, cfg.caps, cfg.floors)  # infeasible boxes refused before any work
    problems = check_arms(cfg.arms)  # every arm, all at once, before anything is written
    if problems:
        raise ArmSourceError(
            f"{len(problems)} of the {len(cfg.arms)} arms cannot be used; nothing was written (in "
            "a directory you made, logs/ keeps this attempt's log for `status`):\n"
            + "\n".join(f"  - {m}" for m in problems)
        )
    warnings: list[str] = []
    seen: dict[tuple, str] = {}
    for a in cfg.arms:
        key = (a.kind, a.field, source_fingerprint(a))  # a missing source raises: none written
        if key in seen:
            warnings.append(
                f"arms {seen[key]} and {a.name} read the same source ({a.kind} "
                f"{a.source or '(embedded)'}): its data counts twice in the mixture; remove "
                "one, or give them different sources"
            )
        seen.setdefault(key, a.name)
    return warnings


def create_run(layout: RunLayout, cfg: RunConfig, notes: Iterable[str] = ()) -> RunConfig:
    """Build (or finish building) the run directory for `cfg`; returns cfg with the tokenizer's
    vocab_size. `notes`, the warnings about settings derived for the run
    (proxy/commands/run_args.py `config_from_args`), are logged once `check_new_run`
    has passed, with its own warnings, so none comes before a refusal.

    Raises ConfigError (bad numbers, infeasible caps/floors, missing, corrupt or tiny arm
    sources; see `check_new_run`) before the run directory holds a run.json; arms already
    complete are kept."""
    for message in [*notes, *check_new_run(cfg)]:
        log.warning("%s", message)
    pin_mmap_threshold()  # before BPE training too: peak memory that does not grow with the corpus
    layout.ensure()
    # An attempt killed (kill -9) mid-write leaves `.NAME.XXXXXXXX.tmp` files of atomic writes
    # (a progress record, the tokenizer's recipe). Creation runs under the run lock and nothing
    # else writes into a run without run.json, so every one of them is dead, whatever its age.
    for d in (layout.root, layout.data):
        for name in clean_stale_writes(d, older_than_s=0.0):
            log.info("removed a temporary of an interrupted creation: %s", d / name)
    tok = make_tokenizer(layout, cfg)
    cfg.vocab_size = tok.vocab_size
    cfg.validate()
    log.info(
        "model: %s, %s parameters, checkpoint %s bytes with %d tokens",
        cfg.preset,
        f"{cfg.n_params:,}",
        f"{cfg.checkpoint_bytes:,}",
        cfg.vocab_size,
    )
    t0 = time.perf_counter()
    pause = tokenize_pause()  # a test's, proxy/fault_injection.py
    arms = [prepare_arm(a, tok, layout, cfg, after_batch=pause) for a in cfg.arms]
    write_arm_index(layout, arms)
    log.info(
        "arms: %s in %.1f s",
        ", ".join(f"{a.name} {a.n_tokens:,} tokens" for a in arms),
        time.perf_counter() - t0,
    )
    write_phases(layout, [Phase(0, "initial", 0, dict(cfg.caps), dict(cfg.floors))])
    atomic_write_json(layout.run_json, cfg.to_json())
    return cfg


def replan(
    layout: RunLayout, cfg: RunConfig, at: int, max_steps: int, decay_at: int | None = None
) -> dict | None:
    """Re-plan the learning-rate schedule of the run `cfg` to end at `max_steps`, from step
    `at` (where this start resumes), keeping every rate up to `at` and the rate continuous
    there (shared/lr_schedule.py; docs/configuration.md#the-schedule). Records the re-plan in
    run.json (`replans`, `max_steps`; re-plans at or after `at`, on steps a rewind dropped, are
    replaced) and updates `cfg`. Returns the entry, or None when the plan already ends at
    `max_steps` (a restart by the same command records nothing, so its resume stays exact).
    Raises ConfigError when `max_steps` is not after `at`, or `decay_at` is given for a
    cosine schedule or lies outside [at, max_steps)."""
    last = cfg.replans[-1] if cfg.replans else None
    if max_steps == cfg.max_steps and (
        decay_at is None or (last is not None and last.get("decay_at") == decay_at)
    ):
        return None
    if max_steps <= at:
        raise ConfigError(
            f"--replan --max-steps {max_steps}: this start resumes at step {at:,}; give a "
            f"later end (the plan was {cfg.max_steps:,})"
        )
    if decay_at is not None:
        if cfg.schedule != "wsd":
            raise ConfigError(
                f"--decay-at {decay_at}: this run's schedule is {cfg.schedule} (run.json), "
                "whose decay spans the whole plan; --decay-at is for --schedule wsd"
            )
        if not at <= decay_at < max_steps:
            raise ConfigError(
                f"--decay-at {decay_at}: give a step from {at:,} (where this start resumes) "
                f"to before --max-steps {max_steps:,}"
            )
    entry = {"at": at, "lr_decay_steps": max_steps, "decay_at": decay_at}
    cfg.replans = [r for r in cfg.replans if r["at"] < at] + [entry]
    cfg.max_steps = max_steps
    cfg.validate()
    atomic_write_json(layout.run_json, cfg.to_json())
    return entry
