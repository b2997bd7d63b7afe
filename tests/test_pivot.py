"""Polish pivots (docs/pivots.md): in place on a live run, in the
foreground on a stopped one, crash-safe at every moment. Real proxy and worker processes."""
import json
import os
import signal
import subprocess
import sys

import pytest

from proc_helpers import (
    ROOT,
    checkpoint_steps,
    cleaned_up,
    last_step,
    loss_records,
    run_processes,
    run_proxy,
    start,
    wait_for,
)
from proxy.mixture.rebuild import rebuild_mixture, replay_run
from proxy.run_files.phases import read_phases
from shared.checkpoint.file_format import checkpoint_name
from shared.run.config import load_run_config
from shared.run.layout import RunLayout

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

COMMON = ["--checkpoint-every", "10", "--probe-every", "5", "--bandit-warmup", "10",
          "--sample-every", "10"]
CAPS, FLOORS = "repo-code=0.2,python-docs=0.5", "repo-docstrings=0.3"


def pivot(run_dir, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("ANDREA_FAULT_PIVOT", None)
    return subprocess.run([sys.executable, "-m", "proxy", "pivot", "--run-dir", str(run_dir), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def reported_step(run_dir) -> int:
    """The newest step the worker reported in `.reports.jsonl` (0 before any)."""
    steps = [0]
    for line in (run_dir / ".reports.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:  # a line being written
            continue
        if r.get("type") == "step":
            steps.append(r["step"])
    return max(steps)


def phases(run_dir):
    return json.loads((run_dir / "phases.json").read_text())["phases"]


def in_box(p):
    return (p["repo-code"] <= 0.2 + 1e-12 and p["python-docs"] <= 0.5 + 1e-12
            and p["repo-docstrings"] >= 0.3 - 1e-12 and abs(sum(p.values()) - 1) < 1e-9)


def assert_one_consistent_state(run, final):
    """Exactly one state: every archive complete and matching a recorded phase, nothing pending
    or half-made, the history continuous with the phase switching at each pivot's B, and the
    replay of `.loss.json` equal to `.state.json`."""
    layout = RunLayout(run)
    cfg = load_run_config(layout.run_json)
    ph = read_phases(layout)
    recs = loss_records(run)
    assert [r["step"] for r in recs] == list(range(1, final + 1)), "the history has a gap or repeat"
    assert not (run / ".pivot.request.json").exists(), "a pivot is still pending"
    archives = sorted(p.name for p in (run / "archive").glob("pivot-*"))
    assert archives == [f"pivot-{p.start_step}" for p in ph[1:]], (archives, ph)
    for p in ph[1:]:
        b, a = p.start_step, run / "archive" / f"pivot-{p.start_step}"
        assert (a / ".state.json").exists() and (a / ".samples.json").exists()
        old = json.loads((a / ".state.json").read_text())
        prev = ph[p.index - 1]
        assert old == rebuild_mixture(layout, cfg, b, phase=prev, use_snapshots=False).mix \
            .bandit.to_dict(), "the archived .state.json is not the old phase's bandit at B"
        assert recs[b - 1]["phase"]["index"] == prev.index and recs[b]["phase"]["index"] == p.index
        assert json.loads((a / "pivot.request.json").read_text())["state"] == "running"
    assert replay_run(layout, cfg, final).bandit.to_dict() == \
        json.loads((run / ".state.json").read_text())
    return ph


def test_pivot_refuses_bad_bounds_a_second_request_and_a_finished_run_before_changing_anything(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "10", "--checkpoint-every", "5", "--sample-every", "5").returncode == 0
    before = (run / "phases.json").read_bytes()
    for caps, floors, words in [("nope=0.5", "", "unknown arm 'nope'"),
                                ("repo-code=0.1", "repo-code=0.2", "floor above cap"),
                                ("", "repo-code=0.6,python-docs=0.6", "sum of floors"),
                                ("repo-code=0.1,python-docs=0.1,repo-docstrings=0.1", "", "sum of caps"),
                                ("repo-code=1.5", "", "outside [0, 1]")]:
        r = pivot(run, "--caps", caps, "--floors", floors)
        assert r.returncode == 2 and words in r.stderr, (caps, floors, r.stderr)
    r = pivot(run, "--caps", "repo-code=0.5")
    assert r.returncode == 2 and "already finished at step 10" in r.stderr and "--max-steps" in r.stderr
    r = pivot(run, "--keep-bounds", "--decay", "--max-steps", "20")
    assert r.returncode == 2 and "schedule is cosine" in r.stderr and "without --decay" in r.stderr
    assert (run / "phases.json").read_bytes() == before
    assert not (run / "archive").exists() or not list((run / "archive").glob("pivot-*"))
    assert not (run / ".pivot.request.json").exists()
    # A stopped-run pivot records the phase in the foreground; a second one is refused.
    r = pivot(run, "--caps", "repo-code=0.5", "--label", "v2", "--max-steps", "20")
    assert r.returncode == 0 and "phase 1 'v2' recorded" in r.stdout, r.stderr
    # the command it prints carries the --max-steps (a new user ran the printed command without
    # it, and the run said "nothing to do")
    assert f"`python -m proxy run --run-dir {run} --max-steps 20` trains in it" in r.stdout, r.stdout
    after = (run / "phases.json").read_bytes()
    st = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                        text=True, timeout=60)
    line = next(ln for ln in st.stdout.splitlines() if ln.startswith("processes"))
    assert "no proxy since the `pivot` command" in line, line  # it named that pid as the proxy
    r = pivot(run, "--caps", "repo-code=0.4", "--label", "v3", "--max-steps", "20")
    assert r.returncode == 2 and "already pending" in r.stderr and "'v2'" in r.stderr
    assert (run / "phases.json").read_bytes() == after
    assert run_proxy(run, "--max-steps", "20", "--checkpoint-every", "5", "--sample-every", "5").returncode == 0
    assert [p["label"] for p in phases(run)] == ["initial", "v2"]
    assert_one_consistent_state(run, 20)
    # no bounds given: refused, naming the bounds in force
    r = pivot(run, "--label", "v3", "--max-steps", "25")
    assert r.returncode == 2 and "give the new phase's bounds" in r.stderr, r.stderr
    assert "the phase in force has caps repo-code=0.5, floors none" in r.stderr
    r = pivot(run, "--keep-bounds", "--no-bounds", "--max-steps", "25")
    assert r.returncode == 2 and "exclude one another" in r.stderr
    r = pivot(run, "--keep-bounds", "--label", "v3", "--max-steps", "25")
    assert r.returncode == 0, r.stderr
    assert phases(run)[-1]["label"] == "v3" and phases(run)[-1]["caps"] == {"repo-code": 0.5}


def test_live_pivot_happens_in_the_same_proxy_and_returns_once_the_new_worker_filed_a_step(tmp_path):
    run = tmp_path / "run"
    # keep every checkpoint: on a loaded machine the worker may run far past B + 20 before the
    # SIGTERM lands, and retention (keep-last 3) then removed step B + 20 (CI saw [40, 70, 80, 83])
    proc = start(run, "--max-steps", "300", *COMMON, "--keep-last", "1000")
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 25, 300, what="training to pass step 25")
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--label", "polish")
        assert r.returncode == 0, r.stdout + r.stderr
        out = r.stdout
        assert proc.poll() is None, "the proxy must not exit at a pivot"
        ph = phases(run)[1]
        b = ph["start_step"]
        assert b % 10 == 0 and b >= 30 and (ph["index"], ph["label"]) == (1, "polish")
        # "waiting for boundary step B (n steps to go)", or "boundary step B reached" when the
        # proxy got there before the command's first look: either way the step is named
        for line in (f"boundary step {b}", f"archived to archive/pivot-{b}",
                     "phase 1 'polish' recorded", f"filed step {b + 1}"):
            assert line in out, (line, out)
        assert json.loads((run / ".proxy.owner.json").read_text())["pid"] == proc.pid
        st = json.loads(subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir",
                                        str(run), "--json"], cwd=ROOT, capture_output=True,
                                       text=True).stdout)
        assert st["phase"] == {"index": 1, "label": "polish", "start_step": b,
                               "caps": {"repo-code": 0.2, "python-docs": 0.5},
                               "floors": {"repo-docstrings": 0.3}} and st["pivot_request"] is None
        wait_for(lambda: last_step(run) >= b + 20, 300, what="training after the pivot")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    final = last_step(run)
    assert_one_consistent_state(run, final)
    records = loss_records(run)
    assert all(in_box(x["p"]) for x in records[b:]), "an arm left its new box"
    assert not all(in_box(x["p"]) for x in records[:b]), "the old box already satisfied the new one"
    audits = json.loads((run / ".samples.json").read_text())["audits"]
    assert audits and all(a["step"] > b for a in audits)
    assert b + 20 in checkpoint_steps(run)

    # The same pivot on an audit fork at B (a stopped run) reaches a byte-identical checkpoint
    # at B+20: the live pivot resumed from step_B.bin's weights, m and v exactly.
    fork = tmp_path / "fork"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    f = subprocess.run([sys.executable, "-m", "proxy", "fork", "--from", f"{run}:{b}",
                        "--run-dir", str(fork)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert f.returncode == 0, f.stderr
    r = pivot(fork, "--caps", CAPS, "--floors", FLOORS, "--label", "polish")
    assert r.returncode == 0, r.stdout + r.stderr
    assert run_processes(fork) == [], "a stopped-run pivot must leave nothing running"
    assert run_proxy(fork, "--max-steps", str(b + 20)).returncode == 0
    assert (fork / checkpoint_name(b + 20)).read_bytes() == (run / checkpoint_name(b + 20)).read_bytes()


@pytest.mark.parametrize("moment", ["before-boundary", "during-checkpoint", "after-archive",
                                    "after-record"])
def test_kill_9_of_the_proxy_at_each_moment_of_a_pivot_leaves_one_consistent_state(tmp_path, moment):
    run = tmp_path / "run"
    env = {"ANDREA_FAULT_PIVOT": moment}
    if moment == "during-checkpoint":
        env["ANDREA_TEST_WRITE_DELAY"] = "1"   # the kill lands while the worker writes step_B
    # a first start long enough that it cannot finish before the pivot reaches its boundary
    # (CI: a fast machine ran 70 steps first, and the fault hook never fired); the restart ends at 70
    proc = start(run, "--max-steps", "400", *COMMON, env=env)
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 15, 300, what="training to pass step 15")
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--label", "polish", "--timeout", "200")
        assert proc.wait(120) == -signal.SIGKILL, "the fault hook did not fire"
        assert r.returncode == 1 and "exited during the pivot" in r.stderr, r.stdout + r.stderr
        wait_for(lambda: not run_processes(run), 120, what="the orphaned worker to stop")
        again = run_proxy(run, "--max-steps", "70", *COMMON, timeout=400)
        assert again.returncode == 0, again.stderr[-3000:]
    ph = assert_one_consistent_state(run, 70)
    if moment in ("after-archive", "after-record"):
        assert len(ph) == 2, "a pivot whose boundary checkpoint exists is finished on restart"


def test_pivot_names_the_boundary_even_when_the_proxy_passed_it_before_the_first_look(tmp_path, capsys):
    """The command polls the request; a quick proxy can be past the boundary (archived) before
    the first poll. The step is named anyway ("boundary step B reached") before "archived"."""
    from proxy.commands.pivot import _wait
    from proxy.run_files.pivot_request import write_request
    layout = RunLayout(tmp_path)
    write_request(layout, {"label": "polish", "caps": {}, "floors": {}, "state": "archived", "step": 40})
    assert _wait(layout, None, timeout=0.5) != 0  # nothing completes it: times out
    out = capsys.readouterr().out
    assert "pivot: boundary step 40 reached" in out and "archived to archive/pivot-40" in out, out
    assert out.index("boundary step 40") < out.index("archived to")


def test_pivot_now_says_the_boundary_is_reached_only_once_the_worker_wrote_it(tmp_path, capsys):
    """`pivot --now` posts B = the last filed step; the worker may already be past it and stop at
    its next step. Filed steps past B are no sign that B was reached: the line comes with the
    worker's boundary checkpoint (its manifest entry), never before."""
    from proxy.commands.pivot import _wait
    from proxy.run_files.pivot_request import write_request
    from shared.checkpoint import manifest as cm
    from shared.run.loss_history import LossHistory
    layout = RunLayout(tmp_path)
    with LossHistory(layout.loss) as h:
        h.append_many({"step": k, "loss": 3.0} for k in range(1, 154))
    write_request(layout, {"label": "now", "caps": {}, "floors": {}, "state": "boundary",
                           "step": 151})
    assert _wait(layout, None, timeout=0.3) != 0
    out = capsys.readouterr().out
    assert "reached" not in out and "waiting for the worker's boundary checkpoint" in out, out
    cm.record_checkpoint(tmp_path, cm.ManifestEntry(step=151, file="step_000151.bin", nbytes=8,
                                                    checksum="crc32:00000000", reason="pivot",
                                                    pinned=True, time=0.0))
    assert _wait(layout, None, timeout=0.3) != 0
    assert "boundary step 151 reached; the worker wrote step_000151.bin" in capsys.readouterr().out


def test_a_waiting_pivot_repeats_its_waiting_line_at_most_every_interval_and_when_the_boundary_moves(
        tmp_path, capsys):
    """A worker filing a step every few ms while the command waits for a far boundary: the
    "waiting for boundary" line came once per step (70 lines in 91 s, thousands with fast GPU
    steps). It is printed when the wait starts, at most once per interval after that, and at
    once when the boundary moves."""
    import threading
    import time

    from proxy.commands.pivot import WAIT_LINE_EVERY_S, _wait
    from proxy.run_files.pivot_request import write_request
    from shared.run.loss_history import LossHistory
    layout = RunLayout(tmp_path)
    req = {"label": "polish", "caps": {}, "floors": {}, "state": "boundary", "step": 10_000}
    write_request(layout, req)
    done = threading.Event()

    def file_steps(first, moved_at=None):
        with LossHistory(layout.loss) as h:
            for step in range(first, first + 200):
                h.append({"step": step, "loss": 1.0, "time": time.time()})
                if step == moved_at:  # the worker was past B: the boundary is its next one
                    write_request(layout, dict(req, step=20_000))
                time.sleep(0.01)
        done.set()

    def waiting_lines(line_every, first, moved_at=None):
        done.clear()
        t = threading.Thread(target=file_steps, args=(first, moved_at))
        t.start()
        assert _wait(layout, None, timeout=3.0, line_every=line_every) != 0  # times out
        t.join()
        assert done.is_set()
        return [ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("pivot: waiting for boundary")]

    assert WAIT_LINE_EVERY_S == 30.0
    lines = waiting_lines(WAIT_LINE_EVERY_S, 1)   # ~200 steps filed during the wait
    assert len(lines) == 1 and "step 10000" in lines[0], lines
    lines = waiting_lines(1.0, 201)                # 3 s at one line per second at most
    assert 2 <= len(lines) <= 4, lines
    write_request(layout, req)
    lines = waiting_lines(WAIT_LINE_EVERY_S, 401, moved_at=450)
    assert [ln.split(" (")[0] for ln in lines] == ["pivot: waiting for boundary step 10000",
                                                 "pivot: waiting for boundary step 20000"], lines


def test_a_worker_already_past_the_posted_boundary_pivots_at_its_next_checkpoint_in_the_same_proxy(tmp_path):
    """B is chosen from the last step the proxy filed; on a loaded machine the worker can be past
    it when the control request reaches it. CI saw the worker stop at once (not a boundary), the
    proxy take that for the end of the run and exit 0 in the middle of the pivot. The state that
    race leaves is written here directly: a request in state "boundary" at a step the worker has
    passed. The worker must stop at its next checkpoint boundary and the pivot happen there."""
    from proxy.run_files.pivot_request import write_request
    from shared.run.handshake import update_handshake
    run = tmp_path / "run"
    proc = start(run, "--max-steps", "300", *COMMON)
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 25, 300, what="training to pass step 25")
        layout = RunLayout(run)
        write_request(layout, {"label": "late", "caps": {"repo-code": 0.2, "python-docs": 0.5},
                               "floors": {"repo-docstrings": 0.3}, "requested_by": os.getpid(),
                               "requested_at": 0.0, "state": "boundary", "step": 20,
                               "proxy_pid": proc.pid})
        update_handshake(layout, lambda d: d["control"].update(stop_at_step=20, reason="pivot"))
        wait_for(lambda: len(phases(run)) == 2 or proc.poll() is not None, 300,
                 what="the pivot to be recorded")
        assert proc.poll() is None, "the proxy exited in the middle of the pivot"
        ph = phases(run)[1]
        b = ph["start_step"]
        assert b % 10 == 0 and b > 25 and ph["label"] == "late", ph
        done = run / "archive" / f"pivot-{b}" / "pivot.request.json"  # moved there once running
        wait_for(lambda: done.exists() and last_step(run) >= b + 5, 300,
                 what="the pivot in force and training after it")
        moved = json.loads(done.read_text())
        assert moved["planned_step"] == 20 and moved["step"] == b
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    assert_one_consistent_state(run, last_step(run))


