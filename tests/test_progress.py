"""the progress line (elapsed, ETA, a credible MFU) and readable samples — the pure
formatting, no processes (the run-level checks are in tests/test_run_watch.py)."""
import time
from pathlib import Path

import pytest

from proxy.observation.progress import ProgressLine, credible_mfu, fmt_duration
from proxy.observation.sample_format import format_audit, format_sample


def test_durations_read_as_hours_minutes_seconds():
    assert fmt_duration(0) == "0:00:00"
    assert fmt_duration(3725.4) == "1:02:05"
    assert fmt_duration(90000) == "1d 1:00:00"
    assert fmt_duration(None) == fmt_duration(float("inf")) == "--"


def test_mfu_is_rescaled_to_the_window_and_never_above_one():
    rec = {"mfu": 0.40, "tokens_per_s": 1000.0}
    assert abs(credible_mfu(rec, 500.0) - 0.20) < 1e-12      # the line's windowed tokens/s
    assert credible_mfu(rec, 3000.0) is None                   # 120 %: left out, not printed
    assert credible_mfu({"mfu": 1.059, "tokens_per_s": 10.0}, None) is None
    assert credible_mfu({"mfu": None, "tokens_per_s": 10.0}, 10.0) is None


def test_eta_uses_the_workers_record_times_to_max_steps():
    pl = ProgressLine(max_steps=100)
    pl.on_incarnation(0)
    t = time.time()
    for k in range(1, 11):                   # 2 s per step
        pl.observe({"step": k, "time": t + 2.0 * k})
    assert abs(pl.eta_seconds(10) - 180.0) < 1e-6
    line = pl.line({"step": 10, "loss": 3.0, "lr": 1e-3, "mfu": 5.0, "tokens_per_s": 1.0,
                    "p": {"a": 1.0}}, ema=3.1, tok_per_s=1.0)
    assert "elapsed, eta 0:03:00" in line and "mfu" not in line  # 500 % is left out
    assert line.startswith("step     10/100 | loss 3.0000 (ema 3.1000)")
    pl.on_incarnation(10)                    # a restart's gap is not training speed
    assert pl.eta_seconds(10) is None


def test_a_sample_shows_prompt_and_continuation_apart_with_real_line_breaks():
    s = format_sample("sample @100 [code]", "def f(x):\n", "    return x\x13\n\nend")
    assert s.split("\n") == ["sample @100 [code]",
                             "    prompt | def f(x):",
                             "           |",
                             "      text |     return x\\x13",
                             "           |",
                             "           | end"]
    [block] = format_audit({"step": 7, "arms": {"docs": {"prompt": "The ", "text": "end",
                                                         "loss": 2.5, "temperature": 0.8,
                                                         "top_k": 40}}})
    assert block.split("\n")[0] == "sample @7 [docs] held-out 2.500 (temperature 0.8, top-k 40)"
    assert "\\n" not in block and "    prompt | The " in block


def test_status_of_a_run_no_proxy_ever_held_says_so_not_pid_none(tmp_path):
    """`status` of a just-created run, whose lock no proxy ever held, says "no proxy" (not
    "proxy pid None on None")."""
    from proc_helpers import create_template
    from proxy.commands.status import collect_status, format_status
    run = create_template(tmp_path / "run")
    line = next(ln for ln in format_status(collect_status(run)).splitlines()
                if ln.startswith("processes"))
    assert "None" not in line and "no proxy" in line, line


def test_printed_commands_name_the_interpreter_that_runs_this(tmp_path, monkeypatch):
    """The summary's `next:` commands name the interpreter running the proxy, not a bare
    `python`, which may be another interpreter without the project installed."""
    import sys

    from proxy.observation.progress import python_command
    monkeypatch.chdir(tmp_path)
    assert python_command() == sys.executable          # not under the working directory
    monkeypatch.chdir(Path(sys.executable).parent)
    assert python_command() == Path(sys.executable).name


def test_the_log_cuts_a_long_sample_and_says_so_and_the_sample_command_shows_it_whole():
    text = "".join(f"l{i}\n" for i in range(30))
    cut = format_sample("h", "p", text).split("\n")
    assert cut[-1].endswith("... (7 more lines)") and "| l23" in cut[-2]
    whole = format_sample("h", "p", text, max_lines=None).split("\n")
    assert len(whole) == 1 + 1 + 31 and "more lines" not in "\n".join(whole)


def test_wall_seconds_per_update_counts_checkpoints_and_audits_but_not_a_stop():
    """`status` projected from the median gap between steps (checkpoints and audits left out)
    and showed the mean of per-step tokens/s: 0.73 s per update and 3,471 tok/s where the run
    took 1.03 s and the progress line said about 2,000. The window is the progress line's."""
    from proxy.observation.progress import wall_seconds_per_update
    t, recs = 1000.0, []
    for step in range(1, 121):
        t += 1.0 + (5.0 if step % 10 == 0 else 0.0)     # a 5 s checkpoint every 10 steps
        if step == 61:
            t += 3600.0                                  # stopped for an hour, then resumed
        recs.append({"step": step, "time": t})
    got = wall_seconds_per_update(recs)
    assert got == pytest.approx(1.5, abs=0.02), got      # 50 steps after the stop: 5 pauses of 5 s
    assert wall_seconds_per_update(recs[:70]) == pytest.approx((1.0 * 9 + 6.0) / 9, abs=0.2)
    assert wall_seconds_per_update(recs[:1]) is None and wall_seconds_per_update([]) is None
