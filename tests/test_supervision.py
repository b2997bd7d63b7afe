"""The process tree (docs/signals.md, docs/architecture.md#bad-input-and-faults): proxy death,
worker crash and hang, one proxy per run directory, PID 1 / orphan reaping, NaN storms, and
`status` live and after a stop.
Real processes and real signals; the worker's fault hooks (worker/fault_injection.py) make the
faults exact."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from proc_helpers import (
    ROOT,
    _env,
    checkpoint_steps,
    cleaned_up,
    clone,
    cmd,
    create_template,
    hello_pid,
    kill_run,
    last_step,
    loss_records,
    manifest,
    proxy_log,
    reports,
    run,
    run_processes,
    start,
    wait_for,
    wait_report,
)
from shared.checkpoint.file_format import checkpoint_name
from shared.checkpoint.read import load_checkpoint
from shared.processes import process_state

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

SUP = ["--max-steps", "400", "--checkpoint-every", "10"]
# for a run the test itself stops (signal, kill): long enough that the end of training never
# comes first, however fast the machine (400 steps of andrea-test take about 3 s unloaded)
LONG = ["--max-steps", "100000", "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return create_template(tmp_path_factory.mktemp("tpl") / "run", *SUP)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def status_json(run_dir) -> dict:
    r = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run_dir), "--json"],
                       cwd=ROOT, env=_env(None), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_proxy_sigkill_worker_checkpoints_and_exits_nothing_remains_and_the_next_run_starts_cleanly(template, tmp_path):
    b = clone(template, tmp_path / "run")
    proc = start(b, *LONG)
    try:
        wpid = hello_pid(b, 180)
        wait_for(lambda: last_step(b) >= 5, 120, what="training")
        # one proxy per run directory: a second is refused, naming host and pid
        second = run(b, *SUP, timeout=120)
        assert second.returncode != 0
        assert f"proxy pid {proc.pid} on host {os.uname().nodename}" in second.stderr
        # no lock descriptor leaks into the worker
        fds = [os.readlink(f"/proc/{wpid}/fd/{fd}") for fd in os.listdir(f"/proc/{wpid}/fd")]
        assert not [f for f in fds if f.endswith(".proxy.lock")], fds
        live = status_json(b)
        assert live["proxy_alive"] and live["worker_pid"] == wpid and live["step"] >= 5
        assert live["health"] in ("running", "starting (worker up, no step yet)") and live["arms"]
        t_kill = time.time()
        proc.kill()
        proc.wait(30)
        wait_for(lambda: gone(wpid), 60, what="the orphaned worker to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = [r for r in reports(b) if r.get("event") == "stopped"]
    assert stopped and stopped[-1]["why"] in ("SIGTERM", "parent-died"), stopped
    noticed = stopped[-1]["time"] - t_kill
    print(f"worker stopped {noticed:.2f} s after the proxy's SIGKILL")
    assert noticed < 30  # docs/signals.md#parent-death: within a few seconds (PDEATHSIG: at the end of the step)
    s = stopped[-1]["step"]
    assert max(checkpoint_steps(b)) == s, "the worker checkpoints on its own"
    wait_for(lambda: not run_processes(b), 120, what="no process of the run to remain")
    after = status_json(b)
    assert not after["proxy_alive"] and after["worker_pid"] is None and after["health"].startswith("stopped")
    assert after["proxy_ended_cleanly"] is False and "stopped uncleanly" in after["health"]
    assert "nothing is lost" in after["health"], after["health"]  # the worker checkpointed
    assert after["last_checkpoint"]["step"] == s
    # the next run starts cleanly (the dead proxy's lock does not block) and loses no record
    r = run(b, "--max-steps", str(s + 5), "--checkpoint-every", "10", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in loss_records(b)] == list(range(1, s + 6))


def pauses(*steps: int) -> dict:
    """The env that pauses the run inside each of `steps` (once per run directory) for longer
    than any test waits: a kill then lands at a known step, whatever the machine's load."""
    return {"ANDREA_TEST_PAUSE_AT_STEP": ",".join(f"{s}:600" for s in steps)}


