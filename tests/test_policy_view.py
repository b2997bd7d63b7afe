"""The default policy in a real run whose mixture moves (two learnable arms and base64 noise):
it reads no probe, leaves stratified only for the noise arm's share and replays exactly
(docs/bandit.md#the-default-policy), and explains itself (docs/bandit.md#reading-the-policy):
`status` and its `--json`, TensorBoard's arms/ and policy/ tags and the plot's gate marks."""
import base64
import json
import os
import random
import subprocess
import sys

import pytest

from proc_helpers import ROOT, loss_records, run_proxy
from proxy.mixture.rebuild import gate_changes, replay_run
from shared.run.config import load_run_config
from shared.run.layout import RunLayout

pytestmark = pytest.mark.slow  # a real proxy and worker, and TensorBoard's reader
# long enough for the noise arm's present rate of fall (the window over the last two doublings of
# the step) to be surely under a quarter of the others' with room to spare: about step 300 here
STEPS = 400


def _arms(d):
    rng = random.Random(0)
    (d / "noise.txt").write_text("\n".join(base64.b64encode(rng.randbytes(60)).decode()
                                           for _ in range(20000)))
    (d / "docs.txt").write_text("\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    (d / "code.txt").write_text("\n".join(p.read_text() for p in sorted((ROOT / "proxy").rglob("*.py"))))
    return [f"--arm={n}=text:{d / n}.txt" for n in ("noise", "docs", "code")]


def test_the_default_moves_only_the_noise_arms_share_replays_and_says_why(tmp_path):
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", str(STEPS), "--probe-every", "10", "--bandit-warmup", "100", "--batch-size", "16",
                  "--tensorboard", *_arms(tmp_path), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = loss_records(run)
    assert not any(x.get("probe") for x in recs)
    first = next(x["step"] for x in recs if x["p"] != recs[0]["p"])
    assert first > 100 + 10 * 4 and all(x["p"] == recs[0]["p"] for x in recs[:first - 1])
    assert recs[-1]["p"]["noise"] < recs[0]["p"]["noise"]
    assert all(x["p"][a] >= recs[0]["p"][a] - 1e-12 for x in recs for a in ("docs", "code"))
    state = json.loads((run / ".state.json").read_text())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    st = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run), "--json"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    pol = json.loads(st.stdout)["policy"]
    layout = RunLayout(run)
    cfg = load_run_config(layout.run_json)
    bandit = replay_run(layout, cfg, STEPS).bandit
    assert bandit.to_dict() == state and state["config"]["reward"] == "train_slope"
    assert pol["step"] == STEPS and pol == json.loads(json.dumps(bandit.explain()))
    assert pol["open"] and pol["bound"] > 0 and pol["why"].startswith("moved")
    noise, docs = pol["arms"]["noise"], pol["arms"]["docs"]
    assert noise["slope"] < docs["slope"] and noise["target"] < docs["target"]
    assert all(a["periods"] >= 4 and a["slope_se"] > 0 and 0 < a["epochs"] for a in pol["arms"].values())
    # the lowered arm is owed what the others took (docs/bandit.md#lowered-arms-get-their-share-back)
    assert noise["owed"] > 0 > docs["owed"] and pol["arms"]["code"]["owed"] < 0
    assert sum(a["owed"] for a in pol["arms"].values()) == pytest.approx(0.0, abs=1e-9)
    text = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60).stdout
    assert f"policy      train_slope at step {STEPS}: moved" in text and "owed" in text, text
    print(text)

    gates = gate_changes(layout, cfg)
    assert gates and gates[0][1] is True and 100 < gates[0][0] < STEPS

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    opened = [(e.step, e.value) for e in acc.Scalars("policy/gate_open")]
    assert [s for s, _ in opened] == list(range(10, STEPS + 1, 10))
    assert next(s for s, v in opened if v == 1.0) == gates[0][0]
    assert acc.Scalars("arms/slope/noise")[-1].value == pytest.approx(noise["slope"])
    assert acc.Scalars("arms/owed/noise")[-1].value == pytest.approx(noise["owed"])

    out = tmp_path / "p.png"
    p = subprocess.run([sys.executable, "-m", "proxy", "plot", "--run-dir", str(run), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and out.stat().st_size > 0 and not p.stderr.strip(), p.stderr

    # a pivot resets the bandit: a gate open at the run's end closes at the pivot's step
    assert gates[-1][1] is True, "the gate is open at the last step"
    pv = subprocess.run([sys.executable, "-m", "proxy", "pivot", "--run-dir", str(run), "--keep-bounds",
                         "--label", "polish", "--max-steps", str(STEPS + 100)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert pv.returncode == 0, pv.stdout + pv.stderr
    assert gate_changes(layout, cfg) == gates + [(STEPS, False)]
