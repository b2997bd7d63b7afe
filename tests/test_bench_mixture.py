"""Pure parts of scripts/bench_mixture.py: the oracle grid, the arm sets, the trap
text and the variant parser. The benchmark itself is run by hand (docs/bandit.md#how-we-show-it-works)."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_mixture", ROOT / "scripts" / "bench_mixture.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_mixture"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_oracle_grid_covers_the_box_at_step_one_tenth(bench):
    names = ["a", "b", "c"]
    g = bench.grid(names, 0.1)
    assert len(g) == 27 and len({tuple(sorted(p.items())) for p in g}) == 27
    for p in g:
        assert math.isclose(sum(p.values()), 1.0, abs_tol=1e-9)
        assert all(bench.FLOOR - 1e-12 <= v <= bench.CAP + 1e-12 for v in p.values())
    assert {"a": 0.6, "b": 0.3, "c": 0.1} in g and {"a": 0.6, "b": 0.4, "c": 0.0} not in g
    assert len(bench.grid(names + ["d"], 0.1)) == 80


def test_arm_sets_are_local_and_different(bench, tmp_path):
    a, b = bench.arm_set("A", tmp_path), bench.arm_set("B", tmp_path)
    assert {x.name for x in a}.isdisjoint({x.name for x in b}) and len(b) == 3
    trap = bench.arm_set("trap", tmp_path)
    assert trap[:3] == a and trap[3].name == bench.TRAP
    text = Path(trap[3].source).read_text()
    assert text.startswith("- item 0: region region region\n")
    c = bench.arm_set("C", tmp_path)
    assert len(c) == 3 and {x.name for x in c} != {x.name for x in b} and "charmaps" in {x.name for x in c}
    import glob
    assert all(glob.glob(x.source, recursive=True) for x in c)
    with pytest.raises(ValueError):
        bench.arm_set("D", tmp_path)


def test_variant_parser_takes_run_and_bandit_knobs(bench):
    name, run, bandit = bench.parse_variant("x:warmup=0,probe_every=5,eta=0.5,progress_per_p=true")
    assert name == "x" and run == {"bandit_warmup": 0, "probe_every": 5}
    assert bandit == {"eta": 0.5, "progress_per_p": True}
    import argparse
    for bad in ("x", "x:nope=1", "x:eta=-1", "x:reward=train_loss"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_variant(bad)


def test_smoothed_oracle_recovers_a_known_surface_and_names_the_winners_curse(bench):
    """The quadratic fit finds the minimum of a known bowl from noisy cells, and says how much
    of the best cell's lead noise alone would give (docs/bandit.md#how-we-show-it-works)."""
    import random
    names = ["a", "b", "c"]
    seeds = [1, 2, 3, 4, 5]
    rng = random.Random(0)

    def true(p):
        return 2.0 + 0.5 * (p["a"] - 0.5) ** 2 + 0.5 * (p["b"] - 0.3) ** 2 + 0.5 * (p["c"] - 0.2) ** 2
    res, rows = {}, []
    for p in bench.grid(names, 0.1) + [{n: 1 / 3 for n in names}]:
        lab = "stratified" if abs(p["a"] - 1 / 3) < 1e-9 else bench.mix_label(p, names)
        runs = [{"h": {n: true(p) + 0.01 * s + rng.gauss(0, 0.002) for n in names}} for s in seeds]
        res[lab] = {"runs": runs, "means": [sum(r["h"].values()) / 3 for r in runs]}
        if lab != "stratified":
            rows.append((lab, p))
    sm = bench.smoothed_oracle(res, rows, names, seeds, 0.0)
    assert abs(sm["mix"]["a"] - 0.5) <= 0.03 and abs(sm["mix"]["b"] - 0.3) <= 0.03, sm["mix"]
    want = true({n: 1 / 3 for n in names}) - true({"a": 0.5, "b": 0.3, "c": 0.2})
    assert sm["gain"] == pytest.approx(want, abs=0.002)
    assert 0 < sm["cell_se"] < 0.01 and sm["null_max"] > sm["cell_se"]


