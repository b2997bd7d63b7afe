"""`python -m proxy plot --run-dir DIR [--out PNG]`: write a picture of a run (docs/operations.md).
The picture itself is proxy/observation/plot.py."""

from __future__ import annotations

import sys
from pathlib import Path

from proxy.commands.tool_threads import add_threads_arg
from proxy.observation.plot import plot_run
from shared.exit_codes import EXIT_USAGE


def cmd_plot(a) -> int:
    try:
        out = plot_run(Path(a.run_dir), Path(a.out) if a.out else None)
    except FileNotFoundError as e:
        print(f"plot: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"plot: wrote {out}")
    return 0


def add_plot_args(p) -> None:
    """`plot --run-dir DIR [--out F.png]`."""
    add_threads_arg(p)
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the run to plot")
    p.add_argument("--out", default=None, metavar="F.png", help="PNG path (default DIR/loss.png)")
