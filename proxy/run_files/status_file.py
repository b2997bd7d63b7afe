"""`.status.json`: the live summary the proxy writes about once a second for `python -m proxy
status` (docs/operations.md#status). The only module that reads or writes the file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from proxy.run_files.loss_ema import LossEma
from shared.atomic_io import atomic_write_json, read_json
from shared.run.layout import RunLayout


@dataclass
class LiveStats:
    """What the proxy knows of the running worker, for progress lines and `.status.json`."""

    step: int = 0
    loss: float | None = None
    ema: float | None = None
    ema_state: LossEma = field(default_factory=LossEma)  # `ema` is its value
    tok_per_s: float | None = None
    last_checkpoint: dict | None = None
    recent: list = field(default_factory=list)  # the last 20 step times, seconds
    worker: dict | None = None  # the worker's hello report once it arrived
    exit_code: int | None = None  # from the worker's "stopped" event
    stop_why: str | None = None  # its reason, named in a fatal exit's message
    policy: dict | None = None  # the bandit's `explain()` at its last update

    def new_worker(self) -> None:
        """Forget the previous worker's hello and "stopped" event before the next one starts
        (a restart, a pivot's new worker): they describe that worker only."""
        self.worker, self.exit_code, self.stop_why = None, None, None


def write_status(
    layout: RunLayout, stats: LiveStats, max_steps: int, worker_pid: int | None, alive: bool = True
) -> None:
    """`.status.json` for `python -m proxy status` (atomic, not fsynced: rewritten every few
    tenths of a second while the proxy lives; docs/operations.md#status)."""
    atomic_write_json(
        layout.status,
        {
            "proxy_pid": os.getpid(),
            "proxy_alive": alive,
            "worker_pid": worker_pid,
            "step": stats.step,
            "max_steps": max_steps,
            "loss": stats.loss,
            "loss_ema": stats.ema,
            "tokens_per_s": stats.tok_per_s,
            "last_checkpoint": stats.last_checkpoint,
            "policy": stats.policy,
            "time": time.time(),
        },
        durable=False,
    )


def read_status(layout: RunLayout) -> dict:
    """The last `.status.json` the proxy wrote, or {} when there is none or it is unreadable
    (a reader that never disturbs the live run)."""
    return read_json(layout.status, {}, garbage="default", expect=dict)