def kill_at_pause(b, step: int, what: str) -> int:
    """SIGKILL the current worker while it pauses inside `step` (see `pauses`); its pid."""
    wait_report(b, lambda r: r.get("event") == "test-pause" and r["step"] == step, 180, what)
    pid = hello_pid(b, 60)
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_the_first_worker_in_step_13(b) -> tuple[int, int]:
    """SIGKILL the run's first worker inside step 13 (the run must pause there: `pauses(13)`),
    once step_000010.bin is on disk (its write runs in the background and can still be in
    flight in step 13 on a loaded machine), so the restart resumes from it; (its pid, the
    restarted one's)."""
    wait_for(lambda: 10 in [s for s, *_ in manifest(b)], 180, what="step_000010.bin on disk")
    first = kill_at_pause(b, 13, "the first worker's pause in step 13")
    second = wait_for(lambda: (p := hello_pid(b, 120)) != first and p, 120, what="a restarted worker")
    return first, second


def test_worker_crash_restarts_from_the_newest_checkpoint_then_gives_up_after_max_restarts(template, tmp_path):
    b = clone(template, tmp_path / "run")
    # the second worker pauses inside step 15, before it can write step_000020.bin (which would
    # start the restart count again): the kill there must use the count up
    proc = start(b, *LONG, "--max-restarts", "1", env=pauses(13, 15))
    with cleaned_up(proc, b):
        first, second = kill_the_first_worker_in_step_13(b)
        assert kill_at_pause(b, 15, "the second worker's pause in step 15") == second
        rc = proc.wait(timeout=120)
    assert rc != 0
    log = proxy_log(b)
    assert "restart 1 of 1" in log and "resume from step_" in log
    assert "restarts are used up" in log
    recs = loss_records(b)
    assert [x["step"] for x in recs] == list(range(1, len(recs) + 1))


def test_a_stopped_worker_is_named_stopped_and_restarted(template, tmp_path):
    """SIGSTOP: no report for --hang-timeout; the proxy names the process and its state, sends
    SIGTERM + SIGCONT to the worker's group, the worker checkpoints, and is restarted."""
    b = clone(template, tmp_path / "run")
    proc = start(b, *LONG, "--hang-timeout", "15", "--stop-timeout", "60")
    with cleaned_up(proc, b):
        wpid = hello_pid(b, 180)
        wait_for(lambda: last_step(b) >= 4, 120, what="training")
        os.kill(wpid, signal.SIGSTOP)
        wait_for(lambda: (p := hello_pid(b, 120)) != wpid and p, 180, what="a restarted worker")
        wait_for(lambda: status_json(b)["worker_pid"] not in (None, wpid), 60,
                 what="status to show the new worker")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    log = proxy_log(b)
    assert f"pid {wpid} (" in log and "stopped (SIGSTOP?)" in log, log[-3000:]
    assert "restart 1 of 3" in log
    recs = loss_records(b)
    assert [x["step"] for x in recs] == list(range(1, len(recs) + 1))


def test_a_stop_reaches_a_worker_paused_by_sigstop_which_checkpoints_and_the_proxy_exits_0(template, tmp_path):
    """SIGTERM to the proxy while its worker is paused (SIGSTOP): the proxy continues it with
    the SIGTERM, so it writes its checkpoint and both exit 0 (no wait for --stop-timeout, no
    SIGKILL, no steps lost)."""
    b = clone(template, tmp_path / "run")
    proc = start(b, *LONG, "--hang-timeout", "600", "--stop-timeout", "60")
    with cleaned_up(proc, b):
        wpid = hello_pid(b, 180)
        wait_for(lambda: last_step(b) >= 14, 120, what="training")
        os.kill(wpid, signal.SIGSTOP)
        wait_for(lambda: process_state(wpid) == "T", 60, what="the worker to be stopped")
        paused_at = last_step(b)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proxy_log(b)[-3000:]
    log = proxy_log(b)
    assert "did not exit" not in log and "SIGKILL" not in log, log[-3000:]
    final = max(checkpoint_steps(b))
    assert final >= paused_at and final == last_step(b), (final, paused_at, last_step(b))
    assert not psutil.pid_exists(wpid) or gone(wpid)


