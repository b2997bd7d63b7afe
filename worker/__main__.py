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
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker[{os.getpid()}] %(levelname)s %(message)s")
    if args.parent_pid:
        flags.watch_parent(args.parent_pid)

    from pathlib import Path
    from worker.trainer import Trainer, WorkerOptions
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
        logging.getLogger("worker").error("%s", e)
        return EXIT_FATAL
    from shared.arms import ArmSourceError
    try:
        return trainer.run()
    except ArmSourceError as e:  # a token file changed under the run: restarting cannot help
        logging.getLogger("worker").error("%s", e)
        return EXIT_FATAL


if __name__ == "__main__":
    sys.exit(main())
