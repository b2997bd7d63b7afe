"""Signal handling in the trainer (docs/signals.md): handlers only set flags; the training
loop acts on them at the step boundary.

  SIGTERM, SIGINT, SIGHUP, and the proxy's death -> stop: finish the step, checkpoint, exit 0
  SIGUSR1                                        -> checkpoint after the step (or at the next
                                                    cadence boundary), continue

The proxy spawns the worker with these signals blocked; `SignalFlags.install()` unblocks them
once its handlers are in place (docs/signals.md#start-up). Parent death is caught twice, by
prctl(PR_SET_PDEATHSIG) and a polling thread (docs/signals.md#parent-death). SIGUSR1 coalescing
is `Usr1Requests` (docs/signals.md#coalescing).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

from shared.processes import alive

log = logging.getLogger("worker.signals")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
HANDLED_SIGNALS = (*STOP_SIGNALS, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1
USR1_BURST_S = 0.5  # a SIGUSR1 this close (seconds) to the previous one of a request joins it


class SignalFlags:
    """Flags set by signal handlers.

    stop_reason: None, or the first stop signal's name ("SIGTERM", "SIGINT", "SIGHUP") or
    "parent-died"; later stop signals change nothing (a second SIGTERM during the write does not
    interrupt it). usr1_times: time.monotonic() of every SIGUSR1 received, in order.
    """

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.usr1_times: list[float] = []

    def _on_stop(self, signum, frame) -> None:
        if self.stop_reason is None:
            self.stop_reason = signal.Signals(signum).name

    def _on_usr1(self, signum, frame) -> None:
        self.usr1_times.append(time.monotonic())

    def install(self) -> None:
        """Install the handlers, then unblock the signals (blocked by the proxy at spawn)."""
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_usr1)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED_SIGNALS)

    def verify_and_repair(self) -> list[str]:
        """The names of the signals whose handler is no longer ours (a library replaced it;
        NCCL has been known to take SIGUSR1) or which a library blocked again; if any, say so
        loudly (ERROR, naming them) and re-install. Empty when all is well."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        lost = [
            signal.Signals(s).name
            for s in HANDLED_SIGNALS
            if getattr(signal.getsignal(s), "__self__", None) is not self or s in blocked
        ]
        if lost:
            log.error(
                "SIGNAL HANDLERS REPLACED after start-up (a library took %s): re-installing "
                "ours; checkpoint-on-signal would otherwise be lost",
                ", ".join(lost),
            )
            self.install()
        return lost

    def watch_parent(self, parent_pid: int, interval: float = 1.0) -> None:
        """Treat the parent's death as SIGTERM: prctl(PR_SET_PDEATHSIG) plus a polling thread."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        # Under torchrun the parent is the elastic agent and `parent_pid` is the proxy (the
        # grandparent): watch that pid's life instead of our parent pid.
        via_agent = (
            "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
        ) and os.getppid() != parent_pid

        def gone() -> bool:  # a zombie proxy is a dead one
            return not alive(parent_pid) if via_agent else os.getppid() != parent_pid

        if gone():  # died before prctl took effect
            self.stop_reason = self.stop_reason or "parent-died"

        def poll() -> None:
            while not gone():
                time.sleep(interval)
            self.stop_reason = self.stop_reason or "parent-died"

        threading.Thread(target=poll, name="parent-watch", daemon=True).start()


class Usr1Requests:
    """Turns SIGUSR1 arrivals into checkpoint steps (docs/signals.md).

    At the boundary of update k the trainer calls `arrived()` (did a signal start a new request?
    under DDP the ranks then agree with a MAX), `start(k)` if so, and `due(k)`.
    usr1_at "step": the request is served at the boundary of the step during which it arrived;
    "boundary": at the next multiple of `cadence` (the current step if it is one). A signal
    joins the pending request, the SIGUSR1 checkpoint being written, or the request whose latest
    signal arrived at most USR1_BURST_S seconds earlier (docs/signals.md#coalescing).
    """

    def __init__(self, flags: SignalFlags, usr1_at: str, cadence: int) -> None:
        if usr1_at not in ("step", "boundary"):
            raise ValueError(f"usr1_at={usr1_at!r}: must be 'step' or 'boundary'")
        self.flags, self.usr1_at, self.cadence = flags, usr1_at, cadence
        self.seen = 0  # arrivals already accounted for
        self.target: int | None = None  # step of the pending request
        self.last_t: float | None = None  # time.monotonic() of the newest request's latest signal

    def arrived(self, writing_usr1: bool = False) -> bool:
        """True if a SIGUSR1 received since the last call starts a new request (this rank's
        view). `writing_usr1`: a SIGUSR1 checkpoint is being written right now."""
        fresh = self.flags.usr1_times[self.seen :]
        self.seen += len(fresh)
        new = False
        for t in fresh:
            burst = self.last_t is not None and t - self.last_t <= USR1_BURST_S
            new = new or not (self.target is not None or writing_usr1 or burst)
            self.last_t = t
        return new

    def start(self, k: int) -> None:
        """Start a request at the boundary of update k (all ranks call it together)."""
        if self.target is None:
            self.target = k if self.usr1_at == "step" else -(-k // self.cadence) * self.cadence
            if self.last_t is None:  # a rank that got no signal itself (DDP): the burst starts now
                self.last_t = time.monotonic()
            log.info("SIGUSR1 received: checkpoint at step %d", self.target)

    def due(self, k: int) -> bool:
        """True (once) when the pending request's step is reached at the boundary of update k."""
        if self.target is not None and k >= self.target:
            self.target = None
            return True
        return False
