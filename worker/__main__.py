"""`python -m worker --run-dir DIR ...`: the training worker the proxy spawns (not for operators).

Signal handlers are installed before torch is imported, so a SIGTERM or SIGUSR1 during start-up
is honoured (after the first step), never fatal.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from shared.checkpoint_manifest import DEFAULT_KEEP_EVERY, DEFAULT_KEEP_LAST
from shared.exit_codes import EXIT_FATAL
from worker.signals import SignalFlags


def main(argv: list[str] | None = None) -> int:
    flags = SignalFlags()
    flags.install()  # first thing: before the slow imports below
    ap = argparse.ArgumentParser(prog="python -m worker")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--resume-from", default=None)
    ap.add_argument("--resume-verified", default=None,
                    help="the checksum the proxy verified --resume-from against: the worker "
                         "still checks its size and header but does not checksum it again")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--usr1-at", choices=("step", "boundary"), default="step")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--keep-last", type=int, default=DEFAULT_KEEP_LAST)
    ap.add_argument("--keep-every", type=int, default=DEFAULT_KEEP_EVERY)
    ap.add_argument("--policy-timeout", type=float, default=120.0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the training module")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="auto: bf16 autocast on CUDA, fp32 on CPU; bf16: autocast on any device; "
                         "fp32: none. Weights, m, v and checkpoints are fp32 always")
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="sequences per forward/backward on this rank (default: run.json's)")
    args = ap.parse_args(argv)
    level = logging.getLevelName(os.environ.get("ANDREA_LOG_LEVEL", "INFO").upper())
    logging.basicConfig(level=level if isinstance(level, int) else logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(message)s")
    logging.getLogger("filelock").setLevel(max(logging.INFO, logging.getLogger().level))
    if args.parent_pid:
        flags.watch_parent(args.parent_pid)

    from pathlib import Path
    from shared.procfs import seconds_since_start
    log = logging.getLogger("worker")
    log.debug("start-up: worker interpreter %.3f s since launch", seconds_since_start() or 0.0)
    from worker.trainer import Trainer, WorkerOptions
    log.debug("start-up: torch and the trainer imported %.3f s since launch",
              seconds_since_start() or 0.0)
    opts = WorkerOptions(run_dir=Path(args.run_dir),
                         resume_from=Path(args.resume_from) if args.resume_from else None,
                         max_steps=args.max_steps, usr1_at=args.usr1_at, device=args.device,
                         parent_pid=args.parent_pid, keep_last=args.keep_last,
                         keep_every=args.keep_every, policy_timeout=args.policy_timeout,
                         compile=args.compile, precision=args.precision,
                         micro_batch_size=args.micro_batch_size,
                         resume_verified=args.resume_verified)
    try:
        trainer = Trainer(opts, flags)
    except ValueError as e:  # ConfigError, CheckpointError: operator-facing, no traceback
        return _fatal(opts.run_dir, e)
    from shared.arms import ArmSourceError
    try:
        return trainer.run()
    except ArmSourceError as e:  # a token file changed under the run: restarting cannot help
        return _fatal(opts.run_dir, e)


def _fatal(run_dir, e: Exception) -> int:
    """Log `e` and tell the proxy, in a "stopped" event with exit code 3, that restarting
    cannot help: under torchrun the agent reports a rank's 3 as its own 1, so the code alone
    would read as a crash and be restarted --max-restarts times (docs/signals.md#hangs-and-crashes)."""
    import time
    from shared.handshake import ReportWriter
    from shared.run_layout import RunLayout
    logging.getLogger("worker").error("%s", e)
    try:
        w = ReportWriter(RunLayout(run_dir))
        w.write({"type": "event", "event": "stopped", "step": None, "why": str(e),
                 "exit_code": EXIT_FATAL, "time": time.time()})
        w.close()
    except OSError:
        pass  # the exit code still says it where no agent stands between
    return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main())
