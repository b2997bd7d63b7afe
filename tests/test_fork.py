"""Audit fork (docs/operations.md): `python -m proxy fork --from RUN_DIR[:STEP] --run-dir NEW`."""
import json
import os
import subprocess
import sys

import pytest

from proc_helpers import ROOT, loss_records, run_proxy
from shared.checkpoint.file_format import checkpoint_name
from shared.checkpoint.manifest import read_manifest

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

COMMON = ["--max-steps", "60", "--checkpoint-every", "20", "--probe-every", "5",
          "--bandit-warmup", "5", "--keep-last", "5"]


def fork(src, new):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "proxy", "fork", "--from", src, "--run-dir", str(new)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_fork_at_step_20_carries_history_and_checkpoint_and_reproduces_the_original_run(tmp_path):
    a = tmp_path / "a"
    assert run_proxy(a, *COMMON).returncode == 0
    f = tmp_path / "f"
    r = fork(f"{a}:20", f)
    assert r.returncode == 0, r.stderr
    assert [x["step"] for x in loss_records(f)] == list(range(1, 21))
    assert loss_records(f) == loss_records(a)[:20]
    assert sorted(p.name for p in f.glob("step_*.bin")) == [checkpoint_name(20)]
    entry = read_manifest(f)[20]
    assert entry.pinned and entry.checksum == read_manifest(a)[20].checksum
    assert json.loads((f / "run.json").read_text()) == json.loads((a / "run.json").read_text())
    assert sorted(p.name for p in (f / "data").iterdir()) == sorted(p.name for p in (a / "data").iterdir())
    assert json.loads((f / "fork.json").read_text())["step"] == 20
    # the fork resumes from step 20 and, the run being deterministic, ends where the original did
    assert run_proxy(f, *COMMON).returncode == 0
    assert (f / checkpoint_name(60)).read_bytes() == (a / checkpoint_name(60)).read_bytes()
    assert [x["loss"] for x in loss_records(f)] == [x["loss"] for x in loss_records(a)]


def test_fork_refuses_a_used_directory_and_a_step_without_a_checkpoint(tmp_path):
    a = tmp_path / "a"
    assert run_proxy(a, "--max-steps", "20", "--checkpoint-every", "10").returncode == 0
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("x")
    r = fork(str(a), used)
    assert r.returncode == 2 and "not empty" in r.stderr
    r = fork(f"{a}:15", tmp_path / "g")
    assert r.returncode == 2 and "15" in r.stderr
    assert not (tmp_path / "g" / "run.json").exists()
    r = fork(str(a), tmp_path / "h")          # default: the newest valid checkpoint
    assert r.returncode == 0 and "step 20" in r.stdout


def test_fork_of_a_run_with_a_garbage_arm_index_is_refused_naming_the_file(tmp_path):
    a = tmp_path / "a"
    assert run_proxy(a, "--max-steps", "10", "--checkpoint-every", "10").returncode == 0
    (a / "data" / "arms.json").write_text("{not json")
    r = fork(str(a), tmp_path / "g")
    assert r.returncode == 2, r.stderr
    assert "fork refused" in r.stderr and "arms.json" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "g").exists()  # refused before anything was written
