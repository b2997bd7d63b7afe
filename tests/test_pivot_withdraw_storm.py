"""`pivot --withdraw` and `.pivot.request.lock` against a hostile operator (docs/pivots.md
#withdrawing-a-pivot): a proxy killed while it holds the request lock, a SIGTERM in the middle of
a pivot, another `pivot` holding the run lock. Real proxy, worker and `pivot` processes; every
wait is for a state, never for a duration."""

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from proc_helpers import ROOT, cleaned_up, last_step, loss_records, start, wait_for
from proxy.run_files.run_lock import RunLock
from shared.run.layout import RunLayout

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

CAPS, FLOORS = "repo-code=0.2,python-docs=0.5", "repo-docstrings=0.3"
PENDING = ("requested", "boundary", "archived", "recorded")


def pivot(run_dir, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("ANDREA_FAULT_PIVOT", None)
    return subprocess.run(
        [sys.executable, "-m", "proxy", "pivot", "--run-dir", str(run_dir), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def request(run_dir) -> dict:
    try:
        return json.loads((Path(run_dir) / ".pivot.request.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


def phases(run_dir) -> list[dict]:
    return json.loads((Path(run_dir) / "phases.json").read_text())["phases"]


def assert_sound(run_dir, pending_allowed: bool = False) -> None:
    """The invariants every scenario must keep: every step once, each record's phase the one
    phases.json puts in force there, no pending request unless allowed, no temporaries, and
    `status` works."""
    run_dir = Path(run_dir)
    recs = [r for r in loss_records(run_dir) if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1))
    ph = phases(run_dir)
    for r in recs:
        want = max((p for p in ph if p["start_step"] < r["step"]), key=lambda p: p["start_step"])
        assert r["phase"]["index"] == want["index"], (r["step"], r["phase"], ph)
    assert pending_allowed or request(run_dir).get("state") not in PENDING, request(run_dir)
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    s = subprocess.run(
        [sys.executable, "-m", "proxy", "status", "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert s.returncode == 0, s.stdout + s.stderr


ARGS = [
    "--max-steps",
    "3000",
    "--probe-every",
    "5",
    "--bandit-warmup",
    "10",
    "--sample-every",
    "50",
    "--keep-last",
    "1000",
]


def test_a_proxy_killed_while_it_holds_the_request_lock_blocks_no_withdrawal_run_or_pivot(tmp_path):
    """kill -9 of the proxy while it holds `.pivot.request.lock` (seen from outside: a
    non-blocking flock fails): the lock dies with it, so `pivot --withdraw` acts at once, the
    next `run` resumes, and a `--now` pivot on it is put in force."""
    run = tmp_path / "run"
    proc = start(run, *ARGS, "--checkpoint-every", "10")
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 5, 300, what="training to pass step 5")
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--no-wait", "--label", "k")
        assert r.returncode == 0, r.stdout + r.stderr
        fd = os.open(run / ".pivot.request.lock", os.O_RDWR | os.O_CREAT)

        def held_by_proxy() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False

        try:
            wait_for(held_by_proxy, 300, 0.001, "the proxy to hold the request lock")
            proc.kill()  # while it holds it (it releases it only by finishing its move)
        finally:
            os.close(fd)
        proc.wait(60)
        w = pivot(run, "--withdraw", timeout=120)
        assert w.returncode == 0 or (w.returncode == 2 and "too late" in w.stderr), (
            w.stdout + w.stderr
        )
        proc = start(run, *ARGS, "--checkpoint-every", "10")
        wait_for(
            lambda: request(run).get("state") not in PENDING,
            300,
            what="the restarted proxy to finish what was not withdrawn",
        )
        n = last_step(run)
        wait_for(lambda: last_step(run) >= n + 3, 300, what="training after the restart")
        before = len(phases(run))
        r = pivot(run, "--keep-bounds", "--now", "--label", "after")
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(phases(run)) == before + 1
        n = last_step(run)
        wait_for(lambda: last_step(run) >= n + 3, 300, what="training in the new phase")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    assert_sound(run)


@pytest.mark.parametrize("now", [False, True])
def test_a_pivot_withdrawn_after_a_sigterm_stopped_its_run_leaves_the_run_in_its_phase(
    tmp_path, now
):
    """SIGTERM while a pivot's boundary is posted (far ahead, or the next step with --now):
    the proxy exits 0 and the request stays pending; `pivot --withdraw` on the stopped run
    removes it; the next `run` goes on in phase 0 with every step once."""
    run = tmp_path / "run"
    every = "10" if now else "1000"  # without --now B = 1000, far beyond where it stops
    proc = start(run, *ARGS, "--checkpoint-every", every)
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 5, 300, what="training to pass step 5")
        r = pivot(
            run,
            "--caps",
            CAPS,
            "--floors",
            FLOORS,
            "--no-wait",
            "--label",
            "t",
            *(["--now"] if now else []),
        )
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for(lambda: request(run).get("state") != "requested", 300, what="the proxy to post B")
        if not now:  # B = 1000 is far ahead; with --now the worker may stop at B first
            assert request(run)["state"] == "boundary"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        state = request(run).get("state")
        w = pivot(run, "--withdraw")
        if state in ("requested", "boundary"):
            assert w.returncode == 0, w.stdout + w.stderr
            assert not request(run)
            want = 1
        else:  # (--now only) the phase change was already under way or done
            assert w.returncode == 2, w.stdout + w.stderr
            want = 2
        assert_sound(run, pending_allowed=(want == 2))
        proc = start(run, *ARGS, "--checkpoint-every", every)
        n = last_step(run)
        wait_for(
            lambda: last_step(run) >= n + 5 and request(run).get("state") not in PENDING,
            300,
            what="training after the restart",
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    assert len(phases(run)) == want
    assert_sound(run)


def test_a_pivot_on_a_run_whose_lock_another_pivot_command_holds_is_refused(tmp_path):
    """While a `pivot` command holds a stopped run's lock (recording its own pivot), a second
    `pivot` must be refused (exit 2) and write nothing; it must not take that command for a
    live proxy and write a request the first one then overwrites."""
    run = tmp_path / "run"
    proc = start(run, *ARGS, "--checkpoint-every", "10")
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 12, 300, what="a first checkpoint")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    lock = RunLock(RunLayout(run), command="pivot")  # as `pivot` on a stopped run holds it
    lock.acquire()
    try:
        r = pivot(run, "--keep-bounds", "--label", "second", "--no-wait")
    finally:
        lock.release()
    assert r.returncode == 2, r.stdout + r.stderr
    assert "another `pivot` command" in r.stderr and "is putting a pivot in force" in r.stderr
    assert not request(run)


def test_a_live_proxy_outlives_another_process_holding_the_request_lock_too_long(tmp_path):
    """Another process holding `.pivot.request.lock` past the proxy's lock timeout (a `pivot
    --withdraw` suspended by ^Z inside it) must not end the live proxy: it says so in its log
    and goes on once the lock is free, and still stops with exit 0 on SIGTERM."""
    from proc_helpers import proxy_log

    run = tmp_path / "run"
    proc = start(run, *ARGS, "--checkpoint-every", "10")
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 5, 300, what="training to pass step 5")
        fd = os.open(run / ".pivot.request.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            wait_for(
                lambda: proc.poll() is not None or ".pivot.request.lock" in proxy_log(run),
                300,
                what="the proxy to notice the lock held",
            )
        finally:
            os.close(fd)
        assert proc.poll() is None, "the proxy exited while another process held the lock"
        n = last_step(run)
        wait_for(lambda: last_step(run) >= n + 3, 300, what="training after the lock is free")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    assert_sound(run)
