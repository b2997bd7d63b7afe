"""Signal handling in the trainer (SPEC section 5): handlers only set flags; the training loop
acts on them at the step boundary.

  SIGTERM, SIGINT, SIGHUP, and the proxy's death -> stop: finish the step, checkpoint, exit 0
  SIGUSR1                                        -> checkpoint after the step, continue

Parent death is caught twice: Linux's parent-death signal (prctl PR_SET_PDEATHSIG = SIGTERM) and a
thread that polls the parent pid every second, for platforms or exec paths where the first fails.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading

log = logging.getLogger("worker.signals")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
PR_SET_PDEATHSIG = 1


class SignalFlags:
    """Flags set by signal handlers. `stop_reason` is None or e.g. "SIGTERM", "parent-died"."""

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.usr1_count = 0      # SIGUSR1s received, ever; the trainer remembers how many it served

    def _on_stop(self, signum, frame) -> None:
        if self.stop_reason is None:  # a second SIGTERM changes nothing
            self.stop_reason = signal.Signals(signum).name

    def _on_usr1(self, signum, frame) -> None:
        self.usr1_count += 1

    def install(self) -> None:
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_stop)
        signal.signal(signal.SIGUSR1, self._on_usr1)

    def verify(self) -> list[str]:
        """Names of signals whose handler is no longer ours (a library replaced it; NCCL has
        been known to take SIGUSR1). Logged loudly by the caller and re-installed."""
        lost = []
        for s in (*STOP_SIGNALS, signal.SIGUSR1):
            h = signal.getsignal(s)
            if getattr(h, "__self__", None) is not self:
                lost.append(signal.Signals(s).name)
        return lost

    def watch_parent(self, parent_pid: int, interval: float = 1.0) -> None:
        """Treat the parent's death as SIGTERM: prctl(PR_SET_PDEATHSIG) plus a polling thread."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent_pid:  # died before prctl took effect
            self.stop_reason = self.stop_reason or "parent-died"

        def poll() -> None:
            ev = threading.Event()
            while not ev.wait(interval):
                if os.getppid() != parent_pid:
                    if self.stop_reason is None:
                        self.stop_reason = "parent-died"
                    return

        threading.Thread(target=poll, name="parent-watch", daemon=True).start()