def test_the_stop_rule_of_a_pivot_waits_for_a_checkpoint_boundary_and_an_alarm_does_not():
    from shared.run.handshake import control_stops_at
    pivot_ctl = {"stop_at_step": 20, "reason": "pivot"}
    assert [k for k in range(15, 45) if control_stops_at(pivot_ctl, k, 10)] == [20, 30, 40]
    alarm = {"stop_at_step": 23, "reason": "alarm"}
    assert [k for k in range(20, 26) if control_stops_at(alarm, k, 10)] == [23, 24, 25]
    assert not control_stops_at({"stop_at_step": None, "reason": None}, 50, 10)


def test_a_pivot_whose_next_boundary_lies_past_the_last_step_fails_with_the_reason(tmp_path):
    """The worker past the posted B, and its next checkpoint boundary beyond max steps: the run
    ends at its last step as planned, and the request gets state "failed" saying why it was not
    served (so the `pivot` command reports that, not a proxy that died in a pivot)."""
    from proxy.run_files.pivot_request import read_request, write_request
    from shared.run.handshake import read_handshake, update_handshake
    run = tmp_path / "run"
    proc = start(run, "--max-steps", "150", "--checkpoint-every", "100", "--probe-every", "5",
                 "--bandit-warmup", "10", "--sample-every", "100")
    with cleaned_up(proc, run):
        layout = RunLayout(run)
        wait_for(lambda: last_step(run) >= 105, 300, what="training to pass step 105")
        worker = read_handshake(layout)["worker"]["pid"]
        os.kill(worker, signal.SIGSTOP)   # hold it between 105 and 150 while the race is set up
        try:
            write_request(layout, {"label": "late", "caps": {"repo-code": 0.2}, "floors": {},
                                   "requested_by": os.getpid(), "requested_at": 0.0,
                                   "state": "boundary", "step": 100, "proxy_pid": proc.pid})
            update_handshake(layout, lambda d: d["control"].update(stop_at_step=100, reason="pivot"))
        finally:
            os.kill(worker, signal.SIGCONT)
        assert proc.wait(300) == 0
    req = read_request(layout)
    assert req["state"] == "failed" and "reached its last step 150" in req["error"], req
    assert [p["label"] for p in phases(run)] == ["initial"]
    assert last_step(run) == 150 and 150 in checkpoint_steps(run)


