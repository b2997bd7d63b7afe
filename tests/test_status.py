"""`status` never presents an invalid file as the last checkpoint."""
import os
import subprocess
import sys

import pytest

from proc_helpers import ROOT, run_proxy

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
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("checkpoint"))
    assert "step_000010.bin" in line
    assert any(ln.startswith("INVALID") and "step_000020.bin" in ln for ln in r.stdout.splitlines())


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
    assert r.returncode == 1 and "step_000020.bin" in r.stderr   # fails a rule, as for inspect


def test_a_checkpoint_whose_bytes_changed_is_not_the_newest_for_status_sample_or_fork(tmp_path):
    """A file whose bytes changed after it was written (its manifest checksum no longer
    matches) is not the newest checkpoint for `status` or `sample`: both check the manifest's
    checksum, also for a file quarantined in rejected/; `fork --from` takes the file's path."""
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "20", "--checkpoint-every", "10").returncode == 0
    with open(run / "step_000020.bin", "r+b") as f:
        f.seek(5000)
        f.write(b"\x7f\x7f\x7f\x7f")
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def proxy(*args):
        return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    r = proxy("status", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "step_000010.bin" in next(ln for ln in lines if ln.startswith("checkpoint"))
    bad = [ln for ln in lines if ln.startswith("INVALID")]
    assert len(bad) == 1 and "checksum" in bad[0] and bad[0].count("step_000020.bin") == 1, bad
    r = proxy("sample", str(run / "step_000020.bin"), "--tokens", "4")
    assert r.returncode == 1 and "checksum" in r.stderr and "step_000020.bin" in r.stderr
    r = proxy("sample", "--run-dir", str(run), "--tokens", "4")
    assert r.returncode == 0 and "step_000010.bin (step 10" in r.stdout, r.stderr
    (run / "rejected").mkdir()
    (run / "step_000020.bin").rename(run / "rejected" / "step_000020.bin")
    r = proxy("sample", str(run / "rejected" / "step_000020.bin"), "--tokens", "4")
    assert r.returncode == 1 and "checksum" in r.stderr
    r = proxy("fork", "--from", str(run / "step_000010.bin"), "--run-dir", str(tmp_path / "f"))
    assert r.returncode == 0 and "(step 10)" in r.stdout, r.stderr
    r = proxy("fork", "--from", f"{run}:ten", "--run-dir", str(tmp_path / "g"))
    assert r.returncode == 2 and "step 'ten' is not a number" in r.stderr, r.stderr


def test_status_while_a_proxy_is_creating_the_run_says_so_and_not_that_creation_was_killed(tmp_path):
    """During a long creation (tokenizing a big arm) `status` said the creation was "stopped
    or killed" and exited 2, while the proxy was alive and working."""
    import signal

    from proc_helpers import proxy_cmd, wait_for
    src = tmp_path / "big.txt"
    src.write_text("the quick brown fox jumps over the lazy dog, said the clock. " * 400_000)
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(proxy_cmd(run, "--max-steps", "2", "--arm", f"big=text:{src}"),
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the tokenizer is written before the arms are tokenized: creation is under way, and a
        # stop from here on leaves an unfinished creation (before it, a stop may leave nothing)
        wait_for(lambda: (run / ".proxy.owner.json").exists() and (run / "tokenizer.json").exists(),
                 180, what="the proxy to own the run and write its tokenizer")
        os.kill(proc.pid, signal.SIGSTOP)  # hold it mid-creation
        if (run / "run.json").exists():
            pytest.skip("creation finished before the proxy could be held")
        r = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert f"being created by proxy pid {proc.pid}" in r.stdout and "killed" not in r.stdout
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(60)
    r = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    if not (run / "run.json").exists():  # stopped mid-creation: now it is unfinished
        assert r.returncode == 2 and "unfinished" in r.stderr


def test_status_and_the_summary_measure_against_the_runs_plan_not_the_last_starts_max_steps(tmp_path):
    """A run planned for 40 steps and started once with --max-steps 20 is shown as stopped at
    20 / 40 (not "finished"), and its end summary does not ask for --max-steps 40: a plain
    `run` goes on to the plan. Past the plan the summary says the learning rate is flat."""
    from proc_helpers import create_template, run
    r_dir = create_template(tmp_path / "run", "--max-steps", "40", "--checkpoint-every", "10")
    r = run(r_dir, "--max-steps", "20")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "20 of 40 planned in total (this start's --max-steps 20)" in r.stdout + r.stderr
    resume = next(ln for ln in (r.stdout + r.stderr).splitlines() if "resume  " in ln)
    assert "--max-steps" not in resume, resume
    st = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(r_dir)],
                        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                        capture_output=True, text=True, timeout=60)
    assert "step        20 / 40" in st.stdout, st.stdout
    assert "stopped at the last start's --max-steps 20, before the plan's 40" in st.stdout
    r = run(r_dir)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "40 of 40 planned in total" in out, out[-3000:]
    resume = next(ln for ln in out.splitlines() if "resume  " in ln)
    assert "--max-steps 80 --replan" in resume and "--replan continues the learning rate" in resume
    st = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(r_dir)],
                        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                        capture_output=True, text=True, timeout=60)
    step_line = next(ln for ln in st.stdout.splitlines() if ln.startswith("step "))
    assert "health      finished" in st.stdout and "40 / 40" in step_line
    assert "this start" not in step_line, step_line


