"""docs/checkpoint-format.md#validity in real runs: resume picks the newest valid checkpoint, says why it
rejected the others and keeps them; retention with pinned SIGUSR1 checkpoints; a write that
fails in a real run; int32 limits refused before training.

Real proxy and worker processes on the 42,880-parameter test model; real signals and files.
"""
import os
import resource
import signal
import struct
import subprocess

import pytest

from proc_helpers import (
    ROOT,
    checkpoint_steps,
    drop_manifest_entries,
    last_step,
    loss_records,
    proxy_cmd,
    run_proxy,
    start_proxy,
    wait_for,
)
from shared.checkpoint import file_format as cf
from shared.checkpoint import manifest as cm
from shared.checkpoint import read as cread
from shared.run.config import INT32_MAX, ConfigError, ModelShape, RunConfig

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

N = 42_880


def _manifest(run):
    return {s: (e.reason, e.pinned) for s, e in cm.read_manifest(run).items()}


def _rejected_lines(out):
    return [ln for ln in out.splitlines() if " rejected step_" in ln and "(rule: " in ln]


def test_resume_rejects_bad_files_with_their_rule_keeps_them_and_ignores_other_names(tmp_path):
    run = tmp_path / "run"
    common = ["--max-steps", "20", "--checkpoint-every", "10", "--bandit-warmup", "0"]
    r = run_proxy(run, *common)
    assert r.returncode == 0, r.stderr
    assert checkpoint_steps(run) == [10, 20]
    good10 = (run / "step_000010.bin").read_bytes()

    # step 20: one flipped byte (its manifest entry no longer matches); step 15: another
    # writer's file (no manifest entry) with a header that says 16; stale temporaries and
    # unrelated names beside them.
    bad20 = bytearray((run / "step_000020.bin").read_bytes())
    bad20[8 + 4 * 100] ^= 0x10
    (run / "step_000020.bin").write_bytes(bytes(bad20))
    wrong = bytearray(good10)
    wrong[0:4] = (16).to_bytes(4, "little")
    (run / "step_000015.bin").write_bytes(bytes(wrong))
    for name in (".step_000030.bin.tmp-4242", ".step_1000000.bin.tmp-1"):
        (run / name).write_bytes(b"torn")
    unrelated = {"step_latest.bin": good10, "step_000100.bin.bak": good10,
                 "step_abc.bin": good10, "step_0000020.bin": good10}
    for name, data in unrelated.items():
        (run / name).write_bytes(data)

    r = run_proxy(run, *common)
    assert r.returncode == 0, r.stderr
    lines = _rejected_lines(r.stderr)
    assert len(lines) == 2, r.stderr
    assert "rejected step_000020.bin (rule: checksum)" in lines[0]
    assert "rejected step_000015.bin (rule: step)" in lines[1]
    assert "header step 16 differs from the name's step 15" in lines[1]
    assert "removed stale temporary .step_000030.bin.tmp-4242" in r.stderr
    assert "resume from step_000010.bin" in r.stderr
    # rejected files are kept, byte for byte, out of the way of the new step 20
    assert (run / "rejected" / "step_000020.bin").read_bytes() == bytes(bad20)
    assert (run / "rejected" / "step_000015.bin").read_bytes() == bytes(wrong)
    # unrelated names untouched, temporaries gone, training redone from step 10
    for name, data in unrelated.items():
        assert (run / name).read_bytes() == data
    assert not [n for n in os.listdir(run) if cf.is_temporary_name(n)]
    assert checkpoint_steps(run) == [10, 20]
    assert (run / "step_000010.bin").read_bytes() == good10
    cread.validate_checkpoint(run / "step_000020.bin", N, cm.read_manifest(run)[20].checksum)
    assert [x["step"] for x in loss_records(run)] == list(range(1, 21))

    # a .bin with no manifest entry (another writer's) still loads: drop the manifest
    (run / "checkpoints.json").unlink()
    r = run_proxy(run, *common)
    assert r.returncode == 0, r.stderr
    assert _rejected_lines(r.stderr) == []
    assert "already reaches --max-steps 20" in r.stderr
    assert "proxy exiting with code 0 at step 20" in r.stderr

    # history but no valid checkpoint: refuse, keep the files where they are
    for step in (10, 20):
        p = run / cf.checkpoint_name(step)
        p.write_bytes(p.read_bytes()[:1000])
    r = run_proxy(run, *common)
    assert r.returncode != 0
    assert "no valid checkpoint exists" in r.stderr and "--from-scratch" in r.stderr
    assert len(_rejected_lines(r.stderr)) == 2 and "(rule: size)" in r.stderr
    assert checkpoint_steps(run) == [10, 20]
    assert (run / "step_000010.bin").stat().st_size == 1000

    # --from-scratch starts again at step 0; the torn files are kept aside
    r = run_proxy(run, "--max-steps", "3", "--from-scratch")
    assert r.returncode == 0, r.stderr
    assert checkpoint_steps(run) == [3]
    assert sorted(os.listdir(run / "rejected")) == [
        "step_000010.bin", "step_000015.bin", "step_000020.bin", "step_000020.bin.1"]


