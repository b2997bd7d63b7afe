"""Every signal does exactly one well-defined thing (docs/signals.md, docs/architecture.md#bad-input-and-faults).

Real proxy and worker processes and real signals; the worker's fault hooks
(worker/fault_injection.py: a pause inside a chosen step, a slow checkpoint write) make the
moment a signal lands exact instead of a race with a 10 ms step.
"""
import os
import signal
import time

import psutil
import pytest

from proc_helpers import (
    checkpoint_steps,
    cleaned_up,
    clone,
    create_template,
    hello_pid,
    last_step,
    loss_records,
    manifest,
    output,
    reports,
    start,
    usr1_forwarded,
    usr1_to_paused_worker,
    wait_for,
    wait_report,
)
from shared.checkpoint.file_format import checkpoint_name, is_temporary_name
from shared.checkpoint.manifest import read_manifest
from shared.checkpoint.read import load_checkpoint
from worker.signals import USR1_BURST_S

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

SIG = ["--max-steps", "400", "--checkpoint-every", "10"]
# for a run the test stops with a signal: long enough that the end of training never comes
# first, however fast the machine (400 steps of andrea-test take about 3 s unloaded)
LONG = ["--max-steps", "100000", "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return create_template(tmp_path_factory.mktemp("tpl") / "run", *SIG)


def _checkpoint_reports(run_dir):
    return [(r["step"], r["reason"]) for r in reports(run_dir) if r.get("type") == "checkpoint"]


def _assert_all_checkpoints_valid(run_dir):
    entries = read_manifest(run_dir)
    for s in checkpoint_steps(run_dir):
        load_checkpoint(run_dir / checkpoint_name(s), 42_880,
                        entries[s].checksum if s in entries else None)
    assert not [n for n in os.listdir(run_dir) if is_temporary_name(n)], "a temporary was left"


def _after_the_burst(run_dir):
    """Wait (the worker is held in a pause meanwhile) until the proxy has forwarded every
    SIGUSR1 of the last burst and USR1_BURST_S has passed since: a SIGUSR1 that close to the
    previous one joins its request by design (worker/signals.py), and under load the proxy may
    forward the last copies of a burst while the worker already runs the next steps."""
    seen, since = usr1_forwarded(run_dir), time.monotonic()
    while time.monotonic() - since < 2 * USR1_BURST_S + 1.0:
        time.sleep(0.1)
        if usr1_forwarded(run_dir) != seen:
            seen, since = usr1_forwarded(run_dir), time.monotonic()


def _stop(proc, timeout=120):
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)


def test_three_quick_sigusr1_plus_a_copy_to_the_worker_group_give_one_checkpoint_and_one_on_a_cadence_step_writes_once(  # noqa: E501
        template, tmp_path):
    b = clone(template, tmp_path / "run")
    # each pause ends once the proxy has forwarded the SIGUSR1 (usr1_to_paused_worker)
    proc = start(b, *LONG, env={"ANDREA_TEST_PAUSE_AT_STEP": "4:600,10:600"})
    with cleaned_up(proc, b):
        wait_report(b, lambda r: r.get("event") == "test-pause" and r["step"] == 4, 180, "pause 4")
        wpid = hello_pid(b)
        os.killpg(wpid, signal.SIGUSR1)  # a scheduler signalling the worker's group too
        usr1_to_paused_worker(proc, b, 4, n=3)
        wait_report(b, lambda r: r.get("event") == "test-pause" and r["step"] == 10, 60, "pause 10")
        _after_the_burst(b)  # else step 10's signal joins step 4's request (the product's rule)
        usr1_to_paused_worker(proc, b, 10)  # during cadence step 10
        wait_for(lambda: last_step(b) >= 16, 120, what="step 16")
        assert _stop(proc) == 0
    ck = _checkpoint_reports(b)
    assert [s for s, r in ck if r == "sigusr1"] == [4, 10], ck
    assert [s for s, _ in ck].count(10) == 1, "a SIGUSR1 on a cadence step writes once"
    assert not [s for s, _ in ck if 4 < s < 10], "the burst of SIGUSR1 gave more than one checkpoint"
    m = {s: (r, p) for s, r, p in manifest(b)}
    assert m[4] == ("sigusr1", True) and m[10] == ("sigusr1", True)
    _assert_all_checkpoints_valid(b)


def test_usr1_at_boundary_checkpoints_once_at_the_next_cadence_step(template, tmp_path):
    b = clone(template, tmp_path / "run")
    proc = start(b, *LONG, "--usr1-at", "boundary", env={"ANDREA_TEST_PAUSE_AT_STEP": "4:600"})
    with cleaned_up(proc, b):
        wait_report(b, lambda r: r.get("event") == "test-pause", 180, "pause 4")
        usr1_to_paused_worker(proc, b, 4)
        wait_for(lambda: last_step(b) >= 13, 120, what="step 13")
        assert _stop(proc) == 0
    ck = _checkpoint_reports(b)
    assert (10, "sigusr1") in ck and not [s for s, _ in ck if s < 10], ck
    assert [s for s, _ in ck].count(10) == 1