def test_a_pivot_request_never_replaces_a_pending_collapse_alarm_stop(tmp_path):
    """The collapse watch has posted its stop (reason alarm) when a pivot request arrives: the
    alarm's stop stays (the pivot's later boundary never replaces it), the request stays pending
    (served at the next start) and says what it waits for; once no alarm is pending it is
    posted."""
    import dataclasses

    from proxy.run_files.pivot_request import read_request, write_request
    from proxy.supervision.pivots import poll_pivot_request
    from shared.run.config import RunConfig
    from shared.run.handshake import read_handshake, update_handshake
    layout = RunLayout(tmp_path)
    cfg = dataclasses.replace(RunConfig(), checkpoint_every=10)
    update_handshake(layout, lambda d: d["control"].update(stop_at_step=24, reason="alarm"))
    write_request(layout, {"label": "late", "caps": {}, "floors": {}, "requested_by": 1,
                           "requested_at": 0.0, "state": "requested", "step": None})
    for _ in range(2):  # the watch loop polls again and again: nothing changes, no new warning
        assert poll_pivot_request(layout, cfg, filed_step=23, max_steps=1000) is None
        assert read_handshake(layout)["control"] == {"stop_at_step": 24, "reason": "alarm",
                                                     "checkpoint_at_step": None}
        req = read_request(layout)
        assert req["state"] == "requested" and req["waiting_for"] == "alarm"
    # the next start: a fresh handshake, no alarm pending; the request is served
    update_handshake(layout, lambda d: d["control"].update(stop_at_step=None, reason=None))
    assert poll_pivot_request(layout, cfg, filed_step=23, max_steps=1000) == 30
    assert read_handshake(layout)["control"]["reason"] == "pivot"
    req = read_request(layout)
    assert req["state"] == "boundary" and req["step"] == 30 and "waiting_for" not in req


