"""The learning-rate schedule (docs/configuration.md#the-schedule): the rate of every update as a
pure function of its step and run.json, read by the worker (the rate it trains at) and the proxy
(what the start-up, a re-plan and the summary say). Standard library only.
"""

from __future__ import annotations

import dataclasses
import math

from shared.run.config import RunConfig


def learning_rate(step: int, cfg: RunConfig) -> float:
    """Learning rate of update `step` (1-based), a pure function of the step and run.json, so
    a resumed run uses exactly the uninterrupted run's rates (docs/configuration.md#the-schedule).

    The plan at creation: linear warm-up over `warmup_steps`, then to `lr * min_lr_ratio` at
    `lr_decay_steps` by a cosine (`schedule` "cosine") or, for "wsd" (warmup-stable-decay,
    MiniCPM, Hu et al. 2024), at the peak until the last `decay_fraction` of the plan and
    linearly down from there; flat at the floor after. A re-plan at step S (`replans`, in order:
    `run --replan`) keeps every rate up to S and continues from lr(S) to the new end (the docs'
    "Re-planning"); a wsd decay never starts before S."""
    floor = cfg.lr * cfg.min_lr_ratio
    for r in reversed(cfg.replans):
        if step > r["at"]:
            before = dataclasses.replace(cfg, replans=cfg.replans[: cfg.replans.index(r)])
            return _decay(step, r["at"], learning_rate(r["at"], before), floor, r, cfg)
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    plan = {"lr_decay_steps": cfg.lr_decay_steps, "decay_at": None}
    return _decay(step, cfg.warmup_steps, cfg.lr, floor, plan, cfg)


def _decay(step: int, start: int, lr0: float, floor: float, plan: dict, cfg: RunConfig) -> float:
    """The rate at `step` > `start` of a plan that is at `lr0` at `start` and reaches `floor` at
    plan["lr_decay_steps"]: cosine, or wsd (held, then linear from the decay's start)."""
    end = plan["lr_decay_steps"]
    if step >= end:
        return floor
    if cfg.schedule == "cosine":
        ratio = (step - start) / max(1, end - start)
        return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr0 - floor)
    decay_at = plan.get("decay_at")
    if decay_at is None:
        decay_at = end - max(1, round(cfg.decay_fraction * end))
    decay_at = max(decay_at, start)
    if step <= decay_at:
        return lr0
    return lr0 + (floor - lr0) * (step - decay_at) / max(1, end - decay_at)
