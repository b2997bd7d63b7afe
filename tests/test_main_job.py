"""The main job end to end: real proxy and worker processes, real signals, real files."""
import json
import signal

import pytest

from proc_helpers import (
    checkpoint_steps,
    last_step,
    loss_records,
    pid_alive,
    run_proxy,
    start,
    start_proxy,
    wait_for,
    wait_report,
    worker_pid,
)
from shared.checkpoint.file_format import checkpoint_name
from shared.checkpoint.read import load_checkpoint
from shared.run.config import PRESETS, count_parameters


def test_andrea_12m_has_exactly_12811008_parameters_and_a_153732104_byte_checkpoint():
    from worker.model import GPT
    assert count_parameters(PRESETS["andrea-12m"], 2305) == 12_811_008
    assert 8 + 12 * 12_811_008 == 153_732_104
    assert GPT(PRESETS["andrea-12m"], 2305).n_params == 12_811_008


@pytest.mark.slow
def test_sigusr1_checkpoints_and_training_goes_on_then_sigterm_stops_both_with_exit_0(tmp_path):
    run = tmp_path / "run"
    proc = start_proxy(run, "--max-steps", "100000", "--checkpoint-every", "100000")
    try:
        wait_for(lambda: last_step(run) >= 5, 120, what="training to start")
        wpid = worker_pid(run)
        assert wpid and pid_alive(wpid)
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: checkpoint_steps(run), 120, what="the SIGUSR1 checkpoint")
        usr1_step = checkpoint_steps(run)[0]
        wait_for(lambda: last_step(run) >= usr1_step + 5, 120, what="training to continue")
        assert proc.poll() is None and pid_alive(wpid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        wait_for(lambda: not pid_alive(wpid), 60, what="the worker to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
    records = loss_records(run)
    final = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, final + 1))
    assert checkpoint_steps(run) == [usr1_step, final]
    manifest = json.loads((run / "checkpoints.json").read_text())["checkpoints"]
    assert [(e["step"], e["reason"], e["pinned"]) for e in manifest] == [
        (usr1_step, "sigusr1", True), (final, "sigterm", False)]
    step, *_ = load_checkpoint(run / checkpoint_name(final), 42_880)
    assert step == final


@pytest.mark.slow
def test_resume_after_sigterm_gives_byte_identical_checkpoint_and_the_same_history(tmp_path):
    common = ["--max-steps", "300", "--checkpoint-every", "100", "--bandit-warmup", "0",
              "--reward", "heldout_progress"]   # the probe's EXP3 policy moves every period
    a, b = tmp_path / "a", tmp_path / "b"
    # 300 steps and a creation took over 180 s (run_proxy's default) at load average 16
    assert run_proxy(a, *common, timeout=900).returncode == 0

    # update 150 pauses until the SIGTERM arrives (worker/fault_injection.py): the stop falls
    # between the cadences however fast the run and however slow the test's polling
    proc = start(b, *common, env={"ANDREA_TEST_PAUSE_AT_STEP": "150:600"})
    try:
        wait_report(b, lambda r: r.get("event") == "test-pause", 180, "the pause in update 150")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped_at = last_step(b)
    assert 100 <= stopped_at < 300, "the run must be stopped between cadences for the test to mean anything"
    assert run_proxy(b, *common, timeout=900).returncode == 0

    final = checkpoint_name(300)
    assert (a / final).read_bytes() == (b / final).read_bytes()
    ra, rb = loss_records(a), loss_records(b)
    assert [r["step"] for r in rb] == list(range(1, 301))
    keys = ("loss", "lr", "tokens", "arms", "p", "arm_loss", "arm_unigram_loss", "probe")
    assert [{k: r.get(k) for k in keys} for r in ra] == [{k: r.get(k) for k in keys} for r in rb]
    assert len({json.dumps(r["p"], sort_keys=True) for r in ra}) > 1, "the bandit never moved"
