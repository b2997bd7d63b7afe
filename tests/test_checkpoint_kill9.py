"""docs/checkpoint-format.md#atomic-write: a kill -9 at any instant of a write leaves only valid step_*.bin.

A real child process writes checkpoints of a 3,000,000-parameter model (36 MB files) in a
loop, as the worker's writer does (write_checkpoint_image from the file-image host buffer,
alternating with write_checkpoint of three arrays; then the manifest entry, then the worker's
retention, which retires the oldest doomed file for the next image write to overwrite),
and is killed with SIGKILL at random moments. After every kill each visible
``step_*.bin`` must validate (size, header, n_params, and the manifest checksum where the
manifest has an entry); temporaries may be left, and the next start removes them.
"""
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from proc_helpers import ROOT
from shared.checkpoint import directory as cdir
from shared.checkpoint import file_format as cf
from shared.checkpoint import manifest as cm
from shared.checkpoint import read as cread
from shared.checkpoint import write as cw

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

N_PARAMS = 3_000_000
KILLS = 24

# The writer child: clean stale temporaries (as every start does), announce, then write
# checkpoint after checkpoint, each followed by its manifest entry and retention.
CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from shared.checkpoint import directory as cdir, manifest as cm, write as cw
    from shared.checkpoint.retention import apply_retention
    run_dir, n, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cdir.clean_stale_temporaries(run_dir)
    rng = np.random.default_rng(first)
    image = cw.alloc_checkpoint_image(n)   # the worker's host buffer (O_DIRECT path)
    w, m, v = cw.image_arrays(image)
    for a in (w, m, v):
        a[:] = rng.standard_normal(n, dtype=np.float32)
    print("ready", flush=True)
    step = first
    while True:
        w[step % n] = step  # every file differs
        if step % 2:   # both writers: the worker's image path and the generic array path
            path, nbytes, checksum = cw.write_checkpoint_image(run_dir, step, image)
        else:
            path, nbytes, checksum = cw.write_checkpoint(run_dir, step, w, m, v)
        cm.record_checkpoint(run_dir, cm.ManifestEntry(
            step=step, file=path.name, nbytes=nbytes, checksum=checksum,
            reason="sigusr1" if step % 7 == 0 else "cadence", pinned=step % 7 == 0,
            time=time.time()))
        apply_retention(run_dir, n, 2, 0)   # the worker's: the oldest doomed file is reused
        step += 1
""")


def _check_every_visible_checkpoint(run_dir):
    """Validate every step_*.bin; return (steps, temporaries present)."""
    entries = cm.read_manifest(run_dir)
    steps = []
    for step, path in cdir.list_checkpoints(run_dir):
        want = entries[step].checksum if step in entries else None
        info = cread.validate_checkpoint(path, N_PARAMS, want)   # raises on a torn file
        assert info.step == step
        steps.append(step)
    temps = [n for n in os.listdir(run_dir) if cf.is_temporary_name(n)]
    return steps, temps


def test_sigkill_at_random_moments_during_writes_leaves_only_valid_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rng = random.Random(1234)
    first, kills_mid_write, retired_seen = 1, 0, 0
    seen_steps: set[int] = set()
    for _ in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), str(N_PARAMS),
                                 str(first)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            # Let this child finish one write first, so the run always makes progress however
            # slow the disk is right now (a loaded CI machine's fsync can take many times what
            # it took a moment ago), and time that write to place the kill.
            started = time.monotonic()
            while first not in dict(cdir.list_checkpoints(run_dir)) and proc.poll() is None:
                assert time.monotonic() - started < 120, "no checkpoint written in 120 s"
                time.sleep(0.005)
            write_seconds = max(0.02, time.monotonic() - started)
            # then kill at a random instant of the writes that follow
            time.sleep(rng.uniform(0.0, 2.0 * write_seconds))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
        steps, temps = _check_every_visible_checkpoint(run_dir)
        kills_mid_write += bool(temps)
        retired_seen += (run_dir / cw.RECYCLED_NAME).exists()
        seen_steps.update(steps)
        assert first in steps or any(s > first for s in steps), (first, steps)
        first = max(steps) + 1
    # the kills did land inside writes (a temporary was left behind), and writes did finish
    assert kills_mid_write >= 1, f"none of {KILLS} kills hit a write in progress"
    assert len(seen_steps) >= KILLS
    assert retired_seen >= 1, "retention never left a file for the next write to reuse"
    # a start removes the stale temporaries and touches nothing else
    before = sorted(n for n in os.listdir(run_dir) if not cf.is_temporary_name(n))
    cdir.clean_stale_temporaries(run_dir)
    assert sorted(os.listdir(run_dir)) == before
    info, rejected = cdir.scan_for_resume(run_dir, N_PARAMS,
                                        cm.manifest_checksums(cm.read_manifest(run_dir)))
    assert rejected == [] and info is not None
