"""The per-start options of `python -m proxy run` (`ProxyOptions`): what may differ at every
start of a run, unlike run.json's (docs/operations.md#start-and-resume). Built from the command
line by proxy/commands/run_args.py; the supervision takes them typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.supervision.launch import LaunchOptions
from shared.checkpoint.manifest import DEFAULT_KEEP_EVERY, DEFAULT_KEEP_LAST


@dataclass
class ProxyOptions:
    """Options of `python -m proxy run` that are not part of run.json (they may differ per start)."""

    max_steps: int | None = None  # None: run.json's
    usr1_at: str = "step"  # SIGUSR1 checkpoints after this step, or at the boundary
    device: str = "auto"
    keep_last: int = DEFAULT_KEEP_LAST
    keep_every: int = DEFAULT_KEEP_EVERY
    max_restarts: int = 3
    hang_timeout: float = 300.0  # seconds without a report before the worker counts as hung
    stop_timeout: float = 120.0  # seconds a stopping worker gets before SIGKILL
    print_every: int = 10  # steps between progress lines
    samples_keep: int = 50  # audits kept in .samples.json
    from_scratch: bool = False  # allow step 0 when history exists but no checkpoint does
    backoff: float = 1.0  # first restart delay, seconds (doubles, max 30)
    stop_on_collapse: bool = False  # the collapse alarm also stops the run
    launch: LaunchOptions = field(default_factory=LaunchOptions)  # torchrun
    compile: str = "auto"  # worker --compile: auto (on for CUDA), on, off
    precision: str = "auto"  # worker --precision: auto (bf16 on CUDA), fp32, bf16
    tensorboard: bool = False  # live event files under RUN/tensorboard/
    wandb: bool = False  # log to the run's W&B run (files under RUN/wandb/)
    micro_batch_size: int | None = None  # worker --micro-batch-size; None: run.json's
    replan: bool = False  # re-plan the schedule to max_steps at the step this start resumes from
    decay_at: int | None = None  # with replan, wsd: the step the final decay starts at
