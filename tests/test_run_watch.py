"""As a user meets it: a real tiny run prints elapsed time and an ETA, logs its
samples readably, writes live TensorBoard scalars, ends with a summary; `sample` prints the same
way and says how long it took; `--tensorboard` without the package is refused before anything
is created. Real proxy and worker processes (tests/proc_helpers.py)."""
import os
import re
import subprocess
import sys

import pytest

from proc_helpers import ROOT, proxy_log, run_proxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One real tiny run (20 steps, checkpoints and audits every 10, a progress line every 5,
    TensorBoard on), shared by the tests below: (its directory, the finished proxy's result)."""
    run = tmp_path_factory.mktemp("watch") / "run"
    r = run_proxy(run, "--max-steps", "20", "--checkpoint-every", "10", "--sample-every", "10",
                  "--print-every", "5", "--tensorboard")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return run, r


def test_progress_lines_show_elapsed_time_an_eta_and_a_credible_mfu(finished_run):
    _, r = finished_run
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    steps = [int(ln.split()[1].split("/")[0]) for ln in lines]
    assert steps[0] == 1 and {5, 10, 15, 20} <= set(steps)   # the first step at once
    assert all(re.search(r"\| \d+:\d\d:\d\d elapsed, eta (\d+:\d\d:\d\d|--) \|", ln) for ln in lines)
    assert "eta 0:00:00" in lines[-1]
    assert all(float(m) <= 100 for ln in lines for m in re.findall(r"mfu ([\d.]+)%", ln))


def test_sample_audits_are_logged_with_the_prompt_and_the_text_apart(finished_run):
    run, _ = finished_run
    log = proxy_log(run)
    assert re.search(r"sample @10 \[\S+\] held-out [\d.]+ \(temperature 0.8, top-k 40\)\n"
                     r"    prompt \|", log)
    assert "\n      text |" in log


def test_the_run_ends_with_a_summary_of_steps_losses_checkpoint_and_next_commands(finished_run):
    run, _ = finished_run
    log = proxy_log(run)
    summary = log[log.index("run summary: "):]
    assert "steps       20 this start (0 -> 20), 20 of 20 planned in total" in summary
    assert "tokens      " in summary and "wall time   " in summary
    assert re.search(r"train loss  EMA \d+\.\d{4}", summary)
    assert re.search(r"held-out    \(step 20\) ", summary)
    assert "step_000020.bin (step 20)" in summary
    for cmd in ("proxy run --run-dir", "proxy sample --run-dir", "proxy plot --run-dir",
                "proxy export --from-run"):
        assert cmd in summary


def test_tensorboard_has_every_step_once_and_the_named_scalars(finished_run):
    run, _ = finished_run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 21))
    assert {"train/loss_ema", "train/lr", "train/grad_norm", "perf/tokens_per_s",
            "checkpoint/step"} <= set(tags)
    assert any(t.startswith("arms/p/") for t in tags) and any(t.startswith("heldout/") for t in tags)


def test_sample_prints_prompt_and_text_apart_with_its_time_and_cuts_nothing(finished_run):
    run, _ = finished_run
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    s = subprocess.run([sys.executable, "-m", "proxy", "sample", "--run-dir", str(run),
                        "--prompt", "def f(x):\n", "--samples", "2", "--tokens", "12"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert s.returncode == 0, s.stderr
    assert s.stdout.count("    prompt | def f(x):\n           |\n      text |") == 2
    assert re.search(r"# 2 x 12 tokens in [\d.]+ s .*; [\d.]+ s in all with loading", s.stdout)
    # everything asked for is shown, however many lines (no part is cut)
    long_prompt = "".join(f"line {i}\n" for i in range(40))
    s = subprocess.run([sys.executable, "-m", "proxy", "sample", "--run-dir", str(run),
                        "--prompt", long_prompt, "--samples", "1", "--tokens", "4"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert s.returncode == 0, s.stderr
    assert "| line 39" in s.stdout and "more lines" not in s.stdout, s.stdout


def test_tensorboard_without_the_package_exits_2_before_creating_anything(tmp_path):
    shim = tmp_path / "shim" / "tensorboard"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named tensorboard')\n")
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim.parent), str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "proxy", "run", "--run-dir", str(run),
                        "--tensorboard"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "pip install -e '.[tensorboard]'" in r.stderr
    assert not run.exists()


def _c_corpus(d):
    """A small C-like corpus of many files (one document each)."""
    d.mkdir()
    for i in range(40):
        body = "".join(f"    x{j} = f{j}(x{j - 1}, {i});\n" for j in range(1, 30))
        (d / f"f{i:02d}.c").write_text(f"static int fn{i}(int x0)\n{{\n{body}    return x29;\n}}\n")
    return d


def test_progress_from_the_first_step_then_by_steps_or_time_and_a_summary_that_fits(tmp_path):
    """The first progress line came only at step --print-every (five minutes in on a slow
    machine); the summary's EMA was not bias-corrected, its wall time left out the creation, and
    it suggested --prompt 'def ' for a C corpus."""
    src = _c_corpus(tmp_path / "src")
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "3", "--print-every", "1000", f"--arm=c=text:{src}")
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [int(ln.split()[1].split("/")[0]) for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert steps[0] == 1 and steps[-1] == 3, steps
    summary = proxy_log(run)[proxy_log(run).index("run summary: "):]
    assert re.search(r"wall time   \d+:\d\d:\d\d \(creation \d+:\d\d:\d\d, training "
                     r"\d+:\d\d:\d\d\)", summary), summary
    assert re.search(r"train loss  EMA \d+\.\d{4}, mean of the last 3 steps \d+\.\d{4}", summary)
    assert "--prompt 'static int fn0(int x0)' --samples 3" in summary, summary
    assert "'def '" not in summary
    env = dict(os.environ, PYTHONPATH=str(ROOT), ANDREA_PRINT_SECONDS="0")
    r = subprocess.run([sys.executable, "-m", "proxy", "run", "--run-dir", str(run),
                        "--max-steps", "6", "--print-every", "1000"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [int(ln.split()[1].split("/")[0]) for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert steps == [4, 5, 6], steps            # by time: every step when the period is 0
    summary = proxy_log(run)[proxy_log(run).rindex("run summary: "):]
    assert "training (a resumed run: no creation)" in summary


def test_tensorboard_switched_on_for_a_trained_run_shows_its_whole_history_once(tmp_path):
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "6", "--checkpoint-every", "3", "--sample-every", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_proxy(run, "--max-steps", "8", "--checkpoint-every", "3", "--tensorboard")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensorboard: backfilled 6 step records and 2 sample audits up to step 6" in r.stderr
    r = run_proxy(run, "--max-steps", "9", "--tensorboard")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "backfilled" not in r.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.compat.proto import event_pb2

    from proxy.observation.tensorboard_log import EVENT_GLOB, read_events
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 10))
    assert [e.step for e in acc.Tensors("audit/samples")][:2] == [3, 6]
    raw = sorted(ev.step for f in (run / "tensorboard").glob(EVENT_GLOB) for b in read_events(f)
                 for ev in [event_pb2.Event.FromString(b)] if ev.HasField("summary")
                 and any(v.tag == "train/loss" for v in ev.summary.value))
    assert raw == list(range(1, 10))             # no step written twice
