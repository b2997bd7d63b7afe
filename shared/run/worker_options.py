"""The worker's options: one dataclass that writes its own command line (the proxy's side,
proxy/supervision/supervisor.py) and parses it back (the worker's side, worker/__main__.py), so
each option and its default are stated once (docs/architecture.md#processes).

What it is not: the run's config (`run.json`, shared/run/config.py), which a resume must match;
these options may change from one incarnation to the next. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from shared.checkpoint.manifest import DEFAULT_KEEP_EVERY, DEFAULT_KEEP_LAST
from shared.run.config import AUDIT_TOKENS

USR1_AT = ("step", "boundary")
PRECISIONS = ("auto", "fp32", "bf16")
COMPILE = ("auto", "on", "off")


@dataclass
class WorkerOptions:
    """Per-incarnation options the proxy passes on the worker's command line. `max_nonfinite`
    and `audit_tokens` are not on the command line (tests and benchmarks set them)."""

    run_dir: Path
    resume_from: Path | None = None
    max_steps: int | None = None  # None: run.json's max_steps
    usr1_at: str = "step"  # "step" or "boundary"
    device: str = "auto"
    parent_pid: int | None = None
    keep_last: int = DEFAULT_KEEP_LAST
    keep_every: int = DEFAULT_KEEP_EVERY
    policy_timeout: float = 120.0  # seconds to wait for the proxy's policy
    max_nonfinite: int = 5  # consecutive non-finite steps before the run stops
    audit_tokens: int = AUDIT_TOKENS  # tokens generated per arm per sample audit
    compile: str = "auto"  # torch.compile the training step: auto (CUDA), on, off
    precision: str = "auto"  # auto, fp32, bf16: worker/precision.py
    micro_batch_size: int | None = None  # None: run.json's (None there: the rank's whole slice)
    resume_verified: str | None = None  # checksum the proxy verified resume_from against

    def to_argv(self) -> list[str]:
        """The options as `python -m worker` arguments, in a fixed order; an option at its
        default is left out unless the worker needs it said (run dir, steps, signals, pid,
        retention)."""
        argv = ["--run-dir", str(self.run_dir)]
        if self.max_steps is not None:
            argv += ["--max-steps", str(self.max_steps)]
        argv += ["--usr1-at", self.usr1_at, "--device", self.device]
        if self.parent_pid is not None:
            argv += ["--parent-pid", str(self.parent_pid)]
        argv += ["--keep-last", str(self.keep_last), "--keep-every", str(self.keep_every)]
        if self.policy_timeout != WorkerOptions.policy_timeout:
            argv += ["--policy-timeout", repr(self.policy_timeout)]
        if self.resume_from is not None:
            argv += ["--resume-from", str(self.resume_from)]
            if self.resume_verified:  # the worker checks the file against it as it reads
                argv += ["--resume-verified", self.resume_verified]
        if self.compile != "auto":
            argv += ["--compile", self.compile]
        if self.precision != "auto":
            argv += ["--precision", self.precision]
        if self.micro_batch_size is not None:  # per start: speed and memory, not the data
            argv += ["--micro-batch-size", str(self.micro_batch_size)]
        return argv

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """The `python -m worker` parser; every default is the dataclass's."""
        d = {f.name: f.default for f in dataclasses.fields(cls)}
        ap = argparse.ArgumentParser(prog="python -m worker")
        ap.add_argument("--run-dir", required=True)
        ap.add_argument("--resume-from", default=None)
        ap.add_argument(
            "--resume-verified",
            default=d["resume_verified"],
            help="the checksum the proxy verified --resume-from against: the worker checks "
            "the file against it again as it reads it (the file may have changed since the "
            "scan), without reading the manifest",
        )
        ap.add_argument("--max-steps", type=int, default=d["max_steps"])
        ap.add_argument("--usr1-at", choices=USR1_AT, default=d["usr1_at"])
        ap.add_argument("--device", default=d["device"])
        ap.add_argument("--parent-pid", type=int, default=d["parent_pid"])
        ap.add_argument("--keep-last", type=int, default=d["keep_last"])
        ap.add_argument("--keep-every", type=int, default=d["keep_every"])
        ap.add_argument("--policy-timeout", type=float, default=d["policy_timeout"])
        ap.add_argument(
            "--compile",
            choices=COMPILE,
            default=d["compile"],
            help="torch.compile the training step: auto (on for CUDA, off for CPU), on, off",
        )
        ap.add_argument(
            "--precision",
            choices=PRECISIONS,
            default=d["precision"],
            help="auto: bf16 autocast on CUDA, fp32 on CPU; bf16: autocast on any "
            "device; fp32: none. Weights, m, v and checkpoints are fp32 always",
        )
        ap.add_argument(
            "--micro-batch-size",
            type=int,
            default=d["micro_batch_size"],
            help="sequences per forward/backward on this rank (default: run.json's)",
        )
        return ap

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> WorkerOptions:
        """Parse `python -m worker` arguments (sys.argv[1:] when None); argparse exits 2 with
        its usage line on a bad one."""
        a = vars(cls.parser().parse_args(argv))  # every dest is a field's name
        a["run_dir"] = Path(a["run_dir"])
        a["resume_from"] = Path(a["resume_from"]) if a["resume_from"] else None
        return cls(**a)
