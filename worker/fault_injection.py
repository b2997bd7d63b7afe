"""Fault-injection hooks for tests, read from environment variables. Off unless set.

These let a test put a real worker process into an exact fault at an exact step, so that signal
and supervision tests are deterministic instead of racing a 10 ms step:

  ANDREA_TEST_NAN_AT_STEP=5,9-13     the loss of these updates is multiplied by NaN (the update
                                     is then skipped and recorded; docs/architecture.md#bad-input-and-faults)
  ANDREA_TEST_PAUSE_AT_STEP=N:SECS[,N:SECS]  update N sleeps SECS seconds before its boundary
  ANDREA_TEST_PAUSE_AT_MICRO=K.I:SECS[,...]  update K sleeps SECS seconds after its micro-batch
                                     I (1-based), before the next one. Each pause happens once
                                     per run directory and first reports {"type": "event",
                                     "event": "test-pause"} (`test-pause-micro`); it ends early
                                     once a stop signal (SIGTERM, SIGINT, SIGHUP, parent death)
                                     has arrived or the test creates `.test-release-N` (`-K.I`)
                                     in the run directory; SECS `hold`: only that file ends it
                                     (at most an hour)
  ANDREA_TEST_STEAL_SIGNAL=SIGUSR1   a "library" resets that handler before the worker's check
  ANDREA_TEST_WRITE_DELAY=SECS       every checkpoint write sleeps SECS seconds before writing
                                     (a window to signal "during a write"); `hold`: the write
                                     of step N waits until the test creates
                                     `.test-release-write-N` or `.test-release-writes` (every
                                     write from then on) in the run directory (at most an hour)
  ANDREA_TEST_HOLD_RESUME=1          before it reads the checkpoint it resumes from, the worker
                                     writes `.test-resume-held` in the run directory and waits
                                     until the test creates `.test-release-resume` (at most an
                                     hour), once per run directory: a test changes the file
                                     between the proxy's scan and the worker's read
  ANDREA_TEST_HANG_AT_STEP=N         update N blocks for ever (signals set flags but the step never
                                     ends), once per run directory (marker `.test-hang-done`)
  ANDREA_TEST_ORPHAN_FILE=PATH       at start-up the worker leaves an orphaned grandchild
                                     (`sleep 2`) and writes its pid to PATH (tests the reaper)
  ANDREA_TEST_FUSED_ADAMW=0|1        pin the AdamW kernel: foreach (0) or fused (1), whatever the
                                     device (worker/precision.py `use_fused_adamw`)
  ANDREA_TEST_COUNT_HOST_READS=1     the worker counts its host reads of tensor values with torch's
                                     function and dispatch modes (`HostReadCounter`) and reports
                                     {"type": "event", "event": "test-host-reads", "step": k,
                                     "reads": {what: n}} after each update k: the reads since
                                     the previous report (eager runs only; a mode stops compile)

Production runs never set them; nothing here changes results when they are unset.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path


def _steps(spec: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        else:
            out.add(int(part))
    return out


def _sleep(secs: float, stopping: Callable[[], bool] | None, *release: Path) -> None:
    """Sleep `secs` seconds, or less: until `stopping()` is true or one of the files `release`
    exists (both checked every 10 ms; a signal delivered before the file appeared has had its
    handler run by then, since Python runs handlers between the loop's bytecodes)."""
    end = time.monotonic() + secs
    while (left := end - time.monotonic()) > 0:
        if (stopping and stopping()) or any(r.exists() for r in release):
            return
        time.sleep(min(0.01, left))


def write_delay(run_dir: Path, step: int) -> None:
    """ANDREA_TEST_WRITE_DELAY before the write of `step` (in the checkpoint writer thread)."""
    secs = os.environ.get("ANDREA_TEST_WRITE_DELAY")
    if secs == "hold":
        _sleep(
            3600.0, None, run_dir / f".test-release-write-{step}", run_dir / ".test-release-writes"
        )
    elif secs:
        time.sleep(float(secs))


class HostReadCounter:
    """Counts, on the thread that enters it, every read of a tensor's values by the host:
    `Tensor.numpy` and `Tensor.tolist` (torch's function mode: on the CPU they read without
    dispatching), `aten._local_scalar_dense` (`item`, `float(t)`, `bool(t)`, also from inside
    torch) and copies to the host of a tensor on another device (its dispatch mode; a
    `tolist` of a device tensor then counts twice). `take()` returns the counts since the last
    call."""

    def __init__(self) -> None:
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        self.counts = counts = Counter[str]()

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in ("numpy", "tolist") and args and isinstance(args[0], torch.Tensor):
                    counts[f"Tensor.{name}"] += 1
                return func(*args, **(kwargs or {}))

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = str(func)
                if name.startswith("aten._local_scalar_dense"):
                    counts[name] += 1
                elif name.startswith(("aten.copy_", "aten._to_copy")):
                    src = args[1] if name.startswith("aten.copy_") else args[0]
                    if out.device.type == "cpu" and src.device.type != "cpu":
                        counts[name] += 1
                return out

        self._modes = (Functions(), Dispatch())

    def start(self) -> None:
        """Count from now on, on this thread (the modes stay entered until the process ends)."""
        for m in self._modes:
            m.__enter__()

    def take(self) -> dict[str, int]:
        out = dict(self.counts)
        self.counts.clear()
        return out


class NoHooks:
    """The trainer's test hooks, doing nothing: what a Trainer gets unless told otherwise."""

    def at_start(self) -> None:
        """After the worker announced itself, before the first step."""

    def on_loss(self, step: int, loss):
        """The per-sequence losses of update `step`, before the backward pass."""
        return loss

    def after_micro_batch(self, step: int, micro: int, report) -> None:
        """After micro-batch `micro` (1-based) of update `step`; `report` writes a report."""

    def after_step(self, step: int, report) -> None:
        """After update `step` trained, before its report and boundary."""

    def before_resume(self, path: Path) -> None:
        """Before the worker reads checkpoint `path` to resume from it."""


class EnvHooks(NoHooks):
    """The hooks above, driven by the ANDREA_TEST_* variables of this module's docstring;
    `run_dir` holds the once-per-run markers; `stopping()` (if given) is true once a stop
    signal has arrived, and ends a pause."""

    def __init__(self, run_dir: Path, stopping: Callable[[], bool] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.stopping = stopping
        self.nan_steps = _steps(os.environ.get("ANDREA_TEST_NAN_AT_STEP", ""))
        self.reads = HostReadCounter() if os.environ.get("ANDREA_TEST_COUNT_HOST_READS") else None

    def at_start(self) -> None:
        if name := os.environ.get("ANDREA_TEST_STEAL_SIGNAL"):  # as a misbehaving library would
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        if path := os.environ.get("ANDREA_TEST_ORPHAN_FILE"):
            # the shell exits at once: `sleep` is re-parented to the nearest subreaper (the proxy)
            subprocess.run(
                ["sh", "-c", f"sleep 2 & echo $! > '{path}.tmp' && mv '{path}.tmp' '{path}'"],
                check=True,
            )
        if self.reads is not None:
            self.reads.start()

    def _pause(self, variable: str, where: str, event: dict, report) -> None:
        """The pause of `variable` (ANDREA_TEST_PAUSE_AT_*, the module docstring) at `where`,
        reporting `event` first; marker `.test-pause-<where>`, release `.test-release-<where>`."""
        for part in filter(None, os.environ.get(variable, "").split(",")):
            at, secs = part.split(":")
            if at != where:
                continue
            marker = self.run_dir / f".test-pause-{where}"
            if marker.exists():
                return
            marker.write_text(str(os.getpid()))
            report({"type": "event", **event, "time": time.time()})
            release = self.run_dir / f".test-release-{where}"
            if secs == "hold":
                _sleep(3600.0, None, release)
            else:
                _sleep(float(secs), self.stopping, release)

    def on_loss(self, step: int, loss):
        return loss * float("nan") if step in self.nan_steps else loss

    def after_micro_batch(self, step: int, micro: int, report) -> None:
        event = {"event": "test-pause-micro", "step": step, "micro": micro}
        self._pause("ANDREA_TEST_PAUSE_AT_MICRO", f"{step}.{micro}", event, report)

    def after_step(self, step: int, report) -> None:
        if self.reads is not None:
            reads = self.reads.take()
            report({"type": "event", "event": "test-host-reads", "step": step, "reads": reads})
        event = {"event": "test-pause", "step": step}
        self._pause("ANDREA_TEST_PAUSE_AT_STEP", str(step), event, report)
        hang = os.environ.get("ANDREA_TEST_HANG_AT_STEP")
        marker = self.run_dir / ".test-hang-done"
        if hang and int(hang) == step and not marker.exists():
            marker.write_text(str(os.getpid()))
            while True:  # time.sleep resumes after each signal handler (PEP 475): a real hang
                time.sleep(3600)

    def before_resume(self, path: Path) -> None:
        marker = self.run_dir / ".test-resume-held"  # stays: a restarted worker reads at once
        if os.environ.get("ANDREA_TEST_HOLD_RESUME") and not marker.exists():
            marker.write_text(str(os.getpid()))
            _sleep(3600.0, None, self.run_dir / ".test-release-resume")


def hooks_from_environment(run_dir: Path, stopping: Callable[[], bool] | None = None) -> NoHooks:
    """EnvHooks when any ANDREA_TEST_* variable is set, else NoHooks (production). `stopping`:
    true once a stop signal has arrived (ends a pause early)."""
    if any(k.startswith("ANDREA_TEST_") for k in os.environ):
        return EnvHooks(run_dir, stopping)
    return NoHooks()


def fused_adamw_override() -> bool | None:
    """ANDREA_TEST_FUSED_ADAMW: True (=1, fused) or False (=0, foreach) pins the AdamW kernel;
    None (unset) leaves the choice to worker/precision.py."""
    env = os.environ.get("ANDREA_TEST_FUSED_ADAMW", "")
    return env == "1" if env in ("0", "1") else None
