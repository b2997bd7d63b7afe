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
    with pytest.raises(ValueError):
        bench.arm_set("C", tmp_path)


def test_variant_parser_takes_run_and_bandit_knobs(bench):
    name, run, bandit = bench.parse_variant("x:warmup=0,probe_every=5,eta=0.5,progress_per_p=true")
    assert name == "x" and run == {"bandit_warmup": 0, "probe_every": 5}
    assert bandit == {"eta": 0.5, "progress_per_p": True}
    import argparse
    for bad in ("x", "x:nope=1", "x:eta=-1", "x:reward=train_loss"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_variant(bad)