def test_retention_in_a_real_run_keeps_last_k_every_mth_and_pinned_sigusr1(tmp_path):
    run = tmp_path / "run"
    proc = start_proxy(run, "--max-steps", "100000", "--checkpoint-every", "5",
                       "--keep-last", "2", "--keep-every", "20", "--bandit-warmup", "0")
    try:
        wait_for(lambda: last_step(run) >= 7, 180, what="training to start")
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: any(r == "sigusr1" for r, _ in _manifest(run).values()), 60,
                 what="the SIGUSR1 checkpoint")
        usr1 = next(s for s, (r, _) in _manifest(run).items() if r == "sigusr1")
        wait_for(lambda: last_step(run) >= usr1 + 32, 180, what="training to go on")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    final = loss_records(run)[-1]["step"]
    written = set(range(5, final + 1, 5)) | {usr1, final}
    expect = {usr1} | {s for s in written if s % 20 == 0} | set(sorted(written)[-2:])
    assert set(checkpoint_steps(run)) == expect
    man = _manifest(run)
    assert set(man) == expect
    assert man[usr1] == ("sigusr1", True)
    assert all(not pinned for s, (_, pinned) in man.items() if s != usr1)
    if usr1 % 20:  # the pinned one is old: neither among the last 2 nor an M-th step
        assert usr1 not in sorted(written)[-2:]


def _limit_file_size(nbytes):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))
    return set_limit


def test_failed_writes_in_a_real_run_keep_training_and_sigterm_exits_non_zero(tmp_path):
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "5", "--checkpoint-every", "5", "--bandit-warmup", "0")
    assert r.returncode == 0, r.stderr
    good5 = (run / "step_000005.bin").read_bytes()
    # Every file the proxy and worker write is capped below one checkpoint (514,568 bytes):
    # checkpoint writes fail midway with EFBIG, everything else (history, logs) still fits.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(tmp_path / "limited.log", "wb")
    proc = subprocess.Popen(proxy_cmd(run, "--max-steps", "100000", "--checkpoint-every", "5"),
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=_limit_file_size(256 * 1024))
    try:
        wait_for(lambda: last_step(run) >= 17, 240, what="training past two failed cadences")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = (tmp_path / "limited.log").read_text()
    assert rc != 0, out
    assert "checkpoint step 10 (cadence) failed" in out and "EFBIG" in out
    assert "checkpoint step 15 (cadence) failed" in out
    assert "FAILED" in out and "exiting with code 3" in out
    assert checkpoint_steps(run) == [5]
    assert (run / "step_000005.bin").read_bytes() == good5
    assert not [n for n in os.listdir(run) if cf.is_temporary_name(n)]


def test_step_or_parameter_count_beyond_int32_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", str(INT32_MAX + 1))
    assert r.returncode == 2
    assert f"max_steps={INT32_MAX + 1:,} exceeds int32" in r.stderr
    assert not run.exists()  # a refused start leaves no directory it created

    huge = ModelShape(n_layer=200, n_head=32, n_embd=1024, block_size=1024)
    cfg = RunConfig(preset="huge", model=huge)
    with pytest.raises(ConfigError) as ei:
        cfg.validate()
    assert f"{cfg.n_params:,} parameters exceed the checkpoint format's int32 limit" \
        in str(ei.value)
    with pytest.raises(cf.CheckpointError, match="n_params 2,147,483,648 is outside"):
        cf.check_int32_limits(0, INT32_MAX + 1)


