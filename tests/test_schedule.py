"""The learning-rate schedule (docs/configuration.md#the-schedule): cosine or warmup-stable-decay,
a pure function of the step and run.json, re-planned at a restart with the rate continuous, and a
run re-planned, stopped and resumed bit-exact. Real proxy and worker processes for the runs."""
import dataclasses
import json
import math
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proc_helpers import (
    assert_same_run,
    clone,
    create_template,
    loss_records,
    run,
    start,
    stopped_step,
    wait_report,
)
from proxy.supervision.run_setup import replan
from shared.lr_schedule import learning_rate
from shared.run.config import ConfigError, RunConfig
from shared.run.layout import RunLayout


def _cosine_as_created(step, cfg):
    """The schedule every run before re-plans and wsd trained with, written out again."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return peak * step / cfg.warmup_steps
    if step >= cfg.lr_decay_steps:
        return floor
    ratio = (step - cfg.warmup_steps) / max(1, cfg.lr_decay_steps - cfg.warmup_steps)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


plans = st.tuples(st.integers(0, 50), st.integers(60, 2000), st.floats(1e-4, 1e-2),
                  st.floats(0.0, 0.5))


@given(plans, st.integers(1, 2500))
def test_a_cosine_run_without_re_plans_trains_at_exactly_the_rates_it_always_did(p, step):
    w, end, lr, ratio = p
    cfg = RunConfig(lr=lr, min_lr_ratio=ratio, warmup_steps=w, lr_decay_steps=end, max_steps=end)
    assert learning_rate(step, cfg) == _cosine_as_created(step, cfg)


@given(plans, st.sampled_from(["cosine", "wsd"]), st.data())
def test_a_re_plan_keeps_every_rate_before_it_and_the_rate_continuous(p, schedule, data):
    w, end, lr, ratio = p
    cfg = RunConfig(lr=lr, min_lr_ratio=ratio, warmup_steps=w, lr_decay_steps=end, max_steps=end,
                    schedule=schedule)
    at = data.draw(st.integers(w + 1, end + 500))
    new_end = data.draw(st.integers(at + 2, at + 3000))
    new = dataclasses.replace(cfg, replans=[{"at": at, "lr_decay_steps": new_end, "decay_at": None}])
    for k in (1, w, at // 2, at - 1, at):
        if k >= 1:
            assert learning_rate(k, new) == learning_rate(k, cfg)
    floor = lr * ratio
    lr_at, nxt = learning_rate(at, cfg), learning_rate(at + 1, new)
    # continuous: the first step after it moves at most one step of its own decay
    assert abs(nxt - lr_at) <= (lr_at - floor) * math.pi / (new_end - at) + 1e-15
    assert learning_rate(new_end, new) == pytest.approx(floor)
    rates = [learning_rate(k, new) for k in range(at, new_end + 1)]
    assert all(a >= b - 1e-15 for a, b in zip(rates, rates[1:])), "never rises after a re-plan"


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fraction():
    cfg = RunConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, lr_decay_steps=100,
                    max_steps=100, schedule="wsd", decay_fraction=0.2)
    assert [learning_rate(k, cfg) for k in (5, 10, 11, 50, 80)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert learning_rate(90, cfg) == pytest.approx(0.55) and learning_rate(100, cfg) == 0.1
    ext = dataclasses.replace(cfg, replans=[{"at": 60, "lr_decay_steps": 200, "decay_at": 150}])
    assert learning_rate(150, ext) == 1.0 and learning_rate(175, ext) == pytest.approx(0.55)


def test_replan_records_once_refuses_a_past_end_and_a_decay_step_for_cosine(tmp_path):
    layout = RunLayout(tmp_path)
    cfg = RunConfig(max_steps=100, lr_decay_steps=100)
    assert replan(layout, cfg, 100, 100) is None, "the same plan: nothing recorded"
    with pytest.raises(ConfigError, match="resumes at step 100; give a later end"):
        replan(layout, cfg, 100, 90)
    with pytest.raises(ConfigError, match="--decay-at is for --schedule wsd"):
        replan(layout, cfg, 100, 200, decay_at=150)
    assert replan(layout, cfg, 100, 200) == {"at": 100, "lr_decay_steps": 200, "decay_at": None}
    saved = json.loads(layout.run_json.read_text())
    assert saved["max_steps"] == 200 and saved["replans"] == cfg.replans
    assert replan(layout, cfg, 150, 200) is None, "a restart by the same command"


ARGS = ["--max-steps", "40", "--checkpoint-every", "10", "--warmup-steps", "5"]
MORE = ["--max-steps", "80", "--checkpoint-every", "10", "--replan"]


@pytest.fixture(scope="module")
def replanned(tmp_path_factory):
    """A run planned for 40 steps stopped at 20, then re-planned to 80 with --replan; and
    its first 20 steps alone."""
    d = create_template(tmp_path_factory.mktemp("sched") / "run", *ARGS)
    assert run(d, *ARGS[2:], "--max-steps", "20").returncode == 0
    first = clone(d, tmp_path_factory.mktemp("first") / "run")
    r = run(d, *MORE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "re-planned the learning-rate schedule at step 20 to end at step 80" in r.stderr
    return first, d


@pytest.mark.slow
def test_a_run_extended_with_replan_continues_its_rate_to_the_new_end(replanned):
    _, d = replanned
    recs = loss_records(d)
    assert [x["step"] for x in recs] == list(range(1, 81))
    lrs = [x["lr"] for x in recs]
    floor = 3e-3 * 0.1
    step_before = lrs[18] - lrs[19]  # the first plan's decay per step at step 20
    assert 0 < lrs[19] - lrs[20] < step_before, "continuous, and slower: the plan is longer"
    assert all(a > b for a, b in zip(lrs[19:79], lrs[20:80])) and lrs[79] == pytest.approx(floor)
    assert lrs[39] > 2 * floor, "step 40, the first plan's end, is no longer at the floor"
    assert [e["event"] for e in recs[20].get("events", [])] == ["replanned"]
    cfg = json.loads((d / "run.json").read_text())
    assert cfg["max_steps"] == 80 and cfg["replans"] == [
        {"at": 20, "lr_decay_steps": 80, "decay_at": None}]


@pytest.mark.slow
def test_a_re_planned_run_stopped_by_sigterm_and_resumed_by_the_same_command_is_exact(replanned, tmp_path):
    first, whole = replanned
    d = clone(first, tmp_path / "run")
    proc = start(d, *MORE, env={"ANDREA_TEST_PAUSE_AT_STEP": "55:600"})
    try:
        wait_report(d, lambda r: r.get("event") == "test-pause" and r.get("step") == 55, 180,
                    "the pause in step 55")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stopped_step(d) == 55
    r = run(d, *MORE)  # a systemd unit or a requeued job repeats the command: no second re-plan
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the plan already ends at step 80" in r.stderr
    assert_same_run(whole, d, 80)
    assert len(json.loads((d / "run.json").read_text())["replans"]) == 1


@pytest.mark.slow
def test_a_wsd_run_trains_at_the_peak_then_decays(tmp_path):
    d = create_template(tmp_path / "run", *ARGS, "--schedule", "wsd", "--decay-fraction", "0.25")
    assert run(d, *ARGS).returncode == 0
    lrs = [x["lr"] for x in loss_records(d)]
    assert set(lrs[5:30]) == {3e-3} and lrs[-1] == pytest.approx(3e-4)
    assert all(a > b for a, b in zip(lrs[30:], lrs[31:]))
