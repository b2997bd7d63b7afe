"""Creating a run directory and reading its phases (SPEC sections 3, 7, 8).

Creation reads every arm's text, trains the run's tokenizer (BPE, or bytes), tokenizes the arms
into `data/`, writes `phases.json` (phase 0) and finally `run.json`: its presence marks a
complete run, so an interrupted creation is simply redone.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time

from proxy.bandit import resolve_bounds
from proxy.mixture import Phase
from shared.arm_data import prepare_arm, write_arm_index
from shared.arms import read_arm_text
from shared.atomic_io import atomic_write_json
from shared.config import ConfigError, RunConfig
from shared.run_layout import RunLayout
from shared.tokenizer import RunTokenizer

log = logging.getLogger("proxy.run_setup")


def create_run(layout: RunLayout, cfg: RunConfig) -> RunConfig:
    """Build the run directory for `cfg`; returns cfg with the tokenizer's vocab_size.

    Raises ConfigError (bad numbers, infeasible caps/floors, missing or tiny arm sources)
    before the run directory holds a run.json."""
    cfg.validate()
    names = [a.name for a in cfg.arms]
    resolve_bounds(names, cfg.caps, cfg.floors)  # infeasible boxes refused before any work
    layout.ensure()
    t0 = time.perf_counter()
    texts = {a.name: read_arm_text(a) for a in cfg.arms if a.kind != "tokens"}
    log.info("read %d arms (%s) in %.1f s", len(cfg.arms),
             ", ".join(f"{n} {len(t):,} chars" for n, t in texts.items()), time.perf_counter() - t0)
    if cfg.tokenizer == "bytes":
        tok = RunTokenizer.bytes()
    else:
        if not texts:
            raise ConfigError("--tokenizer bpe needs at least one text arm to train on; "
                              "use --tokenizer bytes with pre-tokenized arms")
        t0 = time.perf_counter()
        tok = RunTokenizer.train_bpe([texts[n] for n in sorted(texts)], cfg.vocab_size)
        log.info("trained BPE tokenizer: %d tokens in %.1f s", tok.vocab_size,
                 time.perf_counter() - t0)
    cfg.vocab_size = tok.vocab_size
    cfg.validate()
    tok.save(layout.tokenizer)
    arms = [prepare_arm(a, tok, layout, cfg, texts.get(a.name)) for a in cfg.arms]
    write_arm_index(layout, arms)
    log.info("arms: %s", ", ".join(f"{a.name} {a.n_tokens:,} tokens" for a in arms))
    write_phases(layout, [Phase(0, "initial", 0, dict(cfg.caps), dict(cfg.floors))])
    atomic_write_json(layout.run_json, cfg.to_json())
    return cfg


def read_phases(layout: RunLayout) -> list[Phase]:
    """All phases, oldest first. Raises ConfigError naming the file when unreadable."""
    try:
        return [Phase(**p) for p in json.loads(layout.phases.read_text())["phases"]]
    except FileNotFoundError:
        raise ConfigError(f"{layout.phases}: missing; recreate it as "
                          '{"phases": [{"index": 0, "label": "initial", "start_step": 0}]}') from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{layout.phases}: unreadable ({e})") from e


def write_phases(layout: RunLayout, phases: list[Phase]) -> None:
    atomic_write_json(layout.phases, {"phases": [dataclasses.asdict(p) for p in phases]})