def test_a_hung_worker_that_ignores_sigterm_is_killed_after_stop_timeout_and_restarted(template, tmp_path):
    b = clone(template, tmp_path / "run")
    r = run(b, "--max-steps", "16", "--checkpoint-every", "10", "--hang-timeout", "20",
            "--stop-timeout", "4", env={"ANDREA_TEST_HANG_AT_STEP": "13"}, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    log = proxy_log(b)
    hung = int((b / ".test-hang-done").read_text())
    assert "sent no report" in log and "did not exit" in log and f"pid {hung} (" in log
    assert "restart 1 of 3" in log and "resume from step_000010.bin" in log
    assert [x["step"] for x in loss_records(b)] == list(range(1, 17))
    assert gone(hung)


def test_orphans_of_the_worker_are_reaped_by_the_proxy_subreaper(template, tmp_path):
    b = clone(template, tmp_path / "run")
    pidfile = tmp_path / "orphan.pid"
    proc = start(b, *LONG, env={"ANDREA_TEST_ORPHAN_FILE": str(pidfile)})
    with cleaned_up(proc, b):
        orphan = int(wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 180,
                              what="the orphan"))
        # the pid file appears (mv) before its shell exits: until then the shell is the parent
        def parent(pid: int) -> int | None:
            try:
                return psutil.Process(pid).ppid()
            except psutil.NoSuchProcess:
                return None
        wait_for(lambda: parent(orphan) == proc.pid, 60,
                 what="the orphan to be re-parented to the proxy (subreaper)")
        # sleep 2 exits; without reaping it would stay a zombie child of the proxy
        wait_for(lambda: not psutil.pid_exists(orphan), 60, what="the orphan to be reaped")
        wait_for(lambda: last_step(b) >= 3, 60, what="training")
        assert proc.poll() is None
        wpid = hello_pid(b, 60)  # the live worker: its status belongs to the proxy's Popen
        zombies = [c for c in psutil.Process(proc.pid).children()
                   if c.pid != wpid and c.status() == psutil.STATUS_ZOMBIE]
        assert not zombies, zombies
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare --pid (a PID namespace)")
def test_proxy_as_pid_1_reaps_orphans_and_stops_cleanly_on_sigterm(template, tmp_path):
    b = clone(template, tmp_path / "run")
    pidfile = tmp_path / "orphan.pid"
    log = open(tmp_path / "pid1.out", "wb")
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *cmd(b, *LONG)], cwd=ROOT,
                             env=_env({"ANDREA_TEST_ORPHAN_FILE": str(pidfile)}), stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        init = wait_for(lambda: psutil.Process(outer.pid).children(), 60, what="the namespace's PID 1")[0]
        ns = [ln for ln in open(f"/proc/{init.pid}/status") if ln.startswith("NSpid:")][0].split()
        assert ns[-1] == "1", f"the proxy must be PID 1 in its namespace: {ns}"
        wait_for(lambda: pidfile.exists(), 180, what="the orphan")
        wait_for(lambda: last_step(b) >= 3, 120, what="training")
        # the orphan (`sleep 2`) exits within seconds and must be reaped by PID 1, not stay a
        # zombie: wait until no `sleep` is left among its children (a zombie keeps its name)
        def orphan_gone() -> bool:
            try:
                return all(c.name() != "sleep" for c in init.children())
            except psutil.NoSuchProcess:  # a child went while we looked: look again
                return False
        wait_for(orphan_gone, 60, what="PID 1 to reap the orphan")
        zombies = [c for c in init.children() if c.status() == psutil.STATUS_ZOMBIE]
        assert not zombies, zombies
        init.send_signal(signal.SIGTERM)  # PID 1 ignores signals it has no handler for
        assert outer.wait(timeout=120) == 0
    finally:
        if outer.poll() is None:
            outer.kill()
        kill_run(b)
    # the stop's checkpoint is the newest, at the history's last step: `sigterm`, or `cadence` when
    # the signal came after a cadence step's boundary and before the next update (that step's
    # checkpoint is already on disk, so no second file is written: worker/trainer.py `checkpoint`)
    step, why, _ = manifest(b)[-1]
    assert step == last_step(b) and (why == "sigterm" or (why == "cadence" and step % 10 == 0)), \
        (manifest(b), last_step(b))