def test_the_creating_command_run_again_after_a_pivot_resumes_under_the_pivots_bounds(tmp_path):
    """README: create with --caps, pivot, then run the same command again: the creating command's
    bounds are taken as a resume under the phase in force (exit 0, so a systemd unit whose
    ExecStart carries --caps starts after a live pivot); other values are refused naming
    `drop --caps`."""
    run = tmp_path / "run"
    create = ["--caps", "repo-code=0.5", "--floors", "python-docs=0.1", "--checkpoint-every", "5",
              "--sample-every", "5"]
    assert run_proxy(run, "--max-steps", "10", *create).returncode == 0
    r = pivot(run, "--caps", "repo-code=0.3", "--label", "v2", "--max-steps", "20")
    assert r.returncode == 0, r.stderr
    r = run_proxy(run, "--max-steps", "20", *create)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is the creating command's; the phase in force, 1 'v2', has --caps repo-code=0.3" in r.stderr
    assert [p["label"] for p in phases(run)] == ["initial", "v2"]
    assert phases(run)[-1]["caps"] == {"repo-code": 0.3}
    assert_one_consistent_state(run, 20)
    r = run_proxy(run, "--max-steps", "25", "--caps", "repo-code=0.4", "--checkpoint-every", "5")
    assert r.returncode == 2 and "to resume, drop --caps from the command" in r.stderr, r.stderr[-2000:]


