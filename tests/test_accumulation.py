"""Gradient accumulation (docs/configuration.md#batch-and-accumulation): an update's batch run as
micro-batches trains like the batch in one pass. In-process: a real run directory (created as
`run` creates it, without a worker process), the real Trainer, real updates on CPU."""
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from proc_helpers import create_template
from shared.run.config import ConfigError, accumulation_steps
from worker.signals import SignalFlags
from worker.trainer import Trainer, WorkerOptions

# 16 sequences as 4 x 4 vs 16 in one pass: the same data and the same mean gradient, only the
# float32 summation order differs. Observed after 20 AdamW updates (andrea-test): max |diff| of
# the weights about 1e-6; the bound leaves margin, while training moves weights by ~1e-2 and a
# run on a quarter of the data (the negative control) ends ~1e-3 or more away.
RTOL, ATOL = 1e-4, 2e-5
STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One BLAS thread: these tiny matmuls run 10x faster than with threads fighting for a
    shared CPU, and the comparison does not depend on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return create_template(tmp_path_factory.mktemp("acc") / "run", "--batch-size", "16",
                           "--max-steps", "100", "--probe-every", "1000",
                           "--checkpoint-every", "1000", "--sample-every", "1000")


def _train(run_dir: Path, micro: int | None, batch_size: int | None = None):
    t = Trainer(WorkerOptions(run_dir=run_dir, device="cpu", micro_batch_size=micro), SignalFlags())
    if batch_size is not None:  # the negative control: a smaller batch (first rows only)
        t.cfg.batch_size = t.micro = batch_size
    probs = {n: 1.0 / len(t.sampler.names) for n in t.sampler.names}
    recs = [t.train_step(k, probs) for k in range(1, STEPS + 1)]
    return t, recs