def test_sample_names_each_bad_value_and_temperature_zero_is_greedy(tmp_path):
    """`sample` answered any bad value with one sentence about all five options, and refused
    --temperature 0, which is what many users type for greedy decoding."""
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "10", "--checkpoint-every", "10").returncode == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def sample(*args):
        return subprocess.run([sys.executable, "-m", "proxy", "sample", "--run-dir", str(run),
                               "--prompt", "def ", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    r = sample("--tokens", "0", "--top-k", "-2")
    assert r.returncode == 2
    assert r.stderr.strip() == "sample: --tokens 0: must be >= 1; --top-k -2: must be >= 0 (0: no limit)"
    greedy = sample("--temperature", "0", "--tokens", "12")
    top1 = sample("--top-k", "1", "--tokens", "12", "--seed", "5")
    assert greedy.returncode == 0 and "greedy" in greedy.stdout.splitlines()[0], greedy.stderr
    def body(out):
        return [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert body(greedy.stdout) == body(top1.stdout)


def test_status_of_a_failed_creation_names_its_error_not_an_interruption(tmp_path):
    """`status` of a creation refused for bad input (a Parquet file without the text column)
    quotes the error the attempt logged, rather than calling it stopped or killed and telling
    the operator to run the same command again."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["a" * 100] * 50}), tmp_path / "t.parquet")
    run = tmp_path / "run"
    run.mkdir()   # given (a refused start removes a directory only when it created it)
    r = run_proxy(run, "--arm", f"x=parquet:{tmp_path / 't.parquet'}")
    assert r.returncode == 2
    st = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                        timeout=60)
    out = st.stdout + st.stderr
    assert "the last attempt to create this run failed" in out and "has no column 'text'" in out, out
    assert "stopped or killed" not in out


def test_status_tells_a_run_whose_proxy_was_killed_from_one_that_stopped_and_names_the_lost_steps(tmp_path):
    """kill -9 of the proxy and its worker: `status` says the run stopped uncleanly and which
    steps after the newest checkpoint will be trained again; after a clean start and stop it
    says plain "stopped" again."""
    import signal

    from proc_helpers import (
        cleaned_up,
        create_template,
        hello_pid,
        last_step,
        manifest,
        start,
        wait_for,
        wait_report,
    )
    b = create_template(tmp_path / "run", "--max-steps", "400", "--checkpoint-every", "10")
    proc = start(b, env={"ANDREA_TEST_PAUSE_AT_STEP": "15:600"})
    with cleaned_up(proc, b):
        wait_report(b, lambda r: r.get("event") == "test-pause", 180, "the pause in step 15")
        wait_for(lambda: last_step(b) >= 14 and 10 in [s for s, *_ in manifest(b)], 120,
                 what="step 14 filed and step_000010.bin on disk")
        wpid = hello_pid(b, 10)
        proc.send_signal(signal.SIGSTOP)  # so it neither restarts the worker nor ends cleanly
        os.kill(wpid, signal.SIGKILL)
        proc.kill()
        proc.wait(30)

    def health() -> str:
        r = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(b)],
                           cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return next(ln for ln in r.stdout.splitlines() if ln.startswith("health"))

    h = health()
    assert "stopped uncleanly" in h and f"proxy pid {proc.pid}" in h, h
    assert "steps 11..14 after the newest checkpoint are trained again" in h, h
    from proc_helpers import run
    r = run(b, "--max-steps", "20")
    assert r.returncode == 0, r.stderr[-3000:]
    h = health()
    assert "stopped" in h and "uncleanly" not in h, h


def test_every_command_says_one_thing_with_one_exit_code_for_each_bad_run_directory(tmp_path):
    """Each bad run directory (not a run, no checkpoint yet, ...) gets one message and one exit
    code in every command that meets it (`status`, `sample`, `export --from-run`, `inspect`,
    `plot`), and the message names the next step."""
    from proc_helpers import create_template
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def proxy(*args):
        r = subprocess.run([sys.executable, "-m", "proxy", *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        line = (r.stdout + r.stderr).strip().splitlines()[-1]
        return r.returncode, line.removeprefix(f"{args[0]}: ")   # the command's own prefix

    def per_command(d, with_plot=True):
        out = tmp_path / "out.safetensors"
        said = {"status": proxy("status", "--run-dir", str(d)),
                "sample": proxy("sample", "--run-dir", str(d), "--tokens", "2"),
                "export": proxy("export", "--from-run", str(d), "--to", str(out))}
        if with_plot:
            said["plot"] = proxy("plot", "--run-dir", str(d), "--out", str(tmp_path / "p.png"))
        return said

    not_run = tmp_path / "notes"
    not_run.mkdir()
    (not_run / "x.txt").write_text("hello")
    for d, why in ((tmp_path / "missing", "no such directory"), (not_run, "no run.json")):
        said = per_command(d)
        want = (2, f"{d}: not a run directory ({why}); pass the --run-dir given to "
                   "`python -m proxy run`")
        assert all(v == want for v in said.values()), said
    run = create_template(tmp_path / "run", "--checkpoint-every", "10")
    said = per_command(run, with_plot=False)
    assert said["status"][0] == 0
    want = (2, f"{run}: no checkpoint yet: trained to step 0, the first is written at step 10 "
               f"(--checkpoint-every); wait for it while the run trains, or start it with "
               f"`python -m proxy run --run-dir {run}`")
    assert said["sample"] == said["export"] == want, said
    code, line = proxy("plot", "--run-dir", str(run))
    assert code == 2 and "no history to plot yet" in line and "python -m proxy run" in line
    ghost = run / "step_000010.bin"
    for cmd in (["inspect", str(ghost)], ["sample", str(ghost)],
                ["export", str(ghost), "--to", str(tmp_path / "o.safetensors")]):
        assert proxy(*cmd) == (2, f"{ghost}: no such checkpoint file; `python -m proxy status "
                                  f"--run-dir {run}` names the run's checkpoints"), cmd
    for cmd in (["inspect", str(run)], ["export", str(run), "--to", str(tmp_path / "o.st")]):
        code, line = proxy(*cmd)
        assert code == 2 and line.startswith(f"{run}: a directory, not a checkpoint file"), line
    done = tmp_path / "done"
    assert run_proxy(done, "--max-steps", "10", "--checkpoint-every", "10").returncode == 0
    with open(done / "step_000010.bin", "r+b") as f:
        f.truncate(100)
    said = per_command(done, with_plot=False)
    want = (1, f"{done}: no valid checkpoint: none of its 1 checkpoint file(s) passes the rules "
               f"(newest step_000010.bin); `python -m proxy status --run-dir {done}` names each "
               "one's fault (docs/checkpoint-format.md#validity)")
    assert said["sample"] == said["export"] == want, said
    assert proxy("inspect", str(done / "step_000010.bin"))[0] == 1
    assert proxy("sample", str(done / "step_000010.bin"), "--tokens", "2")[0] == 1


def test_sidecars_of_the_wrong_shape_never_crash_the_policy_view(tmp_path):
    """`status` reads `.state.json` and `.status.json` that are JSON of another shape (a field
    of the wrong type) as it reads garbage ones: it passes over them and says the rest."""
    import json as _json

    from proc_helpers import create_template
    from proxy.commands.status import collect_status, format_status
    run = create_template(tmp_path / "run")
    for state, status in [({"phase": 5}, {}), ({"step": "x", "phase": {"index": 0}}, {}),
                          ({}, {"policy": {"why": "x", "reward": "r", "step": 99999, "phase": 9,
                                           "arms": {"a": {"slope": "s", "periods": "p"}, "b": 3}}}),
                          ({}, {"policy": {"why": "x", "arms": 7}})]:
        (run / ".state.json").write_text(_json.dumps(state))
        (run / ".status.json").write_text(_json.dumps(status))
        format_status(collect_status(run))


def test_a_garbage_run_json_or_phases_json_gets_one_line_naming_it_never_a_traceback(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "20", "--checkpoint-every", "10").returncode == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def status():
        return subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60)

    good = (run / "phases.json").read_bytes()
    (run / "phases.json").write_text("{")
    r = status()
    assert r.returncode == 0 and f"{run / 'phases.json'}: unreadable" in r.stderr, r.stderr
    (run / "phases.json").write_bytes(good)
    (run / "run.json").write_text("{garbage")
    r = status()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().startswith("status: ") and "run.json: unreadable run config" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