def test_pivot_now_stops_at_the_next_step_and_a_stop_rule_with_now_ignores_the_cadence():
    from proxy.commands.pivot import next_boundary
    from shared.run.config import RunConfig
    from shared.run.handshake import control_stops_at
    now = {"stop_at_step": 23, "reason": "pivot", "now": True}
    assert [k for k in range(20, 26) if control_stops_at(now, k, 10)] == [23, 24, 25]
    cfg = RunConfig(checkpoint_every=10)
    assert next_boundary(cfg, 25) == 30 and next_boundary(cfg, 29) == 40
    assert next_boundary(cfg, 25, now=True) == 26


def _start_live(run, every: int):
    """A live 400-step run checkpointing and auditing every `every` steps, keeping them all."""
    return start(run, "--max-steps", "400", "--checkpoint-every", str(every), "--probe-every",
                 "5", "--bandit-warmup", "10", "--sample-every", str(every), "--keep-last", "1000")


def test_a_live_pivot_says_when_its_boundary_comes_and_pivot_now_pivots_at_the_next_step(tmp_path):
    """With the cadence at 100 and --max-steps 90 the pivot failed only after it was accepted
    ("the next checkpoint boundary, step 100, is not before the last step 60") and nothing said
    when a boundary would come; it is refused at once with the way out, and `--now` pivots at
    the next step. The waiting line is printed when it changes, not on every poll."""
    run = tmp_path / "run"
    proc = _start_live(run, every=100)
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 12, 300, what="training to pass step 12")
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--no-wait")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "pivots at the next checkpoint boundary (checkpoints every 100 steps): about step " \
               "100, " in r.stdout and "s per update" in r.stdout, r.stdout
        assert "`pivot --now` would checkpoint at the next step" in r.stdout
        r = pivot(run, "--withdraw")             # (deleting the file raced the proxy's rewrite)
        assert r.returncode == 0 and "pivot: withdrew 'pivot'" in r.stdout, r.stdout + r.stderr
        assert not (run / ".pivot.request.json").exists()
        wait_for(lambda: last_step(run) >= 15, 300, what="training to pass step 15")
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--label", "now", "--now")
        assert r.returncode == 0, r.stdout + r.stderr
        b = phases(run)[1]["start_step"]
        assert 15 < b < 100, b
        assert f"filed step {b + 1}" in r.stdout and "pivots at the next step" in r.stdout
        waits = [ln for ln in r.stdout.splitlines() if ln.startswith("pivot: waiting for boundary")]
        assert len(waits) == len(set(waits)), r.stdout
        wait_for(lambda: last_step(run) >= b + 3, 300, what="training after the pivot")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    recs = loss_records(run)   # (no audit before B here, so no archived .samples.json)
    assert [x["step"] for x in recs] == list(range(1, last_step(run) + 1))
    assert recs[b - 1]["phase"]["index"] == 0 and recs[b]["phase"]["index"] == 1
    assert json.loads((run / "archive" / f"pivot-{b}" / "pivot.request.json").read_text())[
        "state"] == "running"
    assert b in checkpoint_steps(run) and not (run / ".pivot.request.json").exists()


