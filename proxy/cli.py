"""`python -m proxy COMMAND`: the operator's interface (docs/operations.md#start-and-resume).

The commands are listed in COMMANDS below, once; the module proxy/commands/NAME.py defines
command NAME's options (`add_NAME_args`) and its `cmd_NAME` function. Only the chosen command's
module is imported, so a short command such as `status` does not pay for loading `run`'s
supervision and mixture code. This is the top of the proxy's layers
(docs/architecture.md#the-proxys-layers): nothing imports it but `python -m proxy`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from collections.abc import Iterable

from proxy.commands.run_config_file import parse_run_args
from shared.exit_codes import EXIT_USAGE
from shared.run.config import ConfigError

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


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The `python -m proxy` parser: one sub-command per COMMANDS entry. The sub-commands named
    in `commands` (default: all) get their options and `func`, importing their modules; the
    others only their name and help line, which is all the top-level help and the error for an
    unknown command show."""
    ap = argparse.ArgumentParser(
        prog="python -m proxy",
        description="ANDREA's training system: the supervising proxy and its tools "
        "(docs/README.md).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    wanted = set(dict(COMMANDS) if commands is None else commands)
    for name, help_line in COMMANDS:
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name in wanted:  # import its module (and only it) now
            m = importlib.import_module(f"proxy.commands.{name}")
            getattr(m, f"add_{name}_args")(p)
            p.set_defaults(func=getattr(m, f"cmd_{name}"))
    return ap


def main(argv: list[str] | None = None) -> int:
    # SIGUSR1's default action kills: ignore it until the supervisor installs its handler.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = argv[:1] if argv[:1] and argv[0] in dict(COMMANDS) else []
    ap = build_parser(chosen)
    if chosen == ["run"]:  # --config FILE.toml: command line > file > default
        run = importlib.import_module("proxy.commands.run")
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