@pytest.mark.slow
def test_evaluation_windows_lie_in_the_scattered_heldout_ranges_clear_of_every_probe(bench, tmp_path):
    """On a real run (held-out split in several ranges over the arm), the benchmark's scoring
    windows are inside the held-out ranges, never overlap one another or any probe window the
    worker could use (1..8 sequences). Failed before: eval_windows assumed a tail split."""
    from proxy.supervision.run_setup import create_run
    from shared.arm_data import read_arm_index
    from shared.config import PRESETS, RunConfig
    from shared.run_layout import RunLayout
    from worker.data import ArmSampler
    layout = RunLayout(tmp_path / "run")
    cfg = create_run(layout, RunConfig(preset="andrea-test", model=PRESETS["andrea-test"],
                                       tokenizer="bytes", arms=bench.arm_set("A", tmp_path)))
    index = read_arm_index(layout)
    sampler = ArmSampler(layout.root, index, cfg.model.block_size)
    w = cfg.model.block_size + 1
    for n in sampler.names:
        assert len(sampler.heldout[n]) > 1, "the run must have a scattered split for this test"
        assert 1.5 < index[n].compression < 20, (n, index[n].compression)  # measured at creation
        wins, tiles = bench.eval_windows(sampler, n, 0, range(1, 9))
        assert wins.shape == (tiles, w) and tiles > 100
        probes = {s for k in range(1, 9) for s in sampler.heldout_starts(n, k)}
        toks = sampler.tokens[n]
        starts = [s for a, b in sampler.heldout[n] for s in range(a, b - w + 1, w)
                  if all(s + w <= p or s >= p + w for p in probes)]
        assert len(starts) == tiles
        for row, s in zip(wins[:50], starts[:50]):
            assert (row.numpy() == toks[s:s + w]).all()
        assert sampler.heldout_windows(n, 8).tolist() == [list(toks[s:s + w]) for s in sampler.heldout_starts(n, 8)]


@pytest.mark.slow
def test_benchmark_runs_the_trap_set_and_the_guard_holds_the_trap():
    """The benchmark end to end on the collapse-trap set (short): its RESULT line, every posted
    p in its box, and the default never raises the list-like arm after the warm-up (the
    repetition guard, docs/bandit.md#the-repetition-guard), while the same policy with the
    guard off does raise it (the trap is real)."""
    import json
    import subprocess
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_mixture.py"), "--sets", "trap",
                          "--steps", "120", "--seeds", "1", "--policies", "stratified", "default",
                          "--bandit-warmup", "20"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    res = [json.loads(l[len("RESULT "):]) for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert len(res) == 1 and res[0]["set"] == "trap" and res[0]["box_ok"] is True
    assert res[0]["trap_raised"] is False and res[0]["trap_p_max_after_warmup"] <= res[0]["trap_p_start"]
    noguard = [l for l in out.stdout.splitlines() if l.startswith("default[no guard] vs stratified")]
    assert len(noguard) == 1 and noguard[0].endswith("(raised: True)"), noguard


def test_target_verdict_names_every_missed_condition_and_the_oracles_feasibility(bench):
    """RESULT says whether point 3's target is met and why not (docs/bandit.md#how-we-show-it-works)."""
    good = {"t": -3.4, "captured": 0.6, "worst_delta": 0.001, "box_ok": True,
            "t_best_fixed_in_limits": -4.0}
    v = bench.target_verdict(good)
    assert v == {"target_met": True, "target_misses": [], "oracle_in_limits_meets_t": True}
    v = bench.target_verdict({"t": 3.6, "captured": None, "worst_delta": 0.0066, "box_ok": False,
                              "t_best_fixed_in_limits": -0.8})
    assert not v["target_met"] and len(v["target_misses"]) == 4
    assert not v["oracle_in_limits_meets_t"]
    # a border case on each limit is inside it; a NaN t (one seed) is a miss
    assert bench.target_verdict({"t": -3.0, "captured": 0.5, "worst_delta": 0.005, "box_ok": True})["target_met"]
    assert not bench.target_verdict({"t": float("nan"), "captured": 0.9, "worst_delta": 0.0,
                                     "box_ok": True})["target_met"]
    assert "oracle_in_limits_meets_t" not in bench.target_verdict(good | {"t_best_fixed_in_limits": None})