def test_a_pivot_whose_boundary_is_past_the_last_step_is_refused_at_once_naming_now(tmp_path):
    run = tmp_path / "run"
    proc = start(run, "--max-steps", "400", "--checkpoint-every", "500", "--probe-every", "5",
                 "--bandit-warmup", "10", "--sample-every", "500")
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 3, 300, what="training to pass step 3")
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "the next checkpoint boundary, step 500, is not before the run's last step 400" \
            in r.stderr and "use --now" in r.stderr, r.stderr
        assert not (run / ".pivot.request.json").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0


def test_a_pivot_withdrawn_at_its_boundary_changes_nothing_and_a_second_withdrawal_is_refused(
        tmp_path):
    """`pivot --withdraw` in state "boundary" takes back the stop the proxy posted and removes
    the request under the request lock: the worker does not stop at B, the run stays in phase 0,
    the history has every step once, and nothing is left to withdraw. Then a `--now` pivot
    withdrawn at once: the withdrawal lands before the phase is recorded (the run stays in phase
    0; a worker that had already begun stopping is followed by a new one from step_B.bin) or
    after (refused as too late, and the pivot completes); either way every step is filed once."""
    run = tmp_path / "run"
    proc = _start_live(run, every=50)
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 5, 300, what="training to pass step 5")
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--no-wait")
        assert r.returncode == 0, r.stdout + r.stderr

        def state():
            try:
                return json.loads((run / ".pivot.request.json").read_text())
            except FileNotFoundError:
                return {}
        wait_for(lambda: state().get("state") == "boundary", 300, what="the proxy to post B")
        b = state()["step"]
        r = pivot(run, "--withdraw")
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"state boundary, boundary step {b}" in r.stdout, r.stdout
        control = json.loads((run / ".handshake.json").read_text())["control"]
        assert control.get("stop_at_step") is None and control.get("reason") is None, control
        r = pivot(run, "--withdraw")
        assert r.returncode == 2 and "no pivot is pending" in r.stderr, r.stdout + r.stderr
        wait_for(lambda: last_step(run) >= b + 10, 300, what="training past the withdrawn B")
        assert len(phases(run)) == 1 and not list((run / "archive").glob("pivot-*"))
        r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--now", "--no-wait")
        assert r.returncode == 0, r.stdout + r.stderr
        w = pivot(run, "--withdraw")
        assert w.returncode == 0 or (w.returncode == 2 and "too late to withdraw" in w.stderr), \
            w.stdout + w.stderr
        want_phases = 1 if w.returncode == 0 else 2
        wait_for(lambda: len(phases(run)) == want_phases and not state(), 300,
                 what="the withdrawal or the pivot to complete")
        n = last_step(run)
        wait_for(lambda: last_step(run) >= n + 10, 300, what="training after the --now pivot")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    recs = loss_records(run)
    assert [x["step"] for x in recs] == list(range(1, last_step(run) + 1))
    assert recs[-1]["phase"]["index"] == want_phases - 1
    assert not (run / ".pivot.request.json").exists()


