"""`python -m proxy COMMAND`: the operator's interface (docs/operations.md#start-and-resume).

The commands are listed in COMMANDS below, once; each module of proxy/commands/ defines its own
command's options (`add_*_args`) and its `cmd_*` function. This is the top of the proxy's layers
(docs/architecture.md#the-proxys-layers): nothing imports it but `python -m proxy`.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from proxy.commands import export, fork, inspect, pivot, plot, run, sample, status
from proxy.commands.run_config_file import parse_run_args
from proxy.supervision.run_options import add_run_args
from shared.config import ConfigError
from shared.exit_codes import EXIT_USAGE

log = logging.getLogger("proxy")


COMMANDS = (  # name, one line of help; each command's options are defined by its own module
    ("run", "create or resume a run and supervise its worker"),
    ("status", "step, loss and EMA, tokens/s, last checkpoint, arm probabilities, worker health"),
    ("inspect", "check and describe a checkpoint: header, validity, checksum, parameters, norms"),
    ("sample", "generate text from a checkpoint"),
    (
        "pivot",
        "polish pivot in place: new caps and floors, a fresh bandit, same weights, "
        "history and proxy",
    ),
    ("fork", "audit fork: a new run from another run's checkpoint and its history"),
    ("plot", "PNG of loss and EMA, pivots, held-out loss per arm, the arm mixture"),
    ("export", "a checkpoint as safetensors, or as a Hugging Face model folder (--format hf)"),
)


def build_parser() -> argparse.ArgumentParser:
    """The `python -m proxy` parser: one sub-command per COMMANDS entry, each with `func`."""
    ap = argparse.ArgumentParser(
        prog="python -m proxy",
        description="ANDREA's training system: the supervising proxy and its tools "
        "(docs/README.md).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    helps = dict(COMMANDS)
    setup = {
        "run": (add_run_args, run.cmd_run),
        "status": (status.add_status_args, status.cmd_status),
        "inspect": (inspect.add_inspect_args, inspect.cmd_inspect),
        "sample": (sample.add_sample_args, sample.cmd_sample),
        "pivot": (pivot.add_pivot_args, pivot.cmd_pivot),
        "fork": (fork.add_fork_args, fork.cmd_fork),
        "plot": (plot.add_plot_args, plot.cmd_plot),
        "export": (export.add_export_args, export.cmd_export),
    }
    for name, _ in COMMANDS:
        add_args, func = setup[name]
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        add_args(p)
        p.set_defaults(func=func)
    return ap


def main(argv: list[str] | None = None) -> int:
    # SIGUSR1's default action kills: ignore it until the supervisor installs its handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # --config FILE.toml: command line > file > default
        run.setup_logging(None)
        sub = next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction))
        try:
            a = parse_run_args(sub.choices["run"], argv[1:])
        except ConfigError as e:
            log.error("%s", e)
            return EXIT_USAGE
        a.cmd, a.func = "run", run.cmd_run
    else:
        a = ap.parse_args(argv)
    return a.func(a)
