"""`python -m worker --run-dir DIR ...`: the training worker the proxy spawns (not for operators).

Signal handlers are installed before torch is imported, so a SIGTERM or SIGUSR1 during start-up
is honoured (after the first step), never fatal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

from shared.atomic_io import storage_failure
from shared.exit_codes import EXIT_FAILED, EXIT_FATAL
from shared.processes import seconds_since_start
from shared.run.config import ArmSourceError
from shared.run.handshake import ReportWriter
from shared.run.layout import RunLayout
from shared.run.worker_options import WorkerOptions
from worker import fault_injection
from worker.signals import SignalFlags


def main(argv: list[str] | None = None) -> int:
    flags = SignalFlags()
    flags.install()  # first thing: before the slow imports below
    opts = WorkerOptions.from_argv(argv)
    level = logging.getLevelName(os.environ.get("ANDREA_LOG_LEVEL", "INFO").upper())
    logging.basicConfig(
        level=level if isinstance(level, int) else logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(message)s",
    )
    logging.getLogger("filelock").setLevel(max(logging.INFO, logging.getLogger().level))
    if opts.parent_pid:
        flags.watch_parent(opts.parent_pid)

    log = logging.getLogger("worker")
    log.debug("start-up: worker interpreter %.3f s since launch", seconds_since_start() or 0.0)
    from worker.trainer import ResumeLoadError, Trainer  # torch: after the signal handlers

    log.debug(
        "start-up: torch and the trainer imported %.3f s since launch", seconds_since_start() or 0.0
    )
    try:
        hooks = fault_injection.hooks_from_environment(
            opts.run_dir, lambda: flags.stop_reason is not None
        )
        trainer = Trainer(opts, flags, hooks)
    except ResumeLoadError as e:  # changed since the proxy's scan: it scans again, not fatal
        log.error(
            "%s (rule: %s); exiting with code %d: the proxy scans the checkpoints again and "
            "resumes from the newest valid one",
            e,
            e.rule,
            EXIT_FAILED,
        )
        return EXIT_FAILED
    except ValueError as e:  # ConfigError, CheckpointError: operator-facing, no traceback
        return _fatal(opts.run_dir, e)
    try:
        return trainer.run()
    except ArmSourceError as e:  # a token file changed under the run: restarting cannot help
        return _fatal(opts.run_dir, e)
    except OSError as e:  # a report could not be written (a full disk): no restart can help
        if (line := storage_failure(e)) is None:
            raise
        return _fatal(opts.run_dir, ValueError(line))


def _fatal(run_dir, e: Exception) -> int:
    """Log `e` and tell the proxy, in a "stopped" event with exit code 3, that restarting
    cannot help: under torchrun the agent reports a rank's 3 as its own 1, so the code alone
    would read as a crash and be restarted --max-restarts times (docs/signals.md#hangs-and-crashes)."""
    logging.getLogger("worker").error("%s", e)
    with contextlib.suppress(OSError):  # the exit code still says it where no agent stands between
        w = ReportWriter(RunLayout(run_dir))
        w.write(
            {
                "type": "event",
                "event": "stopped",
                "step": None,
                "why": str(e),
                "exit_code": EXIT_FATAL,
                "time": time.time(),
            }
        )
        w.close()
    return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main())
