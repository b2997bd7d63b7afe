"""The commit-msg hook (scripts/git-hooks/commit-msg, CONTRIBUTING.md#commits) run as git runs it:
an executable given the message file, in a real repository."""
import subprocess

import pytest

from proc_helpers import ROOT

HOOK = ROOT / "scripts" / "git-hooks" / "commit-msg"


@pytest.mark.parametrize("message, words", [
    ("Sort imports everywhere\n\nWhy: isort's rules.\n", None),
    ("x" * 72 + "\n", "72 characters"),
    ("WIP: half of the split\n", "WIP"),
    ("Fix the pivot.\n", "full stop"),
    ("Fix the pivot\nno blank line\n", "blank line"),
    ("# only git's comments\n\n", "empty"),
])
def test_the_hook_refuses_long_wip_and_unseparated_subjects(tmp_path, message, words):
    f = tmp_path / "COMMIT_EDITMSG"
    f.write_text(message)
    r = subprocess.run([str(HOOK), str(f)], capture_output=True, text=True, timeout=30)
    assert (r.returncode == 0) == (words is None), r.stderr
    assert words is None or words in r.stderr


def test_git_runs_the_hook_once_configured(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True,
                              timeout=30)
    git("init", "-q")
    git("config", "core.hooksPath", str(HOOK.parent))
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "f").write_text("x")
    git("add", "f")
    assert git("commit", "-q", "-m", "WIP").returncode != 0
    assert git("commit", "-q", "-m", "Add f").returncode == 0
