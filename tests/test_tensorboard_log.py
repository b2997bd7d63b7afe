"""The proxy's TensorBoard event files, read back by TensorBoard's own loader.

The writer is the real one (proxy/observation/tensorboard_log.py over the `tensorboard` package); the reader
is TensorBoard's EventAccumulator, so "shows each step once" is what TensorBoard itself sees.
"""
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # imports tensorboard (about 1.5 s)

from proxy.observation.tensorboard_log import (  # noqa: E402
    PARTIAL_PREFIX,
    TensorBoardLog,
    step_scalars,
)


def _scalars(logdir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _first_run(logdir, n):
    """A first incarnation that logged steps 1..n with loss = step."""
    tb = TensorBoardLog(logdir)
    tb.start(0)
    for k in range(1, n + 1):
        tb.scalars(k, {"train/loss": float(k)})
    tb.close()


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


def test_files_made_within_one_second_are_read_in_the_order_they_were_made(tmp_path, monkeypatch):
    # Every resume below makes its files in the same second (the clock is held still), so
    # only the names' tie-break orders them; a counter compared as text ("10" before "9")
    # made the loader read the live file before the kept one and drop the resumed steps.
    import time
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    tb = TensorBoardLog(tmp_path / "tb")
    tb.start(0)
    tb.scalars(1, {"train/loss": 1.0})
    tb.scalars(2, {"train/loss": -1.0})          # abandoned by the next resume
    tb.close()
    for r in range(1, 61):                       # resume from r: step r + 1 is purged
        tb = TensorBoardLog(tmp_path / "tb")
        assert tb.start(r) == 1
        tb.scalars(r + 1, {"train/loss": float(r + 1)})
        tb.scalars(r + 2, {"train/loss": -1.0})
        tb.close()
        if r % 10 == 0:
            loss = _scalars(tmp_path / "tb", "train/loss")
            assert loss == [(k, float(k)) for k in range(1, r + 2)] + [(r + 2, -1.0)], r
    tb = TensorBoardLog(tmp_path / "tb")
    assert tb.start(61) == 1
    tb.close()
    assert _scalars(tmp_path / "tb", "train/loss") == [(k, float(k)) for k in range(1, 62)]
    assert len(list((tmp_path / "tb").iterdir())) == 2   # the kept file and the live one


def test_a_purge_killed_midway_is_completed_by_the_next_start(tmp_path):
    # kill -9 inside a purge's rewrite leaves either a half-written file or a complete kept
    # file beside the files it copied; the next start must show every step once either way.
    import shutil
    logdir = tmp_path / "tb"
    _first_run(logdir, 20)
    old = tmp_path / "old"
    shutil.copytree(logdir, old)                       # the files before the purge
    tb = TensorBoardLog(logdir)
    assert tb.start(10) > 0                            # the rewrite completes here ...
    tb.close()
    for f in old.iterdir():                            # ... but put back what it removed,
        shutil.copy(f, logdir / f.name)                # as a kill before its unlinks would
    partial = logdir / (PARTIAL_PREFIX + ".kept")
    partial.write_bytes(b"\x00" * 7)                   # and a half-written file
    tb = TensorBoardLog(logdir)
    tb.start(10)
    for k in range(11, 14):
        tb.scalars(k, {"train/loss": 100.0 + k})
    tb.close()
    assert _raw_steps(logdir, "train/loss") == list(range(1, 14))   # every step once
    assert _scalars(logdir, "train/loss") == [(k, float(k)) for k in range(1, 11)] + [
        (k, 100.0 + k) for k in range(11, 14)]
    assert not partial.exists()


def test_a_sort_killed_midway_is_done_again_by_the_next_start(tmp_path):
    # TensorBoard on for steps 1-3, off for 4-6, on again from 7: a start at 9 backfills 4-6
    # below steps the files hold, so it rewrites them sorted; killed there (SIGKILL), the next
    # start must still leave them sorted, each step once.
    import os
    import signal
    import subprocess
    import sys
    logdir, hist = tmp_path / "tb", tmp_path / ".loss.json"
    _history(hist, range(1, 10))
    tb = TensorBoardLog(logdir)
    tb.start(0)
    for k in (1, 2, 3):
        tb.scalars(k, {"train/loss": float(k)})
    tb.close()
    tb = TensorBoardLog(logdir)
    tb.start(6)
    for k in (7, 8, 9):
        tb.scalars(k, {"train/loss": float(k)})
    tb.close()
    killed = subprocess.run([sys.executable, "-c", f"""if True:
        import os, signal
        from pathlib import Path
        from proxy.observation import tensorboard_log as m
        m.TensorBoardLog._write_only = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        m.TensorBoardLog(Path({str(logdir)!r})).start(9, Path({str(hist)!r}))
        """], cwd=os.getcwd())
    assert killed.returncode == -signal.SIGKILL
    tb = TensorBoardLog(logdir)
    tb.start(9, hist)
    tb.close()
    assert _raw_steps(logdir, "train/loss") == list(range(1, 10))
    assert [s for s, _ in _scalars(logdir, "train/loss")] == list(range(1, 10))
    assert not list(logdir.glob(PARTIAL_PREFIX + "*"))


def test_a_step_without_a_finite_loss_is_backfilled_once(tmp_path):
    from shared.run.loss_history import LossHistory
    hist = tmp_path / ".loss.json"
    with LossHistory(hist) as h:
        for k in range(1, 6):
            h.append({**_rec(k, float("nan") if k == 3 else float(k)), "time": 1_700_000_000.0 + k})
    for _ in range(3):
        tb = TensorBoardLog(tmp_path / "tb")
        tb.start(5, hist)
        tb.close()
    assert _raw_steps(tmp_path / "tb", "train/lr") == [1, 2, 3, 4, 5]
    assert _raw_steps(tmp_path / "tb", "train/loss") == [1, 2, 4, 5]


def test_a_record_that_is_not_an_event_is_left_out(tmp_path):
    import struct
    logdir = tmp_path / "tb"
    _first_run(logdir, 5)
    junk = struct.pack("<Q", 3) + b"\0" * 4 + b"\xff" * 3 + b"\0" * 4   # framed, not an Event
    (logdir / "events.out.tfevents.0000000001.x.1").write_bytes(junk)
    tb = TensorBoardLog(logdir)
    assert tb.start(3) == 2                             # the purge reads past it
    tb.close()
    assert [s for s, _ in _scalars(logdir, "train/loss")] == [1, 2, 3]


def test_a_logdir_on_another_file_system_is_purged_in_place(tmp_path):
    import os
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system other than the test's tmp_path")
    import tempfile
    target = Path(tempfile.mkdtemp(dir=other))
    try:
        (tmp_path / "tb").symlink_to(target)            # RUN/tensorboard -> another disk
        tb = TensorBoardLog(tmp_path / "tb")
        tb.start(0)
        for k in range(1, 6):
            tb.scalars(k, {"train/loss": float(k)})
        tb.close()
        tb = TensorBoardLog(tmp_path / "tb")
        assert tb.start(3) == 2
        tb.close()
        assert [s for s, _ in _scalars(tmp_path / "tb", "train/loss")] == [1, 2, 3]
    finally:
        import shutil
        shutil.rmtree(target)


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


def _history(path, steps):
    from shared.run.loss_history import LossHistory
    with LossHistory(path) as h:
        for k in steps:
            h.append({**_rec(k, float(k)), "time": 1_700_000_000.0 + k})


def _raw_steps(logdir, tag):
    """Every event of `tag` in the files, duplicates included (the loader would hide some)."""
    from tensorboard.compat.proto import event_pb2

    from proxy.observation.tensorboard_log import EVENT_GLOB, read_events
    return sorted(ev.step for f in logdir.glob(EVENT_GLOB) for raw in read_events(f)
                  for ev in [event_pb2.Event.FromString(raw)] if ev.HasField("summary")
                  for v in ev.summary.value if v.tag == tag)


def test_switched_on_for_a_trained_run_it_backfills_the_history_and_its_audits(tmp_path):
    import json

    from proxy.run_files.loss_ema import loss_ema
    _history(tmp_path / ".loss.json", range(1, 13))
    audits = [{"step": s, "time": 1_700_000_000.0 + s,
               "arms": {"a": {"prompt": "def ", "text": f"x = {s}\nreturn x", "loss": 2.5}}}
              for s in (4, 8, 12)]
    (tmp_path / ".samples.json").write_text(json.dumps({"audits": audits}))
    tb = TensorBoardLog(tmp_path / "tb")
    tb.start(10, tmp_path / ".loss.json", tmp_path / ".samples.json")   # resumes from 10
    for k in (11, 12):
        tb.scalars(k, step_scalars(_rec(k, float(k)), ema=None))
    tb.close()
    loss = _scalars(tmp_path / "tb", "train/loss")
    assert loss == [(k, float(k)) for k in range(1, 13)]
    ema = dict(_scalars(tmp_path / "tb", "train/loss_ema"))
    recs = [{"loss": float(k)} for k in range(1, 11)]
    assert ema[10] == pytest.approx(loss_ema(recs))
    assert [s for s, _ in _scalars(tmp_path / "tb", "heldout/a")][:2] == [4, 5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Tensors("audit/samples")] == [4, 8]   # 12 is past the resume
    assert b"x = 8" in acc.Tensors("audit/samples")[1].tensor_proto.string_val[0]
    # switched on again at a later resume: nothing written twice
    tb = TensorBoardLog(tmp_path / "tb")
    tb.start(12, tmp_path / ".loss.json", tmp_path / ".samples.json")
    tb.close()
    assert _raw_steps(tmp_path / "tb", "train/loss") == list(range(1, 13))
    assert _raw_steps(tmp_path / "tb", "audit/samples") == [4, 8, 12]


def test_a_gap_in_the_event_files_is_filled_in_step_order(tmp_path):
    """Steps 4-6 were trained with TensorBoard off between two starts with it on: the backfill
    writes them, and the files are put in step order so the loader (which drops what follows a
    step that goes back) shows every step."""
    _history(tmp_path / ".loss.json", range(1, 10))
    tb = TensorBoardLog(tmp_path / "tb")
    tb.start(0)
    for k in (1, 2, 3, 7, 8, 9):
        tb.scalars(k, step_scalars(_rec(k, float(k)), ema=None))
    tb.close()
    tb = TensorBoardLog(tmp_path / "tb")
    tb.start(9, tmp_path / ".loss.json")
    tb.close()
    assert _raw_steps(tmp_path / "tb", "train/loss") == list(range(1, 10))
    assert [s for s, _ in _scalars(tmp_path / "tb", "train/loss")] == list(range(1, 10))
