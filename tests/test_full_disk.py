"""A full disk under a live run (a real tmpfs of a few MB, filled while it trains): one line
naming the file, a clean exit, nothing already written lost, and the same command resumes."""

import os
import subprocess
import time

import pytest

from tests.proc_helpers import loss_records, run_proxy, start_proxy, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=100M", "tmpfs", str(mnt)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and a tmpfs mount")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_is_one_line_naming_the_file_and_the_same_command_resumes(small_disk):
    run = small_disk / "run"
    plan = ["--max-steps", "100000", "--checkpoint-every", "10"]
    proc = start_proxy(run, *plan, log_name="../proxy.log")
    try:
        wait_for(lambda: len(loss_records(run)) >= 15 and (run / "step_000010.bin").exists(),
                 180, what="training and a first checkpoint")
        subprocess.run(["dd", "if=/dev/zero", f"of={small_disk / 'fill'}", "bs=1M"],
                       capture_output=True)
        assert proc.wait(timeout=180) in (1, 3)  # the proxy (1) or the worker (3) hit it first
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (small_disk.parent / "proxy.log").read_text()
    assert "Traceback" not in out, out[-3000:]
    assert "No space left on device (ENOSPC) while writing it" in out, out[-3000:]
    assert "run the same command again" in out
    steps = [r["step"] for r in loss_records(run)]
    assert steps == list(range(1, len(steps) + 1))  # valid, nothing lost
    (small_disk / "fill").unlink()
    time.sleep(0.1)
    final = steps[-1] + 5
    r = run_proxy(run, "--max-steps", str(final), "--checkpoint-every", "10", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert [x["step"] for x in loss_records(run)] == list(range(1, final + 1))
