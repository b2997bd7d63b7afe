"""`python -m proxy plot` (docs/operations.md): a PNG of loss + EMA, pivots, probe loss, arm mixture."""
import json
import os
import subprocess
import sys

import pytest

from proc_helpers import ROOT, run_proxy
from proxy.observation.plot import series
from proxy.run_files.loss_ema import loss_ema


@pytest.mark.slow
def test_plot_writes_a_png_with_the_pivot_marked(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "30", "--checkpoint-every", "10", "--probe-every", "5").returncode == 0
    ph = json.loads((run / "phases.json").read_text())
    ph["phases"].append(dict(ph["phases"][0], index=1, label="v2", start_step=20))
    (run / "phases.json").write_text(json.dumps(ph))
    out = tmp_path / "figures" / "new" / "p.png"  # a folder not made yet: plot makes it
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "proxy", "plot", "--run-dir", str(run), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"plot: wrote {out}"
    _assert_a_drawn_figure(out)


def _assert_a_drawn_figure(png):
    """The PNG read back: 10 x 10 inches at 100 dpi, and drawn on (lines, areas and text give
    hundreds of distinct colours; a blank or failed figure has a handful)."""
    import matplotlib.image
    import numpy as np
    img = matplotlib.image.imread(png)
    assert img.shape[:2] == (1000, 1000), img.shape
    colours = np.unique(img.reshape(-1, img.shape[-1]), axis=0)
    assert len(colours) > 200, len(colours)


def test_plot_run_draws_the_history_and_the_phases_of_a_run(tmp_path):
    """plot_run on a run directory written by the run files' own writers: the PNG it returns is
    a drawn 1000 x 1000 figure."""
    from proxy.observation.plot import plot_run
    from proxy.run_files.phases import Phase, write_phases
    from shared.run.layout import RunLayout
    from shared.run.loss_history import LossHistory
    layout = RunLayout(tmp_path / "run")
    layout.ensure()
    with LossHistory(layout.loss) as h:
        for k in range(1, 61):
            h.append({"step": k, "loss": 6.0 - k / 20, "phase": {"index": int(k > 30)},
                      "p": {"a": 0.3, "b": 0.7}, "probe": {"a": 5.0, "b": 4.0} if k % 10 == 0 else None})
    write_phases(layout, [Phase(0, "initial", 0), Phase(1, "v2", 30)])
    out = plot_run(layout.root)
    assert out == layout.root / "loss.png"
    _assert_a_drawn_figure(out)


def test_plot_series_has_ema_probe_per_arm_and_a_mixture_summing_to_one():
    recs = [{"step": k, "loss": 5.0 - k / 10, "p": {"a": 0.25, "b": 0.75},
             "probe": {"a": 3.0, "b": 4.0} if k % 5 == 0 else None} for k in range(1, 21)]
    recs[3]["loss"] = None
    s = series(recs)
    assert len(s["steps"]) == 19 and s["ema"][0] == s["loss"][0] and s["ema"][-1] > s["loss"][-1]
    assert s["probe"]["a"][0] == [5, 10, 15, 20]
    assert all(abs(a + b - 1) < 1e-12 for a, b in zip(s["mix"]["a"], s["mix"]["b"]))


def _records(n, spike_at=None):
    """n records in step order, as a generator (nothing held): a falling loss, a NaN every
    1,000 steps, a mixture of two arms (a third from step n/2), a probe every 10 steps."""
    for k in range(1, n + 1):
        r = {"step": k, "loss": 5.0 - k / n + (k % 7) / 100, "p": {"a": 0.25, "b": 0.75}}
        if k > n // 2:
            r["p"] = {"a": 0.2, "b": 0.3, "c": 0.5}
        if k % 1000 == 0:
            r["loss"] = float("nan")
        if k == spike_at:
            r["loss"] = 50.0
        if k % 10 == 0:
            r["probe"] = {"a": 3.0 + k / n}
        if k in (17, n - 3):
            r["alarm"] = "collapse"
        yield r


def test_plot_series_of_a_long_history_stays_within_max_points_and_keeps_its_extremes():
    """Past max_points the series are buckets: at most max_points of them, the spike and the
    lowest loss kept in the band, the mean of the losses and the final EMA exact, each
    bucket's mixture summing to one (an arm that appears later counts 0 before)."""
    n, cap = 30_001, 64
    s = series(_records(n, spike_at=12_345), max_points=cap)
    losses = [r["loss"] for r in _records(n, spike_at=12_345) if r["loss"] == r["loss"]]
    assert s["count"] == len(losses) == n - 30
    for key in ("steps", "loss", "loss_low", "loss_high", "ema"):
        assert cap // 2 < len(s[key]) <= cap, (key, len(s[key]))
    assert max(s["loss_high"]) == 50.0 and min(s["loss_low"]) == min(losses)
    sizes = [s["width"]] * (len(s["steps"]) - 1)
    sizes.append(s["count"] - sum(sizes))
    assert sum(m * c for m, c in zip(s["loss"], sizes)) == pytest.approx(sum(losses), rel=1e-9)
    assert s["ema"][-1] == pytest.approx(loss_ema(_records(n, spike_at=12_345)))
    assert s["steps"] == sorted(s["steps"]) and s["steps"][0] == 1
    assert len(s["mix_steps"]) <= cap and len(s["probe"]["a"][0]) <= cap
    assert s["mix"]["c"][0] == 0.0 and s["mix"]["c"][-1] == pytest.approx(0.5)
    for i in range(len(s["mix_steps"])):
        assert sum(s["mix"][a][i] for a in ("a", "b", "c")) == pytest.approx(1.0)
    assert s["alarms"][0] == 17 and s["alarms"][-1] <= n - 3


def test_plot_reads_a_long_history_in_memory_that_does_not_grow_with_it(tmp_path):
    """read_series streams the file: the Python heap's peak while reading 60,000 records is
    below 4 MiB (the records as a list: 37 MiB)."""
    import tracemalloc

    from proxy.observation.plot import read_series
    from shared.run.loss_history import LossHistory

    path = tmp_path / ".loss.json"
    with LossHistory(path) as h:
        h.append_many(_records(60_000))
    tracemalloc.start()
    try:
        s = read_series(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert s["count"] == 60_000 - 60 and len(s["steps"]) <= 2048
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB"