def test_nan_loss_is_skipped_and_recorded_and_a_run_of_them_stops_with_the_last_good_state(template, tmp_path):
    b = clone(template, tmp_path / "run")
    r = run(b, *SUP, env={"ANDREA_TEST_NAN_AT_STEP": "3,11-15"}, timeout=300)
    # the proxy exits 3 like its worker (docs/architecture.md#exit-codes), so systemd's
    # RestartPreventExitStatus=2 3 does not restart a run that cannot go on (it exited 1)
    assert r.returncode == 3, (r.returncode, "a NaN storm is fatal")
    assert "not restarting" in r.stderr and "restart 1" not in r.stderr
    assert "(non-finite loss)" in r.stderr, "the exit names the reason"
    recs = loss_records(b)
    assert [x["step"] for x in recs] == list(range(1, 16))
    assert "skipped" in recs[2] and recs[2]["loss"] is None
    assert [x["step"] for x in recs if x.get("skipped")] == [3, 11, 12, 13, 14, 15]
    m = {s: (reason, pinned) for s, reason, pinned in manifest(b)}
    assert m[15] == ("alarm", True)
    _, w10, m10, v10 = load_checkpoint(b / checkpoint_name(10), 42_880)
    s, w15, m15, v15 = load_checkpoint(b / checkpoint_name(15), 42_880)
    assert s == 15
    assert np.array_equal(w10, w15) and np.array_equal(m10, m15) and np.array_equal(v10, v15), \
        "the alarm checkpoint holds the last good state"
    assert np.isfinite(w15).all()


@pytest.mark.slow
def test_a_new_proxy_waits_for_the_worker_a_killed_proxy_left_before_resuming(tmp_path):
    """kill -9 of the proxy leaves its worker writing its last checkpoint (slowed to 3 s here);
    the same `run` started meanwhile must wait for that worker, then resume from the checkpoint
    it wrote, with the history continuous (docs/signals.md#kill--9), never from the older
    checkpoint while the old worker is still writing. The old worker is held (SIGSTOP) from
    before the kill until the new proxy has seen it, so the new proxy's start-up, however slow
    the machine, cannot outlast the old worker's exit."""
    from proc_helpers import hello_pid, loss_records, start, wait_for
    run_dir = tmp_path / "run"
    args = ["--max-steps", "40", "--checkpoint-every", "10", "--probe-every", "5"]
    slow = {"ANDREA_TEST_WRITE_DELAY": "3"}
    a = start(run_dir, *args, env=slow)
    b = None
    try:
        old = hello_pid(run_dir)
        wait_for(lambda: len(loss_records(run_dir)) >= 13, timeout=120, what="step 13 filed")
        os.kill(old, signal.SIGSTOP)
        wait_for(lambda: process_state(old) == "T", 60, what="the old worker to be held")
        a.kill()
        a.wait()
        log = tmp_path / "second.out"
        with open(log, "wb") as out:
            b = subprocess.Popen(cmd(run_dir, *args), cwd=ROOT, env=_env(slow), stdout=out,
                                 stderr=subprocess.STDOUT)
        wait_for(lambda: f"worker pid(s) [{old}] of an earlier proxy" in log.read_text(), 180,
                 what="the new proxy to find the old worker")
        os.kill(old, signal.SIGCONT)  # it now notices its proxy's death, checkpoints and exits
        assert b.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
        kill_run(run_dir)
    text = log.read_text()
    m = re.search(r"resume from step_(\d+)\.bin", text)
    assert m and int(m.group(1)) >= 13, text[-3000:]   # the old worker's last checkpoint
    assert [x["step"] for x in loss_records(run_dir)] == list(range(1, 41))


