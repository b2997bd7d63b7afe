"""Signal handling in the trainer (docs/signals.md): handlers only set flags; the training
loop acts on them at the step boundary.

  SIGTERM, SIGINT, SIGHUP, and the proxy's death -> stop: finish the step, checkpoint, exit 0
  SIGUSR1                                        -> checkpoint after the step (or at the next
                                                    cadence boundary), continue

Start-up: the proxy spawns the worker with these signals *blocked* (the mask survives exec), and
`SignalFlags.install()` unblocks them only after its handlers are in place, so a signal sent
during interpreter start-up stays pending instead of killing the worker, and is honoured after
the first step (SIGUSR1) or before it (SIGTERM).

Parent death is caught twice: Linux's parent-death signal (prctl PR_SET_PDEATHSIG = SIGTERM) and a
thread that polls the parent pid every second, for platforms or exec paths where the first fails.

SIGUSR1 coalescing (`Usr1Requests`): a SIGUSR1 joins the request already pending or being written,
and so does one that arrives within USR1_BURST_S seconds of that request's latest signal. So
several SIGUSR1 before the checkpoint is written give one checkpoint, and a scheduler that signals
both the proxy and the worker's process group (the worker then gets its own copy plus the one the
proxy forwards) still gets one checkpoint.
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
    interrupt it). stop_count counts them. usr1_times: time.monotonic() of every SIGUSR1
    received, in order (usr1_count = its length).
    """

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.stop_count = 0
        self.usr1_times: list[float] = []

    @property
    def usr1_count(self) -> int:
        return len(self.usr1_times)

    def _on_stop(self, signum, frame) -> None:
        self.stop_count += 1
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

    def verify(self) -> list[str]:
        """Names of signals whose handler is no longer ours (a library replaced it; NCCL has
        been known to take SIGUSR1), or which a library blocked again."""
        lost = []
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        for s in HANDLED_SIGNALS:
            h = signal.getsignal(s)
            if getattr(h, "__self__", None) is not self or s in blocked:
                lost.append(signal.Signals(s).name)
        return lost

    def verify_and_repair(self) -> list[str]:
        """verify(); if anything was lost, say so loudly (ERROR, naming the signals) and
        re-install. Returns the lost names (empty when all is well)."""
        lost = self.verify()
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

        def gone() -> bool:
            if not via_agent:
                return os.getppid() != parent_pid
            return not alive(parent_pid)  # a zombie proxy is a dead one

        if gone():  # died before prctl took effect
            self.stop_reason = self.stop_reason or "parent-died"

        def poll() -> None:
            ev = threading.Event()
            while not ev.wait(interval):
                if gone():
                    if self.stop_reason is None:
                        self.stop_reason = "parent-died"
                    return

        threading.Thread(target=poll, name="parent-watch", daemon=True).start()


class Usr1Requests:
    """Turns SIGUSR1 arrivals into checkpoint steps (docs/signals.md).

    At the boundary of update k the trainer calls `arrived()` (did a signal start a new request?
    under DDP the ranks then agree with a MAX), `start(k)` if so, and `due(k)`.
    usr1_at "step": the request is served at the boundary of the step during which it arrived;
    "boundary": at the next multiple of `cadence` (the current step if it is one). A signal
    joins the pending request, the SIGUSR1 checkpoint being written, or the request whose latest
    signal arrived at most USR1_BURST_S seconds earlier (a copy of one signal sent to both the
    proxy and the worker's group arrives milliseconds apart, possibly across a step boundary).
    A SIGUSR1 after the checkpoint is durable and the burst is over starts a new request.
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
        times = self.flags.usr1_times
        new = False
        while self.seen < len(times):
            t = times[self.seen]
            self.seen += 1
            joins = (
                new
                or self.target is not None
                or writing_usr1
                or (self.last_t is not None and t - self.last_t <= USR1_BURST_S)
            )
            if not joins:
                new = True
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
