"""The proxy's test hooks, in one module as the worker's are in worker/fault_injection.py (docs/
architecture.md#bad-input-and-faults). Each is off unless its environment variable is set;
production never sets them.

  ANDREA_FAULT_PIVOT=MOMENT    the proxy SIGKILLs itself at that moment of a pivot: before-boundary,
                               during-checkpoint, after-archive or after-record (docs/pivots.md)
  ANDREA_TEST_NO_FLOCK=1       the run lock acts as on a filesystem whose flock is not shared
                               between hosts, so two "hosts" can share one machine (tests/test_nodes.py)
  ANDREA_TOKENIZE_DELAY=SECS   creation sleeps SECS after each recorded batch of an arm's
                               tokenization, so a test can stop or kill it mid-arm

What it is not: the worker's hooks (worker/fault_injection.py).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

log = logging.getLogger("proxy.commands.pivot")

PIVOT_ENV = "ANDREA_FAULT_PIVOT"
NO_FLOCK_ENV = "ANDREA_TEST_NO_FLOCK"
TOKENIZE_DELAY_ENV = "ANDREA_TOKENIZE_DELAY"


def pivot_fault(moment: str) -> None:
    """SIGKILL this proxy when ANDREA_FAULT_PIVOT names `moment` (the crash-safety tests of
    docs/pivots.md#crash-safety)."""
    if os.environ.get(PIVOT_ENV) == moment:
        log.warning("%s=%s: killing this proxy (SIGKILL) for a crash test", PIVOT_ENV, moment)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


def flock_shared() -> bool:
    """False under ANDREA_TEST_NO_FLOCK=1: the run lock's flock is then not relied on."""
    return os.environ.get(NO_FLOCK_ENV) != "1"


def tokenize_pause() -> Callable[[], None] | None:
    """The pause after each recorded tokenization batch under ANDREA_TOKENIZE_DELAY, or None."""
    secs = float(os.environ.get(TOKENIZE_DELAY_ENV) or 0)
    return (lambda: time.sleep(secs)) if secs > 0 else None