def test_a_sigterm_that_reaches_a_worker_after_it_stopped_is_not_called_a_loss(tmp_path, caplog):
    """A SIGTERM landing while the worker exits after its final checkpoint (Python restores
    default handlers at interpreter exit: code -15) is not logged as "ended by SIGTERM without
    its handler; steps ... trained again": the worker's "stopped" event says the checkpoint was
    written, and that event counts for its own worker only, not for the next."""
    import logging
    import signal as sig

    from proc_helpers import create_template
    from proxy.supervision.run_options import ProxyOptions
    from proxy.supervision.supervisor import Supervisor
    from shared.run.config import load_run_config
    from shared.run.layout import RunLayout
    from shared.run.loss_history import LossHistory
    layout = RunLayout(create_template(tmp_path / "run"))
    sup = Supervisor(layout, load_run_config(layout.run_json), ProxyOptions())
    history = LossHistory(layout.loss)
    sup.stop_requested = "SIGTERM"
    sup.stats.worker = {"pid": 1}
    sup.stats.exit_code, sup.stats.stop_why = 0, "max steps"
    with caplog.at_level(logging.INFO, logger="proxy"):
        assert sup._outcome(-sig.SIGTERM, False, True, history) == ("done", 0)
    assert "already stopped (max steps)" in caplog.text and "without its handler" not in caplog.text
    sup.stats.new_worker()                 # the next worker has said nothing yet
    sup.stats.worker = {"pid": 2}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="proxy"):
        assert sup._outcome(-sig.SIGTERM, False, True, history) == ("done", 0)
    assert "without its handler" in caplog.text


def test_a_worker_that_wrote_a_new_checkpoint_before_it_crashed_starts_the_restart_count_again(template, tmp_path):
    """--max-restarts counts failures in a row without progress: a crash after a new
    checkpoint starts the count again, so a run of weeks is not given up after N crashes
    however far apart (here: two crashes, each after a new checkpoint, within
    --max-restarts 1)."""
    b = clone(template, tmp_path / "run")
    # pauses: the first worker in step 13 (resume from 10), the second in 25 (after it wrote
    # step_000020.bin), the third in 27 (before it can write step_000030.bin)
    proc = start(b, *LONG, "--max-restarts", "1", env=pauses(13, 25, 27))
    with cleaned_up(proc, b):
        first, second = kill_the_first_worker_in_step_13(b)
        # the proxy has filed a checkpoint newer than the one the second worker resumed from
        wait_for(lambda: "(step 20," in proxy_log(b), 120, what="a new checkpoint filed")
        assert kill_at_pause(b, 25, "the second worker's pause in step 25") == second
        third = wait_for(lambda: (p := hello_pid(b, 120)) not in (first, second) and p, 120,
                         what="a second restart (the count started again)")
        # no new checkpoint since its start: the count is used up
        assert kill_at_pause(b, 27, "the third worker's pause in step 27") == third
        rc = proc.wait(timeout=120)
    assert rc != 0
    log = proxy_log(b)
    assert log.count("restart 1 of 1") == 2 and "restart count starts again" in log, log[-3000:]
    assert "restarts are used up" in log
    recs = loss_records(b)
    assert [x["step"] for x in recs] == list(range(1, len(recs) + 1))


