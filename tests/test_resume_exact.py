"""Exact resume under every kind of stop (docs/signals.md): the final checkpoint is
byte-identical to an uninterrupted run's and `.loss.json` holds the same values at every step.
Real proxy and worker processes, real signals, real files."""
import json
import os
import signal

import pytest

from proc_helpers import (
    EXACT,
    assert_same_run,
    checkpoint_steps,
    clone,
    compare_keys,
    create_template,
    drop_manifest_entries,
    hello_pid,
    kill_run,
    last_step,
    loss_records,
    manifest,
    proxy_log,
    run,
    run_processes,
    start,
    stopped_step,
    usr1_to_paused_worker,
    wait_for,
    wait_report,
)
from shared.checkpoint.file_format import checkpoint_name
from shared.checkpoint.read import load_checkpoint, read_header

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

WARMUP, FINAL = 20, 60


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return create_template(tmp_path_factory.mktemp("tpl") / "run", *EXACT)


@pytest.fixture(scope="module")
def reference(template, tmp_path_factory):
    """The uninterrupted run (60 steps)."""
    ref = clone(template, tmp_path_factory.mktemp("ref") / "run")
    r = run(ref, *EXACT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len({json.dumps(x["p"], sort_keys=True) for x in loss_records(ref)}) > 1, \
        "the bandit never moved: the test would not cover the mixture"
    return ref


def _stop_with_sigterm_after(run_dir, step, *args, env=None):
    """SIGTERM while the worker pauses inside update step+1 (test hook), so the stop lands
    there however fast the machine is (a fast one ran 20 steps past a step it was polled at);
    the pause lasts until the SIGTERM arrives, however slowly a loaded machine delivers it."""
    env = dict(env or {}, ANDREA_TEST_PAUSE_AT_STEP=f"{step + 1}:600")
    proc = start(run_dir, *args, env=env)
    try:
        wait_report(run_dir, lambda r: r.get("event") == "test-pause" and r.get("step") == step + 1,
                    180, f"the pause in step {step + 1}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return stopped_step(run_dir)


def test_three_successive_sigterm_resumes_inside_and_after_warmup_are_bit_exact(template, reference, tmp_path):
    b = clone(template, tmp_path / "run")
    stops = []
    for at in (4, 26, 40):  # 1st inside the learning-rate warm-up, then after it, twice
        s = _stop_with_sigterm_after(b, at, *EXACT)
        assert checkpoint_name(s) in os.listdir(b), "SIGTERM must leave a checkpoint of the stop step"
        reason = {st: r for st, r, _ in manifest(b)}[s]
        assert reason == "sigterm" or (reason == "cadence" and s % 10 == 0), (s, reason)
        stops.append(s)
    assert stops[0] < WARMUP <= stops[1] < stops[2] < FINAL, \
        f"stops {stops}: the first must fall inside the warm-up, the others after it"
    r = run(b, *EXACT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(reference, b, FINAL)
    # the learning rate of every step equals the uninterrupted run's (already in compare_keys);
    # and the resumed worker announced the step it loaded, each time
    assert proxy_log(b).count("resume from step_") == 3


def test_sigusr1_checkpoint_then_kill9_of_the_worker_restarts_from_it_bit_exact(template, reference, tmp_path):
    b = clone(template, tmp_path / "run")
    # SIGUSR1 arrives while the worker pauses inside update 12 (after the step-10 cadence
    # checkpoint), so its checkpoint is step 12 however fast the machine is; the worker pauses
    # again inside update 18, so the kill lands at a known place a few steps later
    # (the pause in update 12 ends once the proxy has forwarded the SIGUSR1)
    proc = start(b, *EXACT, env={"ANDREA_TEST_PAUSE_AT_STEP": "12:600,18:60"})
    try:
        wait_report(b, lambda r: r.get("event") == "test-pause" and r.get("step") == 12, 180,
                    "the pause in step 12")
        usr1_to_paused_worker(proc, b, 12)
        usr1 = wait_for(lambda: [st for st, r, _ in manifest(b) if r == "sigusr1"],
                        60, what="the SIGUSR1 checkpoint")[0]
        assert usr1 == 12
        wait_report(b, lambda r: r.get("event") == "test-pause" and r.get("step") == 18, 120,
                    "the pause in step 18")
        wpid = hello_pid(b)
        os.kill(wpid, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, "the proxy restarts the worker and finishes the run"
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(b)
    log = proxy_log(b)
    assert "restart 1 of 3" in log
    assert f"resume from {checkpoint_name(usr1)}" in log, "the restart resumes from the newest valid checkpoint"
    assert_same_run(reference, b, FINAL)
    assert (b / ".loss.rewound.json").exists(), "records past the checkpoint are moved aside, never dropped"


def test_kill9_of_proxy_and_worker_then_a_new_run_resumes_bit_exact(template, reference, tmp_path):
    b = clone(template, tmp_path / "run")
    proc = start(b, *EXACT, env={"ANDREA_TEST_PAUSE_AT_STEP": "23:60"})
    try:
        wait_report(b, lambda r: r.get("event") == "test-pause", 180, "the pause in step 23")
        # step 20's write runs in the background: on a loaded machine it can still be in flight
        wait_for(lambda: 20 in [s for s, *_ in manifest(b)], 120, what="step_000020.bin on disk")
        wpid = hello_pid(b)
        os.kill(wpid, signal.SIGKILL)  # both at once: nobody checkpoints on the way out
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not run_processes(b), 120, what="the run's processes to go")
    assert max(checkpoint_steps(b)) == 20
    r = run(b, *EXACT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(reference, b, FINAL)


def test_resume_with_m_and_v_zeroed_is_detectably_different_and_untouched_is_identical(template, reference, tmp_path):
    """Positive and negative control from the same point: the reference run rolled back to its
    step-40 checkpoint resumes to the identical end; with m and v zeroed in the file it does not."""
    ref_final = (reference / checkpoint_name(FINAL)).read_bytes()
    for zero in (False, True):
        b = clone(reference, tmp_path / f"run-{zero}")
        drop_manifest_entries(b, [s for s in checkpoint_steps(b) if s > 40])
        for s in checkpoint_steps(b):
            if s > 40:
                (b / checkpoint_name(s)).unlink()
        path = b / checkpoint_name(40)
        step, n = read_header(path)
        if zero:
            data = bytearray(path.read_bytes())
            data[8 + 4 * n:] = bytes(8 * n)           # m and v regions
            path.write_bytes(bytes(data))
            drop_manifest_entries(b, [40])                   # a .bin without an entry still loads
            _, w, m, v = load_checkpoint(path, n)
            assert not m.any() and not v.any()
        r = run(b, *EXACT)
        assert r.returncode == 0, r.stderr[-3000:]
        got = (b / checkpoint_name(FINAL)).read_bytes()
        if zero:
            assert got != ref_final, "zeroed AdamW moments must change the result (negative control)"
            assert compare_keys(loss_records(b))[:40] == compare_keys(loss_records(reference))[:40]
            assert compare_keys(loss_records(b))[40:] != compare_keys(loss_records(reference))[40:]
        else:
            assert_same_run(reference, b, FINAL)


def test_resume_with_a_different_max_steps_warns_loudly_and_records_it_in_the_history(reference, tmp_path):
    b = clone(reference, tmp_path / "run")
    args = [a if a != "60" else "66" for a in EXACT]
    r = run(b, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--max-steps 66 differs from the 60 planned" in r.stderr
    recs = loss_records(b)
    assert [x["step"] for x in recs] == list(range(1, 67)), "still one record per step"
    ev = recs[60].get("events")
    assert ev and ev[0]["event"] == "max-steps-changed" and ev[0]["max_steps"] == 66 \
        and ev[0]["planned_max_steps"] == 60
    assert all("events" not in x for x in recs[:60] + recs[61:])
    # the schedule stays the planned one: past its end, the floor rate
    assert {x["lr"] for x in recs[60:]} == {recs[59]["lr"]}


def test_the_max_steps_warning_after_a_replan_names_the_plan_in_force(reference, tmp_path):
    b = clone(reference, tmp_path / "run")
    r = run(b, *[a if a != "60" else "70" for a in EXACT], "--replan")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run(b, *[a if a != "60" else "75" for a in EXACT])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--max-steps 75 differs from the 70 planned" in r.stderr
    assert "decay to step 70, flat after" in r.stderr, r.stderr[-3000:]
    ev = [e for x in loss_records(b) for e in x.get("events", ()) if e["event"] == "max-steps-changed"]
    assert [(e["planned_max_steps"], e["lr_decay_steps"]) for e in ev] == [(70, 70)]


def test_sigterm_to_the_worker_process_group_stops_like_one_to_the_proxy_and_resumes_bit_exact(
        template, reference, tmp_path):
    """Schedulers signal the job's processes, not the proxy: same result (exit 0, a sigterm
    checkpoint of the stop step, history to it, no restart), and the resume is exact."""
    b = clone(template, tmp_path / "run")
    proc = start(b, *EXACT)
    try:
        wpid = hello_pid(b, 180)
        wait_for(lambda: last_step(b) >= 33, 180, what="step 33")
        os.killpg(wpid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    s = stopped_step(b)
    assert s < FINAL and (s, "sigterm", False) in manifest(b) or s % 10 == 0
    assert [r["step"] for r in loss_records(b)] == list(range(1, s + 1))
    assert "restart" not in proxy_log(b)
    r = run(b, *EXACT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(reference, b, FINAL)