@pytest.mark.slow
def test_16_sequences_as_4_micro_batches_of_4_train_like_one_batch_of_16(run_dir):
    one, rec1 = _train(run_dir, None)
    acc, rec4 = _train(run_dir, 4)
    assert (one.accum, one.micro, acc.accum, acc.micro) == (1, 16, 4, 4)
    w1, w4 = one.model.flat.detach().numpy(), acc.model.flat.detach().numpy()
    np.testing.assert_allclose(w4, w1, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(acc.opt.m.numpy(), one.opt.m.numpy(), rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(acc.opt.v.numpy(), one.opt.v.numpy(), rtol=1e-3, atol=1e-9)
    # the record is the update's: loss and per-arm losses over all 16 sequences, step = update
    assert [r["step"] for r in rec4] == list(range(1, STEPS + 1))
    assert [r["arms"] for r in rec4] == [r["arms"] for r in rec1]
    assert sum(rec4[0]["arms"].values()) == 16
    np.testing.assert_allclose([r["loss"] for r in rec4], [r["loss"] for r in rec1], rtol=1e-5)
    for a, b in zip(rec1, rec4):
        assert a["arm_loss"].keys() == b["arm_loss"].keys() == b["arm_unigram_loss"].keys()
        np.testing.assert_allclose(list(b["arm_unigram_loss"].values()),
                                   list(a["arm_unigram_loss"].values()), rtol=1e-12)
        np.testing.assert_allclose(list(b["arm_loss"].values()), list(a["arm_loss"].values()),
                                   rtol=1e-5)
        assert a["tokens"] == b["tokens"]  # every micro-batch's tokens count
    start = Trainer(WorkerOptions(run_dir=run_dir, device="cpu"), SignalFlags())
    assert np.abs(w1 - start.model.flat.detach().numpy()).max() > 100 * ATOL, \
        "training must move the weights well past the tolerance"


@pytest.mark.slow
def test_negative_control_training_on_the_first_micro_batch_only_differs(run_dir):
    one, _ = _train(run_dir, None)
    quarter, _ = _train(run_dir, None, batch_size=4)
    diff = np.abs(quarter.model.flat.detach().numpy() - one.model.flat.detach().numpy())
    assert diff.max() > 10 * ATOL, "a quarter of the data must end measurably elsewhere"


@pytest.mark.parametrize("batch,micro,world,why", [
    (16, 0, 1, "must be >= 1"), (16, 32, 1, "larger than a rank's share"),
    (16, 5, 1, "does not divide"), (16, 8, 4, "larger than a rank's share"),
    (15, 5, 2, "not divisible by the world size"),
])
def test_a_batch_that_does_not_split_is_refused_naming_the_numbers(batch, micro, world, why):
    with pytest.raises(ConfigError, match=why) as e:
        accumulation_steps(batch, micro, world)
    assert str(micro) in str(e.value)


def test_accumulation_steps_is_the_rank_share_over_the_micro_batch():
    assert accumulation_steps(512, 16, 4) == 8
    assert accumulation_steps(16, None, 2) == 1


# ---------------------------------------------------------------- real processes, real signals
ACC = ["--max-steps", "30", "--checkpoint-every", "10", "--probe-every", "10",
       "--warmup-steps", "5", "--bandit-warmup", "0"]


@pytest.mark.slow
def test_sigterm_between_micro_batches_finishes_the_update_and_the_resume_is_bit_exact(tmp_path):
    from proc_helpers import (
        assert_same_run,
        checkpoint_steps,
        clone,
        run,
        start,
        stopped_step,
        wait_report,
    )
    tpl = create_template(tmp_path / "tpl", *ACC, "--micro-batch-size", "2")  # 8 = 4 x 2
    ref = clone(tpl, tmp_path / "ref")
    r = run(ref, *ACC)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 micro-batch(es) of 2 sequences" in r.stderr
    b = clone(tpl, tmp_path / "b")
    # the pause lasts until the SIGTERM arrives (worker/fault_injection.py), however late
    proc = start(b, *ACC, env={"ANDREA_TEST_PAUSE_AT_MICRO": "13.2:600"})
    try:
        wait_report(b, lambda x: x.get("event") == "test-pause-micro", 180,
                    "the pause after micro-batch 2 of update 13")
        proc.send_signal(signal.SIGTERM)  # arrives between micro-batches 2 and 3 of update 13
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert stopped_step(b) == 13, "the update in progress is finished, then the worker stops"
    assert 13 in checkpoint_steps(b)
    r = run(b, *ACC)
    assert r.returncode == 0, r.stderr[-3000:]
    # the worker checks the file against the checksum the proxy's scan verified, as it reads
    assert re.search(r"resumed from step_000013\.bin \(step 13\) in [0-9.]+ s \(checksum "
                     r"crc32:[0-9a-f]{8} verified on load\)", r.stderr), r.stderr[-3000:]
    assert_same_run(ref, b, 30)


def test_status_shows_tokens_and_micro_batches_per_update_and_the_projected_time():
    from proxy.commands.status import _batch_and_eta
    from shared.run.config import PRESETS, RunConfig
    cfg = RunConfig(preset="andrea-12m", model=PRESETS["andrea-12m"], batch_size=64,
                    micro_batch_size=16)
    recs = [{"step": s, "time": 1000.0 + 2.0 * s} for s in range(1, 6)]
    d = _batch_and_eta(cfg, {}, recs, 5, 105)
    assert (d["tokens_per_update"], d["micro_batches_per_update"], d["micro_batch_size"]) == \
        (65_536, 4, 16)
    assert d["seconds_per_update"] == 2.0 and d["eta_s"] == 200.0
    worker = {"world_size": 2, "accumulation_steps": 2, "micro_batch_size": 16}  # its own figures
    assert _batch_and_eta(cfg, worker, recs[:2], 2, 105)["eta_s"] is None  # too few steps yet
    assert _batch_and_eta(cfg, worker, recs, 5, 105)["micro_batches_per_update"] == 2
