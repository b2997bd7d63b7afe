"""`python -m proxy run --config FILE.toml`: a run's options in a TOML file, its keys the `run`
options' long names with `_` or `-`, checked against the `run` parser itself; command line >
file > default (docs/configuration.md#the-config-file). The namespace's `sources` says where each
value came from, for the start-up table and run.json.

What it is not: the options' definitions (proxy/commands/run_args.py) or their meaning (run.json,
shared/run/config.py).
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from pathlib import Path

from shared.run.config import ConfigError

FILE, COMMAND_LINE, DEFAULT = "file", "command line", "default"


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        a.dest: a
        for a in parser._actions  # noqa: SLF001 - argparse has no public list
        if a.dest not in ("help", "config") and a.help != argparse.SUPPRESS
    }


def _check_value(path: Path, key: str, value, action: argparse.Action):
    """`value` converted as the command line would, or ConfigError naming the key and type."""
    opt = action.option_strings[-1] if action.option_strings else key

    def bad(want: str) -> ConfigError:
        return ConfigError(
            f"{path}: {key} = {value!r} ({type(value).__name__}): {opt} takes {want}"
        )

    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if action.choices is not None and {"on", "off"} <= set(action.choices):
        if isinstance(value, bool):  # `compile = true`: a switch with an auto setting
            return "on" if value else "off"
        if not isinstance(value, str):
            raise bad(f"true or false, or one of {', '.join(action.choices)}")
    if isinstance(action, argparse._AppendAction):  # noqa: SLF001
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return value
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        value = float(value)
    elif action.dest == "nnodes" and type(value) in (int, float):  # `nnodes = 2`
        value = str(value)
    elif not isinstance(value, str):
        raise bad("a string")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(
            f"{path}: {key} = {value!r}: choose one of {', '.join(map(str, action.choices))}"
        )
    return value


def read_config_file(path: Path, parser: argparse.ArgumentParser) -> dict:
    """The options in TOML file `path` as {dest: value}, checked against `parser`'s `run`
    options. Raises ConfigError: unreadable file, not TOML (with tomllib's line and column),
    an unknown key (naming the closest valid one), a value of the wrong type or choice."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not valid TOML: not UTF-8 text (byte {e.object[e.start]:#04x} at "
            f"offset {e.start}); a config file is UTF-8 text, see configs/ for "
            "examples"
        ) from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message ends "(at line L, column C)"
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    actions = _actions(parser)
    out = {}
    for key, value in raw.items():
        dest = key.replace("-", "_")
        if dest not in actions:
            close = difflib.get_close_matches(dest, list(actions), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{path}: unknown key {key!r}{hint} (keys are the `run` options' "
                "long names, with _ or -; see docs/configuration.md)"
            )
        out[dest] = _check_value(path, key, value, actions[dest])
    return out


def parse_run_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse the `run` options `argv` with `--config FILE` applied (command line > file >
    default). The namespace gains `sources` ({dest: "command line" | "file" | "default"}).
    Raises ConfigError for a bad file; argparse exits 2 for a bad command line, as without a
    file."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    values = read_config_file(Path(known.config), parser) if known.config else {}
    actions = _actions(parser)
    saved = {d: (a.default, a.required) for d, a in actions.items()}
    try:
        for dest, v in values.items():
            actions[dest].default, actions[dest].required = v, False
        ns = parser.parse_args(argv)
        for a in actions.values():  # which options the command line itself gave
            a.default, a.required = argparse.SUPPRESS, False
        given = vars(parser.parse_args(argv))
    finally:
        for d, (default, required) in saved.items():
            actions[d].default, actions[d].required = default, required
    for d, v in given.items():  # a repeatable option on the command line replaces the file's
        if d in actions and isinstance(actions[d], argparse._AppendAction):  # noqa: SLF001
            setattr(ns, d, v)
    ns.sources = {
        d: COMMAND_LINE if d in given else FILE if d in values else DEFAULT for d in actions
    }
    return ns