def test_sigusr1_then_sigterm_during_writes_neither_tear_nor_double_and_exit_0_once(template, tmp_path):
    """SIGUSR1 while the cadence write of step 10 is in flight, then two SIGTERM while the
    SIGUSR1 write of step 11 is: one checkpoint per step, none torn, one "stopped", exit 0.
    Every write is held until the test releases it (ANDREA_TEST_WRITE_DELAY=hold) and the
    signals are sent while updates 11 and 12 pause, so each lands during a write at a known
    step however loaded the machine."""
    b = clone(template, tmp_path / "run")
    env = {"ANDREA_TEST_WRITE_DELAY": "hold", "ANDREA_TEST_PAUSE_AT_STEP": "11:hold,12:600"}
    proc = start(b, *LONG, env=env)

    def landed(step=None) -> list[dict]:
        return [r for r in reports(b) if r.get("type") == "checkpoint"
                and (step is None or r["step"] == step)]

    def started(reason) -> dict:
        return wait_report(b, lambda r: r.get("type") == "checkpoint_started"
                           and r["reason"] == reason, 120, f"the {reason} write to start")

    with cleaned_up(proc, b):
        wait_report(b, lambda r: r.get("event") == "test-pause" and r["step"] == 11, 180,
                    "the pause in step 11, step 10's write held")
        assert started("cadence")["step"] == 10 and not landed()
        usr1_to_paused_worker(proc, b, 11)  # during the write of step 10
        assert started("sigusr1")["step"] == 11 and not landed(), "step 10's write is held"
        (b / ".test-release-write-10").touch()
        wait_report(b, lambda r: r.get("event") == "test-pause" and r["step"] == 12, 120,
                    "the pause in step 12")
        assert [r["step"] for r in landed()] == [10], "step 11's write is held"
        proc.send_signal(signal.SIGTERM)  # during the SIGUSR1 write (it ends the pause)
        proc.send_signal(signal.SIGTERM)  # a second one changes nothing
        assert started("sigterm")["step"] == 12 and not landed(11)
        t0 = time.monotonic()
        (b / ".test-release-writes").touch()
        assert proc.wait(timeout=120) == 0
        took = time.monotonic() - t0
    ck = _checkpoint_reports(b)
    assert ck == [(10, "cadence"), (11, "sigusr1"), (12, "sigterm")], ck
    stopped = [r for r in reports(b) if r.get("event") == "stopped"]
    assert len(stopped) == 1 and stopped[0]["exit_code"] == 0 and stopped[0]["step"] == 12
    assert loss_records(b)[-1]["step"] == 12
    _assert_all_checkpoints_valid(b)
    # the two held writes, then the exit (a figure for the report, not a timing claim)
    print(f"SIGTERM during a write -> exit {took:.2f} s after the writes were let go")


def test_sigusr1_during_startup_of_proxy_and_worker_is_honoured_after_the_first_step(tmp_path):
    b = tmp_path / "run"  # created by this proxy: a long start-up (arm tokenization)
    proc = start(b, *LONG)
    with cleaned_up(proc, b):
        def handler_installed():  # SigCgt bit 10 = SIGUSR1 has a handler (EarlySignals)
            try:
                for line in open(f"/proc/{proc.pid}/status"):
                    if line.startswith("SigCgt:"):
                        return int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1
            except FileNotFoundError:
                return False
        wait_for(handler_installed, 60, interval=0.002, what="the proxy's early handlers")
        proc.send_signal(signal.SIGUSR1)  # during run creation, before any worker exists
        child = wait_for(lambda: psutil.Process(proc.pid).children(), 180, interval=0.002,
                         what="the worker process")[0]
        blocked = open(f"/proc/{child.pid}/status").read()
        os.kill(child.pid, signal.SIGUSR1)  # during the worker's interpreter start-up
        print("worker status when signalled:", [ln for ln in blocked.splitlines() if ln.startswith("SigBlk")])
        wait_for(lambda: [s for s, r, _ in manifest(b) if r == "sigusr1"], 180, what="the SIGUSR1 checkpoint")
        wait_for(lambda: last_step(b) >= 5, 60, what="training to go on")
        assert psutil.pid_exists(child.pid) and child.status() != psutil.STATUS_ZOMBIE
        assert _stop(proc) == 0
    usr1 = [s for s, r, _ in manifest(b) if r == "sigusr1"]
    assert usr1 and usr1[0] <= 2, f"honoured after the first step: {usr1}"
    assert len(usr1) == 1, "the two early SIGUSR1 are one request"
    assert "restart" not in output(b), "a signal during start-up must never kill the worker"


def test_a_library_replacing_the_sigusr1_handler_is_reported_and_it_still_checkpoints(template, tmp_path):
    b = clone(template, tmp_path / "run")
    proc = start(b, *LONG, env={"ANDREA_TEST_STEAL_SIGNAL": "SIGUSR1"})
    with cleaned_up(proc, b):
        ev = wait_report(b, lambda r: r.get("event") == "signal-handlers-replaced", 180,
                         "the handler check's report")
        assert ev["signals"] == ["SIGUSR1"]
        wait_for(lambda: last_step(b) >= 2, 60, what="training")
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: [s for s, r, _ in manifest(b) if r == "sigusr1"], 60, what="the SIGUSR1 checkpoint")
        assert _stop(proc) == 0
    assert "SIGNAL HANDLERS REPLACED" in output(b)
