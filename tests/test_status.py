"""`status` never presents an invalid file as the last checkpoint (found by a new-user session)."""
import os
import subprocess
import sys

from proc_helpers import ROOT, run_proxy
import pytest

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes


def test_status_skips_a_truncated_newest_checkpoint_and_names_it_invalid(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "20", "--checkpoint-every", "10").returncode == 0
    with open(run / "step_000020.bin", "r+b") as f:
        f.truncate(1000)
    r = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("checkpoint"))
    assert "step_000010.bin" in line
    assert any(l.startswith("INVALID") and "step_000020.bin" in l for l in r.stdout.splitlines())


def test_pivot_of_a_finished_run_is_refused_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "20", "--checkpoint-every", "10").returncode == 0
    phases = (run / "phases.json").read_text()
    r = subprocess.run([sys.executable, "-m", "proxy", "pivot", "--run-dir", str(run), "--caps",
                        "repo-code=0.5"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "already finished at step 20" in r.stderr
    assert (run / "phases.json").read_text() == phases and (run / ".state.json").exists()


def test_sample_prints_text_from_the_newest_checkpoint_and_refuses_a_bad_file(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "20", "--checkpoint-every", "10").returncode == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "proxy", "sample"]
    r = subprocess.run(cmd + ["--run-dir", str(run), "--prompt", "def f(", "--tokens", "30",
                              "--samples", "2"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "step_000020.bin (step 20" in r.stdout
    assert r.stdout.count("\nsample 1/2\n") == r.stdout.count("\nsample 2/2\n") == 1
    assert r.stdout.count("    prompt | def f(\n      text |") == 2  # apart
    with open(run / "step_000020.bin", "r+b") as f:
        f.truncate(100)
    r = subprocess.run(cmd + [str(run / "step_000020.bin")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "step_000020.bin" in r.stderr
