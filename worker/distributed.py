"""Multi-process training under `torchrun` (docs/signals.md#several-ranks): process group set-up and
the small collectives that keep every rank in lock-step.

`init_distributed` joins the process group torchrun describes (gloo on CPU, nccl on CUDA), or
returns a world of one, where nothing here communicates. `agree` is the step-boundary collective
(the element-wise MAX, so a signal one rank got gives the same decision on all) and `sum_` makes
the update's statistics global.

What it is not: the decisions themselves (worker/trainer.py) or the launcher (proxy/supervision/supervisor.py).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("worker.distributed")

# Collectives wait this long before failing (a rank that died mid-step makes the others raise
# instead of hanging; the proxy then restarts all ranks from the newest checkpoint).
COLLECTIVE_TIMEOUT_S = 600.0


class DistributedError(ValueError):
    """The process group could not be set up or the world size does not fit the run (a
    configuration error: the worker exits EXIT_FATAL); the message names the value and the fix."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank in [0, world_size)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None  # "gloo" / "nccl" when a process group is up, else None

    @property
    def enabled(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(
            f"environment {name}={raw!r} is not an integer; torchrun sets it, do not set it by hand"
        ) from None


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """The device of this rank: `requested` ("auto", "cpu", "cuda", "cuda:N"); under several
    ranks on CUDA, "auto"/"cuda" mean cuda:LOCAL_RANK. Raises DistributedError (the worker exits
    3: restarting cannot help) when CUDA is asked for and absent, or cuda:N does not exist."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(requested)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DistributedError(
            f"--device {requested}: this torch ({torch.__version__}) sees no CUDA "
            "device; use --device cpu (or auto), or install a CUDA build of torch"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank if torch.cuda.device_count() > local_rank else 0)
    if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
        raise DistributedError(
            f"--device {requested}: only {torch.cuda.device_count()} CUDA "
            "device(s) here (cuda:0 ...); choose one of them"
        )
    return dev


def init_distributed(requested_device: str) -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR/PORT) describes, or return a world of one without it (a plain `python -m
    worker`). Backend: nccl when the device is CUDA, gloo on CPU. Raises DistributedError when
    the environment is inconsistent (e.g. RANK >= WORLD_SIZE)."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    device = resolve_device(requested_device, local_rank)
    if world <= 1:
        return DistInfo(), device
    if not 0 <= rank < world:
        raise DistributedError(
            f"environment RANK={rank} is outside WORLD_SIZE={world}: "
            "launch the worker through torchrun (python -m proxy run "
            "--nproc-per-node N)"
        )
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        **kw,
    )
    log.info(
        "rank %d of %d (local rank %d) joined the %s process group on %s",
        rank,
        world,
        local_rank,
        backend,
        device,
    )
    return DistInfo(rank, world, backend), device


def _comm_device(info: DistInfo) -> torch.device:
    if info.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(info: DistInfo, events: list[int]) -> list[int]:
    """Step-boundary agreement: element-wise MAX of `events` (small non-negative ints) over all
    ranks. Every rank must call it at the same point with the same length. World of one: returns
    `events` unchanged."""
    if not info.enabled:
        return list(events)
    import torch.distributed as dist

    t = torch.tensor(events, dtype=torch.int64, device=_comm_device(info))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(x) for x in t.tolist()]


def sum_(info: DistInfo, t: torch.Tensor) -> None:
    """Element-wise SUM of `t` over all ranks, in place (the update's loss sums), queued on
    `t`'s device with no host read on NCCL; gloo on the CPU runs it at once. World of one:
    `t` unchanged."""
    if not info.enabled:
        return
    import torch.distributed as dist

    c = t.to(_comm_device(info))  # `t` itself when it is on that device already
    dist.all_reduce(c, op=dist.ReduceOp.SUM)
    if c is not t:
        t.copy_(c)


GLOO_DRAIN_S = 0.05  # seconds without the GIL before the process group is destroyed


def leave_process_group() -> None:
    """destroy_process_group, after GLOO_DRAIN_S seconds without the GIL. A gloo worker thread
    frees each finished collective's thread-local state, which takes the GIL; the process
    group's destructor joins those threads while the caller holds it, so destroyed the instant
    a collective completes, the two wait for each other for ever; the sleep lets the threads
    finish first. Raises what destroy_process_group raises."""
    import torch.distributed as dist

    gc.collect()  # a DDP wrapper the caller dropped, if a reference cycle still holds it
    time.sleep(GLOO_DRAIN_S)
    if dist.is_initialized():
        dist.destroy_process_group()


def shutdown(info: DistInfo) -> None:
    """Leave the process group (best effort: a peer may already be gone). The caller drops its
    DDP wrapper first (its Reducer holds the group; see leave_process_group)."""
    if not info.enabled:
        return
    try:
        leave_process_group()
    except Exception as e:  # noqa: BLE001 - exiting anyway; say why, do not mask the exit code
        log.warning("destroy_process_group: %s", e)
