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
    out = tmp_path / "figures" / "new" / "p.png"  # a folder not made yet (was a raw Errno 2)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "proxy", "plot", "--run-dir", str(run), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_series_has_ema_probe_per_arm_and_a_mixture_summing_to_one():
    recs = [{"step": k, "loss": 5.0 - k / 10, "p": {"a": 0.25, "b": 0.75},
             "probe": {"a": 3.0, "b": 4.0} if k % 5 == 0 else None} for k in range(1, 21)]
    recs[3]["loss"] = None
    s = series(recs)
    assert len(s["steps"]) == 19 and s["ema"][0] == s["loss"][0] and s["ema"][-1] > s["loss"][-1]
    assert s["probe"]["a"][0] == [5, 10, 15, 20]
    assert all(abs(a + b - 1) < 1e-12 for a, b in zip(s["mix"]["a"], s["mix"]["b"]))
