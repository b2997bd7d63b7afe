"""The read-only commands use one CPU thread by default, so they never take a live run's cores;
`--threads N` or OMP_NUM_THREADS gives more (docs/operations.md#beside-a-live-run). Real
processes: the thread count torch really uses is what `sample` prints."""
import os
import re
import subprocess
import sys

import pytest

from proc_helpers import ROOT, run_proxy
from proxy.commands.tool_threads import threads_from_argv, tool_threads


def test_threads_come_from_the_option_then_omp_num_threads_then_one(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert tool_threads() == 1 and tool_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert tool_threads() == 4 and tool_threads(2) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert tool_threads() == 1
    assert threads_from_argv(["--run-dir", "x", "--threads", "3"]) == 3
    assert threads_from_argv(["--threads=2"]) == 2
    assert threads_from_argv(["--threads", "0"]) is None and threads_from_argv([]) is None


@pytest.mark.slow
def test_sample_uses_one_thread_unless_told_and_honours_omp_num_threads(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "2", "--checkpoint-every", "2").returncode == 0
    base = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}

    def threads(*extra, **env):
        r = subprocess.run([sys.executable, "-m", "proxy", "sample", "--run-dir", str(run),
                            "--tokens", "4", *extra], cwd=ROOT, capture_output=True, text=True,
                           env=dict(base, PYTHONPATH=str(ROOT), **env), timeout=120,
                           check=False)
        assert r.returncode == 0, r.stderr
        return int(re.search(r"tokens/s, (\d+) thread", r.stdout).group(1))

    assert threads() == 1
    assert threads(OMP_NUM_THREADS="2") == 2
    assert threads("--threads", "3") == 3
    assert threads("--threads=2", OMP_NUM_THREADS="1") == 2
