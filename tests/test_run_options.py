"""Bad numbers are refused before anything is created or started (docs/architecture.md#bad-input-and-faults), found by a
new-user session: a negative seed used to be saved in run.json and crash-loop every later run."""
import json

import pytest

from proc_helpers import run_proxy

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes


@pytest.mark.parametrize("option,value", [
    ("--seed", "-1"), ("--hang-timeout", "0"), ("--stop-timeout", "-1"), ("--keep-every", "-3"),
    ("--keep-last", "1"), ("--print-every", "0"), ("--max-restarts", "-1"), ("--max-steps", "0"),
])
def test_bad_supervision_number_is_refused_before_the_run_directory_exists(tmp_path, option, value):
    run = tmp_path / "run"
    r = run_proxy(run, option, value, timeout=60)
    assert r.returncode == 2
    assert option in r.stderr and value in r.stderr
    assert not run.exists(), "nothing may be created for a refused command"


def test_a_run_shorter_than_the_warmup_gets_a_warmup_that_fits(tmp_path):
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "20", "--checkpoint-every", "10", timeout=120)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((run / "run.json").read_text())
    assert cfg["warmup_steps"] == 2 and cfg["lr_decay_steps"] == 20
    records = json.loads((run / ".loss.json").read_text())
    lrs = [x["lr"] for x in records]
    assert max(lrs) == pytest.approx(cfg["lr"]) and lrs.index(max(lrs)) == 1  # peak at step 2
    assert lrs[-1] == pytest.approx(cfg["lr"] * cfg["min_lr_ratio"])