@pytest.mark.slow
def test_a_resume_removes_temporaries_a_kill_left_of_the_runs_own_files_whatever_their_age(
        tmp_path):
    """A proxy (or `pivot`) killed between an atomic write and its rename leaves
    `.NAME.XXXXXXXX.tmp`. Only the lock holder writes data/ and archive/, and the root's own
    files only it or a `pivot` under the request lock, so the next start removes every such
    temporary at once; a young temporary of another name in the root (an export into the run
    directory, say) may be live and stays until it is 60 s old."""
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "2", "--checkpoint-every", "1").returncode == 0
    (run / "archive").mkdir(exist_ok=True)
    dead = [run / "data" / ".arms.json.a1b2c3d4.tmp", run / "archive" / ".x.json.e5f6g7h8.tmp",
            run / "..status.json.k9l8m7n6.tmp", run / "..pivot.request.json.piacwrp6.tmp",
            run / ".phases.json.q1w2e3r4.tmp"]
    live = run / ".model.safetensors.t5y6u7i8.tmp"
    for p in dead + [live]:
        p.write_text("{")
    r = run_proxy(run, "--max-steps", "3", "--checkpoint-every", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not [p.name for p in dead if p.exists()] and live.exists()


def _held_resume_changes_the_file(run, tmp_path, change, drop_entry=False):
    """Train to 20 (checkpoints 10, 20); start again to 30 with the worker held before it reads
    step_000020.bin, which the proxy's scan has just verified; `change` it; release.
    `drop_entry`: step 20 loses its manifest entry first (another writer's file)."""
    from proc_helpers import start
    common = ["--max-steps", "20", "--checkpoint-every", "10", "--bandit-warmup", "0"]
    r = run_proxy(run, *common)
    assert r.returncode == 0, r.stderr
    assert checkpoint_steps(run) == [10, 20]
    if drop_entry:
        drop_manifest_entries(run, [20])
    proc = start(run, *common[2:], "--max-steps", "30", env={"ANDREA_TEST_HOLD_RESUME": "1"})
    try:
        held = run / ".test-resume-held"
        wait_for(lambda: held.exists() or proc.poll() is not None, 120, what="the held resume")
        assert held.exists(), (tmp_path / "run.out").read_text(errors="replace")
        changed = change(run / "step_000020.bin")
        (run / ".test-release-resume").touch()
        assert proc.wait(timeout=300) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    return changed, (tmp_path / "run.out").read_text(errors="replace")


@pytest.mark.parametrize("how, rule", [("flip", "checksum"), ("truncate", "size")])
def test_a_checkpoint_changed_after_the_proxys_scan_is_caught_by_the_worker_and_skipped(
        tmp_path, how, rule):
    # The scan verified step_000020.bin; it changes before the worker reads it (bit rot, a
    # copy, an operator). The worker checks it against the scan's checksum, exits 1 (not
    # the fatal 3), and the proxy scans again, keeps the file in rejected/ and resumes from
    # step_000010.bin (docs/checkpoint-format.md#validity).
    run = tmp_path / "run"

    def change(p):
        data = bytearray(p.read_bytes())
        if how == "flip":
            data[8 + 4 * 1000] ^= 0x10
        else:
            data = data[: len(data) // 2]
        p.write_bytes(bytes(data))
        return bytes(data)

    changed, out = _held_resume_changes_the_file(run, tmp_path, change)
    assert f"(rule: {rule})" in out and "exiting with code 1: the proxy scans" in out, out
    assert "restart 1 of 3" in out and "cannot go on" not in out
    assert f"rejected step_000020.bin (rule: {rule})" in out
    assert "resume from step_000010.bin" in out
    assert (run / "rejected" / "step_000020.bin").read_bytes() == changed
    assert checkpoint_steps(run) == [10, 20, 30]
    assert [x["step"] for x in loss_records(run)] == list(range(1, 31))
    entries = cm.read_manifest(run)
    for s in (10, 20, 30):
        cread.validate_checkpoint(run / cf.checkpoint_name(s), N, entries[s].checksum)


def test_a_checkpoint_without_a_manifest_entry_holding_nan_is_not_resumed_from(tmp_path):
    # A .bin no checksum vouches for (its entry lost; copied in from a diverged run) is
    # checked for rule 8 at the scan: NaN in its weights rejects it, resume takes step 10,
    # and no NaN reaches a new checkpoint (docs/checkpoint-format.md#validity).
    run = tmp_path / "run"
    common = ["--max-steps", "20", "--checkpoint-every", "10", "--bandit-warmup", "0"]
    r = run_proxy(run, *common)
    assert r.returncode == 0, r.stderr
    p = run / "step_000020.bin"
    data = bytearray(p.read_bytes())
    data[8 + 4 * 7 : 8 + 4 * 8] = struct.pack("<f", float("nan"))
    p.write_bytes(bytes(data))
    drop_manifest_entries(run, [20])
    r = run_proxy(run, "--max-steps", "30", *common[2:])
    assert r.returncode == 0, r.stderr
    assert "rejected step_000020.bin (rule: values): step_000020.bin: weights[7] = nan" in r.stderr
    assert "resume from step_000010.bin" in r.stderr
    assert (run / "rejected" / "step_000020.bin").read_bytes() == bytes(data)
    entries = cm.read_manifest(run)
    assert sorted(entries) == [10, 20, 30]
    for s in (20, 30):
        _, w, m, v = cread.load_checkpoint(run / cf.checkpoint_name(s), N, entries[s].checksum)
        cread.check_values(run / cf.checkpoint_name(s), w, m, v)


def test_a_checkpoint_without_an_entry_changed_after_the_scan_is_not_trained_from_unseen(
        tmp_path):
    # No manifest checksum vouches for step_000020.bin, but the scan read it whole (rule 8)
    # and passes the checksum it computed: a finite change before the worker's read is seen
    # (rule checksum, exit 1); the new scan then judges the file as it is now.
    run = tmp_path / "run"

    def change(p):
        data = bytearray(p.read_bytes())
        data[8 + 4 * 1000] ^= 0x01  # the lowest mantissa bit of a weight: still finite
        p.write_bytes(bytes(data))
        return bytes(data)

    changed, out = _held_resume_changes_the_file(run, tmp_path, change, drop_entry=True)
    assert "(rule: checksum); exiting with code 1: the proxy scans" in out, out
    assert "restart 1 of 3" in out
    assert out.count("resume from step_000020.bin") == 2  # the second read saw these bytes
    assert [x["step"] for x in loss_records(run)] == list(range(1, 31))