def test_a_pivot_archives_the_old_phase_whole_when_its_sidecars_were_never_written(tmp_path):
    """A proxy killed before it filed the checkpoint or audit that writes `.state.json` and
    `.samples.json` (a fast worker with slow checkpoint writes) leaves neither; the pivot's archive
    still holds the old phase's bandit at B (the replay) and its audit log (empty)."""
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "10", *COMMON).returncode == 0
    (run / ".state.json").unlink()
    (run / ".samples.json").unlink()
    r = pivot(run, "--caps", CAPS, "--floors", FLOORS, "--label", "polish", "--max-steps", "20")
    assert r.returncode == 0, r.stderr
    assert run_proxy(run, "--max-steps", "20", *COMMON).returncode == 0
    assert_one_consistent_state(run, 20)
    old = json.loads((run / "archive" / "pivot-10" / ".samples.json").read_text())
    assert old["phase"]["index"] == 0


def test_a_pivot_with_decay_starts_a_wsd_runs_final_decay_at_its_step_live_and_stopped_alike(tmp_path):
    """`pivot --decay` on a warmup-stable-decay run: every rate up to B as planned, then linear
    from lr(B) to the floor at the last step, recorded as a re-plan in run.json; the same pivot
    on a stopped fork at B reaches the same final checkpoint byte for byte."""
    run = tmp_path / "run"
    proc = start(run, "--max-steps", "200", "--schedule", "wsd", "--warmup-steps", "5", *COMMON,
                 "--keep-last", "1000")
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 25, 300, what="training to pass step 25")
        r = pivot(run, "--keep-bounds", "--decay", "--label", "polish")
        assert r.returncode == 0, r.stdout + r.stderr
        assert proc.wait(300) == 0
    b = phases(run)[1]["start_step"]
    assert b < 150, "the pivot came after the planned decay (step 160); make the run longer"
    cfg = json.loads((run / "run.json").read_text())
    assert cfg["replans"] == [{"at": b, "lr_decay_steps": 200, "decay_at": b}]
    lrs = [x["lr"] for x in loss_records(run)]
    peak, floor = cfg["lr"], cfg["lr"] * cfg["min_lr_ratio"]
    assert lrs[5:b] == [peak] * (b - 5), "the rates before the pivot changed"
    drops = [x - y for x, y in zip(lrs[b - 1:], lrs[b:])]
    assert all(d == pytest.approx((peak - floor) / (200 - b)) for d in drops), "not linear from B"
    assert lrs[-1] == pytest.approx(floor)
    assert_one_consistent_state(run, 200)

    fork = tmp_path / "fork"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    f = subprocess.run([sys.executable, "-m", "proxy", "fork", "--from", f"{run}:{b}",
                        "--run-dir", str(fork)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert f.returncode == 0, f.stderr
    r = pivot(fork, "--keep-bounds", "--decay", "--label", "polish")
    assert r.returncode == 0, r.stdout + r.stderr
    assert run_proxy(fork, "--max-steps", "200").returncode == 0
    assert (fork / checkpoint_name(200)).read_bytes() == (run / checkpoint_name(200)).read_bytes()


def test_a_stopped_run_pivot_right_after_a_kill_9_waits_for_the_orphaned_worker(tmp_path):
    """kill -9 of the proxy leaves its worker writing its last checkpoint (slowed to 3 s) and
    reporting steps no proxy filed (the proxy is stopped first, so there are some); a `pivot` at
    once finds the run lock free and takes the stopped path: it waits for that worker, files its
    reports and pivots at its checkpoint with the old phase's bandit there, so no step after B
    is trained in the old phase."""
    run = tmp_path / "run"
    proc = start(run, "--max-steps", "400", *COMMON, env={"ANDREA_TEST_WRITE_DELAY": "3"})
    with cleaned_up(proc, run):
        wait_for(lambda: last_step(run) >= 15, 300, what="training to pass step 15")
        for _ in range(50):  # stopped where the worker waits for its next policy: let it go on
            os.kill(proc.pid, signal.SIGSTOP)
            filed = last_step(run)
            try:
                wait_for(lambda f=filed: reported_step(run) > f, 5, what="an unfiled step")
                break
            except AssertionError:
                os.kill(proc.pid, signal.SIGCONT)
                wait_for(lambda f=filed: last_step(run) > f, 60, what="the proxy to file a step")
        assert reported_step(run) > last_step(run), "the worker reported no step the proxy missed"
        proc.kill()
        proc.wait(60)
        r = pivot(run, "--keep-bounds", "--label", "polish")
        assert r.returncode == 0, r.stdout + r.stderr
        assert run_processes(run) == [], "the orphaned worker outlived the pivot"
        b = phases(run)[1]["start_step"]
        assert b == max(checkpoint_steps(run)), (b, checkpoint_steps(run))
        assert run_proxy(run, "--max-steps", str(b + 10), *COMMON).returncode == 0
    assert_one_consistent_state(run, b + 10)
