"""Polish pivot on a live run (SPEC section 8, issue 5): real proxy and worker processes."""
import json
import os
import signal
import subprocess
import sys
import time

from proc_helpers import ROOT, TINY, checkpoint_steps, last_step, loss_records, pid_alive, \
    run_proxy, start_proxy, wait_for
from shared.checkpoint_format import checkpoint_name
import pytest

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

COMMON = ["--max-steps", "400", "--checkpoint-every", "20", "--probe-every", "5",
          "--bandit-warmup", "10", "--sample-every", "10"]
CAPS, FLOORS = "repo-code=0.2,python-docs=0.5", "repo-docstrings=0.3"


def pivot(run_dir, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "proxy", "pivot", "--run-dir", str(run_dir), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def owner_pid(run_dir):
    return json.loads((run_dir / ".proxy.owner.json").read_text())["pid"]


def phases(run_dir):
    return json.loads((run_dir / "phases.json").read_text())["phases"]


def in_box(p):
    return (p["repo-code"] <= 0.2 + 1e-12 and p["python-docs"] <= 0.5 + 1e-12
            and p["repo-docstrings"] >= 0.3 - 1e-12 and abs(sum(p.values()) - 1) < 1e-9)


def test_pivot_with_infeasible_or_unknown_bounds_is_refused_before_anything_stops(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "5", "--checkpoint-every", "5").returncode == 0
    before = (run / "phases.json").read_bytes()
    for caps, floors, words in [("nope=0.5", "", "unknown arm 'nope'"),
                                ("repo-code=0.1", "repo-code=0.2", "floor above cap"),
                                ("", "repo-code=0.6,python-docs=0.6", "sum of floors"),
                                ("repo-code=0.1,python-docs=0.1,repo-docstrings=0.1", "", "sum of caps"),
                                ("repo-code=1.5", "", "outside [0, 1]")]:
        r = pivot(run, "--caps", caps, "--floors", floors)
        assert r.returncode == 2 and words in r.stderr, (caps, floors, r.stderr)
    assert (run / "phases.json").read_bytes() == before
    assert not (run / "archive" / "pivot-5").exists()


def test_live_pivot_stops_at_a_boundary_and_resumes_under_the_new_box_from_step_B_exactly(tmp_path):
    run = tmp_path / "run"
    proc = start_proxy(run, *COMMON)
    new_pid = None
    try:
        wait_for(lambda: last_step(run) >= 25, 300, what="training to pass step 25")
        old_wpid = json.loads((run / ".handshake.json").read_text())["worker"]["pid"]
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--label", "polish")
        assert r.returncode == 0, r.stdout + r.stderr
        assert proc.wait(timeout=60) == 0, "the old proxy must exit 0 at the pivot"
        assert not pid_alive(old_wpid)
        wait_for(lambda: len(phases(run)) == 2, 120, what="the new proxy to start the new phase")
        ph = phases(run)[1]
        b = ph["start_step"]
        assert b % 20 == 0 and b >= 40 and (ph["index"], ph["label"]) == (1, "polish")
        new_pid = owner_pid(run)
        assert new_pid != proc.pid and pid_alive(new_pid)
        samples = run / ".samples.json"
        assert (not samples.exists()) or json.loads(samples.read_text())["audits"] == [], \
            "the sample log must start empty in the new phase"
        archived = run / "archive" / f"pivot-{b}"
        old_state = json.loads((archived / ".state.json").read_text())
        assert (old_state["step"], old_state["phase"]["index"]) == (b, 0)
        old_audits = json.loads((archived / ".samples.json").read_text())["audits"]
        assert old_audits and max(a["step"] for a in old_audits) <= b
        wait_for(lambda: last_step(run) >= b + 25, 300, what="training after the pivot")
        os.kill(new_pid, signal.SIGTERM)
        wait_for(lambda: not pid_alive(new_pid), 120, what="the new proxy to stop")
    finally:
        if proc.poll() is None:
            proc.kill()
        if new_pid and pid_alive(new_pid):
            os.kill(new_pid, signal.SIGKILL)
    records = loss_records(run)
    assert [x["step"] for x in records] == list(range(1, len(records) + 1)), "a gap in the history"
    assert records[b - 1]["phase"] == {"label": "initial", "index": 0}
    assert records[b]["phase"] == {"label": "polish", "index": 1}
    assert all(in_box(x["p"]) for x in records[b:]), "an arm left its new box"
    assert not all(in_box(x["p"]) for x in records[:b]), "the old box already satisfied the new one"
    audits = json.loads((run / ".samples.json").read_text())["audits"]
    assert audits and all(a["step"] > b for a in audits)
    assert b + 20 in checkpoint_steps(run)

    # The same pivot on an audit fork at B (a stopped run) must reach a byte-identical
    # checkpoint at B+20: the live pivot resumed from step_B.bin's weights, m and v exactly.
    fork = tmp_path / "fork"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    f = subprocess.run([sys.executable, "-m", "proxy", "fork", "--from", f"{run}:{b}",
                        "--run-dir", str(fork)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert f.returncode == 0, f.stderr
    r = pivot(fork, "--caps", CAPS, "--floors", FLOORS, "--label", "polish",
              "--run-args", " ".join(TINY + ["--max-steps", str(b + 20)]))
    assert r.returncode == 0, r.stdout + r.stderr
    fpid = int(r.stdout.split("new proxy pid ")[1].split()[0])
    wait_for(lambda: (fork / checkpoint_name(b + 20)).exists(), 300, what="the fork's checkpoint")
    wait_for(lambda: not pid_alive(fpid), 120, what="the fork's proxy to finish")
    assert (fork / checkpoint_name(b + 20)).read_bytes() == (run / checkpoint_name(b + 20)).read_bytes()
