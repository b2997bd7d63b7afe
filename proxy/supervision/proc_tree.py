"""The proxy's process-tree duties (docs/signals.md): signals before the supervisor is
ready, spawning the worker with its signals blocked, reaping orphans (PID 1 in a container, or
a child subreaper), and naming a process that does not answer.

What it is not: the supervision loop itself (proxy/supervision/supervisor.py) or the worker's own signal
handling (worker/signals.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal

import psutil

from shared.processes import process_state
from shared.run import stop_request

log = logging.getLogger("proxy")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WORKER_SIGNALS = (*STOP_SIGNALS, signal.SIGUSR1)
PR_SET_CHILD_SUBREAPER = 36
STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible I/O (D)",
    "T": "stopped (SIGSTOP?)",
    "t": "stopped by a tracer",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
}


class EarlySignals:
    """Signals that reach the proxy before the supervisor's handlers exist, installed first
    thing in `python -m proxy`'s main(): a stop signal is remembered and SIGUSR1s are counted
    (docs/signals.md#start-up, docs/signals.md#containers-and-pid-1)."""

    stop: str | None = None
    usr1 = 0

    @classmethod
    def install(cls) -> None:
        def on_stop(signum, frame):
            cls.stop = cls.stop or signal.Signals(signum).name
            stop_request.request(cls.stop)  # long creation work stops at its next piece

        def on_usr1(signum, frame):
            cls.usr1 += 1

        for s in STOP_SIGNALS:
            signal.signal(s, on_stop)
        signal.signal(signal.SIGUSR1, on_usr1)

    @classmethod
    def take(cls) -> tuple[str | None, int]:
        """(first stop signal's name or None, SIGUSR1 count) received so far; resets both."""
        out = (cls.stop, cls.usr1)
        cls.stop, cls.usr1 = None, 0
        return out


@contextlib.contextmanager
def signals_blocked():
    """Block SIGTERM/SIGINT/SIGHUP/SIGUSR1 in the proxy while it spawns the worker, which
    inherits the mask until `worker.signals.SignalFlags.install()` unblocks it
    (docs/signals.md#start-up). The proxy's own pending signals arrive when this exits."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def become_subreaper() -> bool:
    """prctl(PR_SET_CHILD_SUBREAPER): orphans of the worker's tree are re-parented to the proxy
    (not to init), so the proxy can reap them and none outlives the run. False if unsupported."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_orphans(keep: set[int]) -> None:
    """Reap every exited child except those in `keep` (the worker, whose status belongs to its
    Popen), without blocking. Peeks with waitid(WNOWAIT) so the worker's status is never
    stolen. Cost: one syscall when nothing is waiting."""
    try:
        while (info := os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)) is not None:
            if info.si_pid == 0 or info.si_pid in keep:
                return  # nothing waiting, or the worker first (Popen.poll reaps it next)
            os.waitpid(info.si_pid, os.WNOHANG)
    except ChildProcessError:
        return


def describe(pid: int) -> str:
    """'pid 123 (python -m worker ..., stopped (SIGSTOP?))'; for log lines that say
    which process did not answer."""
    state = process_state(pid)
    try:
        cmd = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        state = None
    if state is None:
        return f"pid {pid} (gone)"
    if len(cmd) > 60:
        cmd = cmd[:57] + "..."
    return f"pid {pid} ({cmd}, {STATES.get(state, state)})"


def signal_group(pgid: int, sig: int) -> None:
    """killpg, ignoring a group that is already gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
