"""Bad numbers are refused before anything is created or started
(docs/architecture.md#bad-input-and-faults): a negative seed, for one, never reaches run.json."""
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


@pytest.mark.parametrize("option,name", [
    ("--batch-size", "batch_size"), ("--checkpoint-every", "checkpoint_every"),
    ("--probe-every", "probe_every"), ("--sample-every", "sample_every")])
def test_a_zero_cadence_or_batch_is_a_clear_error_not_a_division_by_zero(tmp_path, option, name):
    """A zero --batch-size or cadence (checkpoints, probes, audits) is refused with one line
    naming the option (exit 2) before anything is created, never reaching the audit and probe
    cost arithmetic, which divides by them."""
    run = tmp_path / "run"
    r = run_proxy(run, option, "0", "--max-steps", "5", timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{name}=0 ({option}) must be >= 1" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (run / "run.json").exists()


def test_a_cuda_device_that_is_not_there_is_refused_before_the_run_directory_exists(tmp_path):
    """`--device cuda` on a machine without one is exit 2 before anything is created (a
    configuration error, found before the run is tokenized); cuda:N past the devices there is
    refused the same way on any machine."""
    import torch
    run = tmp_path / "run"
    device = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    r = run_proxy(run, "--device", device, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"--device {device}:" in r.stderr and "Traceback" not in r.stderr
    assert not run.exists(), "nothing may be created for a refused command"


def test_a_new_run_is_not_created_among_someone_elses_files(tmp_path):
    """`run --run-dir` on an existing directory of other files (a home or source folder)
    silently created a run in it, scattering run files among them; `fork` already refused.
    It is refused naming the files; an interrupted creation (only a run's names) goes on."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    (d / "src").mkdir()
    r = run_proxy(d, "--max-steps", "2", timeout=60)
    assert r.returncode == 2 and "holds files that are not a run's (notes.txt, src/)" in r.stderr
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt", "src"]
    half = tmp_path / "half"
    (half / "logs").mkdir(parents=True)  # what a refused or stopped creation leaves
    (half / ".proxy.owner.json").write_text("{}")
    r = run_proxy(half, "--max-steps", "2", timeout=120)
    assert r.returncode == 0 and (half / "run.json").exists(), r.stderr[-2000:]


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


def test_the_creating_command_with_caps_and_floors_resumes_and_other_bounds_are_refused(tmp_path):
    """Running the creating command again (README: "run the same command again to resume";
    Slurm requeues and systemd restarts do exactly that) resumes a run created with --caps or
    --floors: the phase's own values go on; other values are a pivot and are refused, naming
    the phase's values and the real run directory."""
    run = tmp_path / "run"
    bounds = ["--caps", "repo-code=0.5", "--floors", "python-docs=0.1"]
    r = run_proxy(run, *bounds, "--max-steps", "4", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_proxy(run, *bounds, "--max-steps", "6", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((run / ".loss.json").read_text())[-1]["step"] == 6
    r = run_proxy(run, "--caps", "repo-code=0.4", "--max-steps", "8", timeout=120)
    assert r.returncode == 2
    assert "has --caps repo-code=0.5" in r.stderr and f"pivot --run-dir {run} --caps repo-code=0.4" \
        in r.stderr, r.stderr[-2000:]
    assert json.loads((run / ".loss.json").read_text())[-1]["step"] == 6


def test_a_malformed_device_is_refused_not_restarted(tmp_path):
    """--device bogus is refused before anything is created (exit 2), so the worker is never
    started and restarted with back-off for it, nor the run restarted forever by systemd (a
    CUDA device that is not there: the test above)."""
    run = tmp_path / "run"
    r = run_proxy(run, "--device", "bogus", "--max-steps", "3", timeout=60)
    assert r.returncode == 2 and "--device bogus: choose auto, cpu, cuda or cuda:N" in r.stderr
    assert not (run / "run.json").exists()
