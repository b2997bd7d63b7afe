"""`run --wandb`: real proxies with W&B offline (`WANDB_MODE=offline`: no network, no account),
the offline runs read back from W&B's own transaction logs (`run-<id>.wandb`, W&B's protobuf
records) as `wandb sync` would upload them."""

import collections
import json
import os
import signal
from pathlib import Path

import pytest

from tests.proc_helpers import (
    ROOT,
    loss_records,
    proxy_cmd,
    run_proxy,
    start_proxy,
    wait_for,
)

pytestmark = pytest.mark.slow

pytest.importorskip("wandb")
from proxy.observation.wandb_log import history_steps  # noqa: E402

PLAN = ["--checkpoint-every", "10", "--sample-every", "10", "--eval-every", "10"]


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    """W&B offline, its settings and cache in the test's folder (nothing under ~)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))


def segments(run: Path) -> list[Path]:
    """The transaction log of each start, oldest first (W&B names folders by start time)."""
    rid = json.loads((run / "wandb" / "andrea-run.json").read_text())["id"]
    return sorted(run.glob(f"wandb/offline-run-*-{rid}/run-{rid}.wandb"))


def rows(run: Path) -> list[tuple[int, dict]]:
    return [r for f in segments(run) for r in history_steps(f)]


def assert_each_step_once_as_filed(run: Path, final: int) -> dict[int, dict]:
    got = rows(run)
    count = collections.Counter(s for s, _ in got)
    assert sorted(count) == list(range(1, final + 1)), sorted(count)
    assert not [s for s, n in count.items() if n > 1], "a step shown twice"
    by_step = dict(got)
    for rec in loss_records(run):  # W&B holds exactly the history's values
        assert by_step[rec["step"]]["train/loss"] == pytest.approx(rec["loss"], rel=1e-12)
        assert by_step[rec["step"]]["train/lr"] == pytest.approx(rec["lr"], rel=1e-12)
        for arm, v in (rec.get("eval") or {}).items():
            assert by_step[rec["step"]][f"eval/{arm}"] == pytest.approx(v, rel=1e-12)
    return by_step


def test_one_wandb_run_resumed_on_every_start_shows_each_step_once(tmp_path):
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "30", *PLAN, "--wandb")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wandb: run " in r.stderr + r.stdout
    rid = json.loads((run / "wandb" / "andrea-run.json").read_text())["id"]
    by_step = assert_each_step_once_as_filed(run, 30)
    samples = {a["step"]: a for a in json.loads((run / ".samples.json").read_text())["audits"]}
    for s in (10, 20, 30):  # the validation curve and the audit: held-out losses and a table
        row = by_step[s]
        assert {k for k in row if k.startswith("eval/")}, row.keys()
        assert {k for k in row if k.startswith("heldout/")}, row.keys()
        table = json.loads((segments(run)[0].parent / "files" / row["audit/samples"]["path"])
                           .read_text())
        assert table["columns"] == ["arm", "prompt", "text", "heldout_loss"]
        assert {(a, t) for a, _, t, _ in table["data"]} == \
            {(a, v["text"]) for a, v in samples[s]["arms"].items()}
    # a checkpoint shows at its step or, reported after later steps, at the step then logged
    ckpt = {row["checkpoint/step"]: s for s, row in by_step.items() if "checkpoint/step" in row}
    assert sorted(ckpt) == [10, 20, 30] and all(s >= c for c, s in ckpt.items()), ckpt
    assert {k for k in by_step[7] if k.startswith("arms/p/")}

    # a second start resumes the same W&B run and continues after step 30
    r = run_proxy(run, "--max-steps", "45", *PLAN, "--wandb")
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(segments(run)) == 2
    assert json.loads((run / "wandb" / "andrea-run.json").read_text())["id"] == rid
    assert_each_step_once_as_filed(run, 45)


def test_switched_on_late_it_backfills_the_history_and_its_audits(tmp_path):
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "20", *PLAN)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (run / "wandb").exists()
    r = run_proxy(run, "--max-steps", "30", *PLAN, "--wandb")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "wandb: backfilled 20 step records up to step 20" in r.stderr + r.stdout
    by_step = assert_each_step_once_as_filed(run, 30)
    assert [s for s, row in sorted(by_step.items()) if "audit/samples" in row] == [10, 20, 30]


def test_a_killed_proxy_and_a_rewind_still_show_each_step_once(tmp_path):
    """SIGKILL to the proxy mid-run: its W&B service loses what it had not written, the worker
    stops at a checkpoint and the next start rewinds the history to it; W&B then holds every
    step once, with the values the history holds."""
    run = tmp_path / "run"
    proc = start_proxy(run, "--max-steps", "100000", "--checkpoint-every", "10", "--wandb")
    try:
        wait_for(lambda: len(loss_records(run)) >= 35, 180, what="training")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # the next start waits for the killed proxy's W&B service to finish writing, then resumes
    r = run_proxy(run, "--max-steps", "60", "--checkpoint-every", "10", "--wandb", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_each_step_once_as_filed(run, 60)


def test_a_wandb_that_cannot_start_never_stops_training(tmp_path, monkeypatch):
    """Online with no account: one warning, and the run trains to its end."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "12", "--checkpoint-every", "10", "--wandb")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "wandb: could not start" in out and "training goes on without W&B" in out
    assert len(loss_records(run)) == 12


def test_without_the_package_it_names_the_install_command_and_creates_nothing(tmp_path):
    import subprocess

    fake = tmp_path / "no-wandb"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text("raise ImportError('no wandb here')\n")
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(ROOT)]))
    r = subprocess.run(proxy_cmd(run, "--max-steps", "5", "--wandb"), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install -e '.[wandb]'" in r.stderr + r.stdout
    assert not run.exists()
