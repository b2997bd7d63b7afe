"""The command line itself: every command listed once, every option explained, and a run
directory that cannot be one refused in one line (no traceback, nothing created)."""
import argparse
import subprocess
import sys

import pytest

from proc_helpers import ROOT
from proxy.cli import COMMANDS, build_parser


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_of_every_command_has_help_text():
    missing = []
    for name, p in _subparsers(build_parser()).items():
        for act in p._actions:
            if isinstance(act, argparse._HelpAction) or act.help == argparse.SUPPRESS:
                continue
            if not (act.help or "").strip():
                missing.append(f"{name} {'/'.join(act.option_strings) or act.dest}")
    assert missing == []


def test_top_level_help_lists_each_command_once():
    text = build_parser().format_help()
    for name, _ in COMMANDS:
        assert sum(line.split()[:1] == [name] for line in text.splitlines()) == 1, name
    assert set(_subparsers(build_parser())) == {n for n, _ in COMMANDS}


def _run(args, tmp_path):
    return subprocess.run([sys.executable, "-m", "proxy", "run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_run_dir_that_is_a_file_gets_one_line_naming_it(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    r = _run(["--run-dir", str(f)], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "ERROR" in ln]
    assert len(lines) == 1 and str(f) in lines[0] and "is a file" in lines[0]
    assert f.read_text() == "x"


@pytest.mark.slow
def test_run_dir_whose_parent_cannot_be_created_gets_one_line_naming_it(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    target = f / "sub" / "run"
    r = _run(["--run-dir", str(target)], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "ERROR" in ln]
    assert len(lines) == 1 and str(target) in lines[0] and "cannot be created" in lines[0]


def test_a_short_command_imports_only_its_own_command_module(tmp_path):
    code = (
        "import sys\n"
        "from proxy.cli import main\n"
        f"rc = main(['status', '--run-dir', {str(tmp_path / 'none')!r}])\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('proxy.commands.'))\n"
        "print(rc, ' '.join(loaded), 'proxy.supervision.supervisor' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rc, *loaded, supervisor = r.stdout.split()
    assert rc == "2" and "proxy.commands.status" in loaded
    assert "proxy.commands.run" not in loaded and supervisor == "False"