def test_a_worker_killed_while_its_first_checkpoint_is_still_being_written_starts_again_from_step_0(
        template, tmp_path):
    """The first cadence write (step 10) runs in the background; a worker SIGKILLed in step 13
    before it landed leaves 12 records and no checkpoint; the proxy starts it again from step 0
    rather than refuse ("no valid checkpoint exists ... --from-scratch") because the history
    went past step 10."""
    b = clone(template, tmp_path / "run")
    env = {**pauses(13), "ANDREA_TEST_WRITE_DELAY": "600"}  # no write lands while it runs
    proc = start(b, *LONG, env=env)
    with cleaned_up(proc, b):
        wait_report(b, lambda r: r.get("type") == "checkpoint_started" and r["step"] == 10, 180,
                    "the first cadence write to start")
        first = kill_at_pause(b, 13, "the first worker's pause in step 13")
        assert not manifest(b) and not checkpoint_steps(b)
        wait_for(lambda: (p := hello_pid(b, 120)) != first and p, 180, what="a restarted worker")
        assert wait_report(b, lambda r: r.get("type") == "hello", 10)["resumed_from"] == 0
        assert proc.poll() is None
    log = proxy_log(b)
    assert "no checkpoint was ever written (the history ends at step 12" in log, log[-3000:]
    assert "restart 1 of 3" in log and "no valid checkpoint exists" not in log
    rewound = json.loads((b / ".loss.rewound.json").read_text())
    assert {x["step"] for x in rewound} >= {1, 12}, "the 12 records were kept aside"


def test_a_run_killed_before_its_first_checkpoint_starts_again_from_step_0_in_the_proxy_and_on_the_next_start(
        template, tmp_path):
    """A worker SIGKILLed before the first cadence checkpoint leaves records but no checkpoint;
    the proxy and the next start both start again from step 0 rather than refuse ("no valid
    checkpoint exists ... --from-scratch"), so under systemd the run starts without a hand."""
    b = create_template(tmp_path / "run", "--max-steps", "400", "--checkpoint-every", "1000")
    proc = start(b, "--max-steps", "400", env={"ANDREA_TEST_PAUSE_AT_STEP": "6:60,9:60"})
    with cleaned_up(proc, b):
        first = hello_pid(b, 180)
        wait_report(b, lambda r: r.get("event") == "test-pause", 180, "the pause in step 6")
        wait_for(lambda: last_step(b) >= 5, 60, what="step 5 filed")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: (p := hello_pid(b, 120)) != first and p, 120, what="a restarted worker")
        wait_report(b, lambda r: r.get("event") == "test-pause" and r["step"] == 9, 180,
                    "the restarted worker's pause in step 9")
        wait_for(lambda: last_step(b) >= 8, 60, what="step 8 filed")
        assert proc.poll() is None
        # now the proxy and the worker together, still before any checkpoint
        wpid = hello_pid(b, 10)
        proc.send_signal(signal.SIGSTOP)  # so it cannot restart the worker in between
        os.kill(wpid, signal.SIGKILL)
        proc.kill()
        proc.wait(30)
        wait_for(lambda: not run_processes(b), 60, what="no process of the run to remain")
    assert not checkpoint_steps(b)
    log = proxy_log(b)
    assert "no checkpoint was ever written" in log and "restart 1 of 3" in log, log[-3000:]
    r = run(b, "--max-steps", "12", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("no checkpoint was ever written") == 1
    assert [x["step"] for x in loss_records(b)] == list(range(1, 13))
    rewound = json.loads((b / ".loss.rewound.json").read_text())
    assert {x["step"] for x in rewound} >= {1, 5, 8}, "the records of both stops were kept aside"
    assert checkpoint_steps(b) == [12]


def test_the_spawned_worker_finds_the_packages_from_any_directory_without_an_install(tmp_path, monkeypatch):
    """spawn puts the repository on PYTHONPATH, so a child started in another directory by an
    interpreter that sees no installed package (-S) imports the worker from this tree."""
    from proxy.supervision.launch import spawn
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    code = "import pathlib, worker; pathlib.Path('where').write_text(worker.__file__)"
    child = spawn([sys.executable, "-S", "-c", code], torchrun=False, multi_node=False)
    assert child.wait(timeout=60) == 0
    assert (tmp_path / "where").read_text() == str(ROOT / "worker" / "__init__.py")
