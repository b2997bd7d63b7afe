"""The validation curve (docs/history.md#record, the `eval` field): per-arm held-out loss on the
same windows every `eval_every` steps, within 1 % of training by default, shown by `status`, the
plot and TensorBoard, and never changing a training batch: a run with it and one without end in
byte-identical checkpoints, and a run with it stopped by SIGTERM and resumed equals the
uninterrupted one. Real proxy and worker processes."""
import json
import signal
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proc_helpers import (
    ROOT,
    assert_same_run,
    create_template,
    loss_records,
    run,
    start,
    stopped_step,
    wait_report,
)
from proxy.observation.plot import read_series
from proxy.observation.tensorboard_log import step_scalars
from shared.checkpoint.file_format import checkpoint_name
from shared.run.config import EVAL_BUDGET, ConfigError, RunConfig, default_eval_every, eval_cost

FINAL = 40
ARGS = ["--max-steps", str(FINAL), "--checkpoint-every", "20", "--warmup-steps", "5"]


@given(st.integers(1, 4096), st.integers(1, 40), st.integers(1, 64))
def test_the_default_cadence_keeps_validation_within_its_budget(batch, arms, sequences):
    cfg = RunConfig(batch_size=batch, eval_sequences=sequences)
    every = default_eval_every(cfg, arms)
    assert every % 10 == 0 and every >= 10
    assert eval_cost(RunConfig(batch_size=batch, eval_sequences=sequences, eval_every=every),
                     arms) <= EVAL_BUDGET + 1e-12
    if every > 10:  # the smallest such multiple of 10
        assert eval_cost(RunConfig(batch_size=batch, eval_sequences=sequences,
                                   eval_every=every - 10), arms) > EVAL_BUDGET


def test_no_validation_costs_nothing_and_a_negative_cadence_is_refused():
    assert eval_cost(RunConfig(eval_every=0)) == 0.0
    with pytest.raises(ConfigError, match="eval_every=-1 .*--eval-every.* must be >= 0"):
        RunConfig(eval_every=-1).validate()


def test_tensorboard_gets_the_validation_under_eval():
    tags = step_scalars({"step": 10, "loss": 3.0, "eval": {"a": 2.5, "b": 2.75}}, 3.0)
    assert tags["eval/a"] == 2.5 and tags["eval/b"] == 2.75


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run without validation and with it every 10 steps, both to the end."""
    base = tmp_path_factory.mktemp("val")
    out = {}
    for every in ("0", "10"):
        d = create_template(base / f"every{every}", *ARGS, "--eval-every", every)
        r = run(d, *ARGS)
        assert r.returncode == 0, r.stderr[-3000:]
        out[every] = d
    return out


@pytest.mark.slow
def test_validation_is_recorded_shown_and_changes_no_batch(runs):
    off, on = runs["0"], runs["10"]
    name = checkpoint_name(FINAL)
    assert (off / name).read_bytes() == (on / name).read_bytes(), "validation changed training"
    ron, roff = loss_records(on), loss_records(off)
    assert [r["loss"] for r in ron] == [r["loss"] for r in roff]
    assert [r["step"] for r in ron if "eval" in r] == [10, 20, 30, 40]
    assert not any("eval" in r for r in roff)
    arms = set(ron[-1]["arm_loss"])
    assert all(set(r["eval"]) == arms for r in ron if "eval" in r)
    status = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(on),
                             "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    v = json.loads(status.stdout)["validation"]
    assert (v["every"], v["step"], set(v["arms"])) == (10, 40, arms)
    s = read_series(on / ".loss.json")
    assert {a: xs for a, (xs, _) in s["eval"].items()} == {a: [10, 20, 30, 40] for a in arms}
    text = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(off)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "validation" not in text  # --eval-every 0: nothing to show, nothing promised


@pytest.mark.slow
def test_a_run_with_validation_stopped_by_sigterm_and_resumed_is_byte_identical(runs, tmp_path):
    d = create_template(tmp_path / "run", *ARGS, "--eval-every", "10")
    proc = start(d, *ARGS, env={"ANDREA_TEST_PAUSE_AT_STEP": "15:600"})
    try:
        wait_report(d, lambda r: r.get("event") == "test-pause" and r.get("step") == 15, 180,
                    "the pause in step 15")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stopped_step(d) == 15
    r = run(d, *ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(runs["10"], d, FINAL)
    assert [x.get("eval") for x in loss_records(d)] == [x.get("eval") for x in loss_records(runs["10"])]
