"""Dropout's masks follow from the run seed and the step (docs/architecture.md, Determinism), so a
run resumed from a checkpoint trains bit-identically to an uninterrupted one with dropout on too.
In-process: a real run directory (created as `run` creates it), the real Trainer, real updates
and a real checkpoint file on CPU; each Trainer starts from the same global RNG state, as a fresh
worker process does."""
import json
from pathlib import Path

import pytest
import torch

from proc_helpers import create_template
from shared.checkpoint.write import write_checkpoint
from worker.signals import SignalFlags
from worker.trainer import Trainer, WorkerOptions

FRESH_PROCESS_SEED = 67280421310721  # torch's default seed: a new worker's global RNG state
STEPS, STOP = 4, 2


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(tmp_path: Path, dropout: float) -> Path:
    run = create_template(tmp_path / f"run-{dropout}", "--batch-size", "2", "--max-steps", "100",
                          "--probe-every", "1000", "--checkpoint-every", "1000",
                          "--sample-every", "1000")
    cfg = json.loads((run / "run.json").read_text())
    cfg["dropout"] = dropout  # no `run` option sets it; run.json does
    (run / "run.json").write_text(json.dumps(cfg))
    return run


def _trainer(run: Path, resume_from: Path | None = None) -> Trainer:
    torch.manual_seed(FRESH_PROCESS_SEED)
    return Trainer(WorkerOptions(run_dir=run, device="cpu", resume_from=resume_from),
                   SignalFlags())


def _steps(t: Trainer, ks) -> list[float]:
    probs = {n: 1.0 / len(t.sampler.names) for n in t.sampler.names}
    return [t.train_step(k, probs)["loss"] for k in ks]


def test_a_resumed_run_with_dropout_trains_bit_identically_to_an_uninterrupted_one(tmp_path):
    run = _run(tmp_path, 0.2)
    whole = _trainer(run)
    assert whole.cfg.dropout == 0.2
    losses = _steps(whole, range(1, STEPS + 1))
    first = _trainer(run)
    assert _steps(first, range(1, STOP + 1)) == losses[:STOP]
    path, _, _ = write_checkpoint(run, STOP, first.model.flat.numpy(), first.opt.m.numpy(),
                                  first.opt.v.numpy(), fsync=False)
    resumed = _trainer(run, resume_from=path)
    assert resumed.step == STOP
    assert _steps(resumed, range(STOP + 1, STEPS + 1)) == losses[STOP:]
    for a, b in ((whole.model.flat, resumed.model.flat), (whole.opt.m, resumed.opt.m),
                 (whole.opt.v, resumed.opt.v)):
        assert torch.equal(a, b)


def test_dropout_is_on_in_that_run(tmp_path):
    # the control: the same steps without dropout train differently, so the test above
    # compares runs whose masks matter
    with_dropout = _steps(_trainer(_run(tmp_path, 0.2)), range(1, STEPS + 1))
    without = _steps(_trainer(_run(tmp_path, 0.0)), range(1, STEPS + 1))
    assert with_dropout != without
