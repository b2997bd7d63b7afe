"""Threads of the read-only commands (`sample`, `export`, `plot`, `inspect`): `--threads N`,
else OMP_NUM_THREADS, else 1, so a command run beside a live training run never competes with it
for cores (docs/operations.md#beside-a-live-run, measured by `scripts/bench_sample.py`). The
number goes into the environment of every thread pool a library reads at import, before numpy or
torch is imported, and into torch by the command that imports it.

What it is not: the worker's threads (worker/), nor the proxy's `run`.
"""

from __future__ import annotations

import contextlib
import os
import sys

READ_ONLY = ("sample", "export", "plot", "inspect")
POOL_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "RAYON_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)


def threads_from_argv(argv: list[str]) -> int | None:
    """`--threads N` (or `--threads=N`) in `argv` as an int >= 1, else None (absent or not a
    positive number: the command's own parser names a bad value)."""
    for i, arg in enumerate(argv):
        value = None
        if arg == "--threads" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
        if value is not None:
            return int(value) if value.strip().isdigit() and int(value) >= 1 else None
    return None


def add_threads_arg(p) -> None:
    """`--threads N` of every read-only command (argparse parser `p`): the number `tool_threads`
    takes."""
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads (default: OMP_NUM_THREADS, else 1, so a live run beside it "
        "keeps its cores; docs/operations.md#beside-a-live-run)",
    )


def tool_threads(requested: int | None = None) -> int:
    """The threads a read-only command uses: `requested` (>= 1), else OMP_NUM_THREADS (a
    positive integer), else 1."""
    if requested is not None and requested >= 1:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) >= 1 else 1


def limit_threads(requested: int | None) -> None:
    """Set every library thread pool's size to `tool_threads(requested)` through the environment
    (call before numpy or torch is imported), and in torch when it is already imported."""
    n = tool_threads(requested)
    os.environ.update(dict.fromkeys(POOL_VARS, str(n)))
    if sys.modules.get("torch") is not None:
        set_torch_threads(n)


def set_torch_threads(n: int) -> None:
    """torch's intra-op threads to `n`, and its inter-op threads to 1 when it is still allowed
    (only before torch's first parallel work)."""
    import torch

    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # already set, or parallel work already ran
        torch.set_num_interop_threads(1)
