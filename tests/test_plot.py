"""`python -m proxy plot` (docs/operations.md): a PNG of loss + EMA, pivots, probe loss, arm mixture."""
import json
import os
import subprocess
import sys

from proc_helpers import ROOT, run_proxy
from proxy.observation.plot import series
import pytest


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
    from shared.loss_history import LossHistory
    from shared.run_layout import RunLayout
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
