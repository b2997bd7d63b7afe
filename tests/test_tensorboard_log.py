"""The proxy's TensorBoard event files, read back by TensorBoard's own loader.

The writer is the real one (proxy/observation/tensorboard_log.py over the `tensorboard` package); the reader
is TensorBoard's EventAccumulator, so "shows each step once" is what TensorBoard itself sees.
"""
import pytest

pytestmark = pytest.mark.slow  # imports tensorboard (about 1.5 s)

from proxy.observation.tensorboard_log import TensorBoardLog, step_scalars  # noqa: E402


def _scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _rec(step, loss):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1e4,
            "mfu": 0.3, "p": {"a": 0.25, "b": 0.75}, "probe": {"a": 2.0} if step % 5 == 0 else {}}


def test_resume_from_an_older_step_shows_every_step_once(tmp_path):
    tb = TensorBoardLog(tmp_path / "tb")
    tb.start(0)
    for k in range(1, 21):                       # first start: steps 1..20, loss = k
        tb.scalars(k, step_scalars(_rec(k, float(k)), ema=float(k)))
    tb.close()                                  # a crash after step 20, resume from 10
    tb = TensorBoardLog(tmp_path / "tb")
    assert tb.start(10) > 0
    for k in range(11, 16):                      # the resumed steps have other values
        tb.scalars(k, step_scalars(_rec(k, 100.0 + k), ema=None))
    tb.close()
    loss = _scalars(tmp_path / "tb", "train/loss")
    assert [s for s, _ in loss] == list(range(1, 16))
    assert [v for _, v in loss] == [float(k) for k in range(1, 11)] + [100.0 + k for k in range(11, 16)]
    assert [s for s, _ in _scalars(tmp_path / "tb", "heldout/a")] == [5, 10, 15]
    assert [s for s, _ in _scalars(tmp_path / "tb", "arms/p/b")] == list(range(1, 16))


def test_a_plain_resume_rewrites_nothing(tmp_path):
    tb = TensorBoardLog(tmp_path / "tb")
    tb.start(0)
    for k in range(1, 6):
        tb.scalars(k, {"train/loss": float(k), "skipped": float("nan"), "text": "x"})
    tb.close()
    before = sorted(p.name for p in (tmp_path / "tb").iterdir())
    tb = TensorBoardLog(tmp_path / "tb")
    assert tb.start(5) == 0
    tb.scalars(6, {"train/loss": 6.0})
    tb.close()
    assert set(before) <= {p.name for p in (tmp_path / "tb").iterdir()}
    assert [s for s, _ in _scalars(tmp_path / "tb", "train/loss")] == [1, 2, 3, 4, 5, 6]
