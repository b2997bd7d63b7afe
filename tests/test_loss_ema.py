"""One bias-corrected loss EMA (docs/history.md#the-loss-ema) behind every figure: the progress
line, status, the summary, plot and TensorBoard; and the summary's plain recent mean."""
import math

import pytest

from proxy.run_files.loss_ema import BETA, LossEma, loss_ema, recent_mean


def test_the_ema_is_bias_corrected_as_adams_moments():
    e = LossEma()
    assert e.value is None
    assert e.update(6.0) == pytest.approx(6.0)          # ema_1 = x_1, not 0.05 x_1
    e.update(5.0)
    m = (1 - BETA) * (BETA * 6.0 + 5.0)
    assert e.value == pytest.approx(m / (1 - BETA ** 2))
    assert e.update(float("nan")) == pytest.approx(m / (1 - BETA ** 2))   # skipped


def test_a_constant_loss_has_that_ema_from_the_first_step_on():
    e = LossEma()
    assert all(e.update(6.3) == pytest.approx(6.3) for _ in range(100))


def test_early_in_a_run_the_ema_lies_within_the_losses_seen():
    """Seeded with one old value (the first of a falling series) the EMA sat above every recent
    loss for tens of steps; the bias-corrected one is a weighted mean of the losses seen."""
    losses = [10.0 - 0.1 * i for i in range(30)]
    recs = [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]
    v = loss_ema(recs)
    assert min(losses) <= v <= max(losses)
    w = [(1 - BETA) * BETA ** (len(losses) - 1 - i) for i in range(len(losses))]
    assert v == pytest.approx(sum(a * b for a, b in zip(w, losses)) / sum(w))


def test_plot_status_and_the_live_filer_share_the_one_ema():
    from proxy.commands.status import loss_ema as status_ema
    from proxy.observation.plot import series
    recs = [{"step": i + 1, "loss": 5 + math.sin(i)} for i in range(40)]
    recs[7]["loss"] = None
    assert series(recs)["ema"][-1] == pytest.approx(loss_ema(recs))
    assert status_ema is loss_ema


def test_the_recent_mean_is_the_plain_mean_of_the_last_finite_losses():
    recs = [{"loss": x} for x in (9.0, 1.0, 2.0, float("nan"), 3.0)]
    assert recent_mean(recs, 4) == (2.0, 3)
    assert recent_mean([], 50) == (None, 0)
