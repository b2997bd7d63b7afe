"""`python -m proxy plot --run-dir DIR [--out PNG]`: write a picture of a run (docs/operations.md).
The picture itself is proxy/observation/plot.py."""

from __future__ import annotations

import sys
from pathlib import Path

from proxy.commands.tool_threads import add_threads_arg
from proxy.mixture.rebuild import gate_changes
from proxy.observation.plot import plot_run
from proxy.run_files.checkpoint_lookup import run_dir_problem
from shared.exit_codes import EXIT_USAGE
from shared.run.config import load_run_config
from shared.run.layout import RunLayout


def cmd_plot(a) -> int:
    """Write the picture; exit 0, or 2 when --run-dir is not a run directory (the words of
    every command, proxy/run_files/checkpoint_lookup.py `run_dir_problem`) or has no history
    yet (the message says how to get one)."""
    run_dir = Path(a.run_dir)
    if (problem := run_dir_problem(run_dir)) is not None:
        print(f"plot: {problem[1]}", file=sys.stderr)
        return problem[0]
    try:
        out = plot_run(run_dir, Path(a.out) if a.out else None, _gates(run_dir))
    except FileNotFoundError as e:
        print(
            f"plot: {e}: wait for the first step while the run trains, or start it with "
            f"`python -m proxy run --run-dir {run_dir}`",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(f"plot: wrote {out}")
    return 0


def add_plot_args(p) -> None:
    """`plot --run-dir DIR [--out F.png]`."""
    add_threads_arg(p)
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the run to plot")
    p.add_argument("--out", metavar="F.png", help="PNG path (default DIR/loss.png)")


def _gates(run_dir: Path) -> list[tuple[int, bool]]:
    """Where the default policy's gate opened and closed (a replay of the history), or none,
    with a warning saying why, when the replay fails: the rest of the picture does not need it."""
    layout = RunLayout(run_dir)
    if not layout.loss.exists():
        return []
    try:
        return gate_changes(layout, load_run_config(layout.run_json))
    except Exception as e:  # noqa: BLE001 - a damaged run still gets its loss curves
        print(f"plot: the gate's openings are not marked ({e})", file=sys.stderr)
        return []
