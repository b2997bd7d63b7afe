"""docs/checkpoint-format.md: the worker's background checkpoint writer (worker/checkpointer.py).

Real files, real threads; write failures are real kernel errors (a file-size limit set with
setrlimit in a child process makes write(2) fail midway with EFBIG), and the free-space check
is fed a small figure at its dependency (shutil.disk_usage).
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import torch

from proc_helpers import ROOT
from shared.checkpoint import directory as cdir
from shared.checkpoint import file_format as cf
from shared.checkpoint import manifest as cm
from shared.checkpoint import read as cread
from shared.checkpoint import write as cw
from worker import checkpointer as ck
from worker.checkpointer import Checkpointer


def _state(n, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, generator=g) for _ in range(3))


def _file_arrays(path, n):
    step, w, m, v = cread.load_checkpoint(path, n, values=False)  # random states: v < 0 too
    return step, w.copy(), m.copy(), v.copy()


def test_snapshot_copies_the_state_so_training_can_change_it_during_the_write(tmp_path):
    n = 200_000
    w, m, v = _state(n, 0)
    expect = [t.clone().numpy() for t in (w, m, v)]
    done = []
    c = Checkpointer(tmp_path, n, keep_last=2, keep_every=0, on_done=done.append)
    held = c.snapshot(10, w, m, v, "cadence")
    assert isinstance(held, float) and held >= 0.0
    for t in (w, m, v):          # "training" goes on while the file is being written
        t.add_(1.0)
    r = c.wait()
    assert r.error is None and done == [r] and r.step == 10 and r.nbytes == 8 + 12 * n
    step, *arrays = _file_arrays(tmp_path / "step_000010.bin", n)
    assert step == 10
    for got, want in zip(arrays, expect):
        np.testing.assert_array_equal(got, want)
    entry = cm.read_manifest(tmp_path)[10]
    assert entry.checksum == "crc32:%08x" % zlib.crc32((tmp_path / "step_000010.bin").read_bytes())
    assert (entry.reason, entry.pinned) == ("cadence", False)


def test_back_to_back_snapshots_write_one_at_a_time_and_both_land(tmp_path):
    n = 100_000
    c = Checkpointer(tmp_path, n, keep_last=3, keep_every=0)
    w, m, v = _state(n, 1)
    c.snapshot(1, w, m, v, "cadence")
    w2 = w + 5
    c.snapshot(2, w2, m, v, "sigusr1")   # waits for write 1, then starts write 2
    assert c.wait().step == 2
    np.testing.assert_array_equal(_file_arrays(tmp_path / "step_000001.bin", n)[1], w.numpy())
    np.testing.assert_array_equal(_file_arrays(tmp_path / "step_000002.bin", n)[1], w2.numpy())
    man = cm.read_manifest(tmp_path)
    assert [(s, e.reason, e.pinned) for s, e in sorted(man.items())] == [
        (1, "cadence", False), (2, "sigusr1", True)]


def test_retention_keeps_last_k_multiples_and_pinned_and_ignores_foreign_files(tmp_path):
    n = 1000
    c = Checkpointer(tmp_path, n, keep_last=2, keep_every=30)
    w, m, v = _state(n, 2)
    cw.write_checkpoint(tmp_path, 5, w.numpy(), m.numpy(), v.numpy())  # another writer's
    for step in range(10, 101, 10):
        c.snapshot(step, w, m, v, "sigusr1" if step == 40 else "cadence")
    c.wait()
    assert [s for s, _ in cdir.list_checkpoints(tmp_path)] == [5, 30, 40, 60, 90, 100]
    assert sorted(cm.read_manifest(tmp_path)) == [30, 40, 60, 90, 100]


def test_short_disk_applies_retention_then_fails_without_touching_files(tmp_path, monkeypatch):
    n = 1000
    done = []
    c = Checkpointer(tmp_path, n, keep_last=2, keep_every=0, on_done=done.append)
    w, m, v = _state(n, 3)
    for step in (10, 20, 30):
        c.snapshot(step, w, m, v, "cadence")
        c.wait()
    c.keep_last = 3  # nothing is doomed by the plan alone...
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    real = shutil.disk_usage
    monkeypatch.setattr(ck.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=ck.DISK_MARGIN_BYTES // 2))
    c.snapshot(40, w + 1, m, v, "cadence")
    r = c.wait()
    monkeypatch.undo()
    assert r.error is not None and r.path is None
    assert "bytes free" in r.error and "free disk space" in r.error
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before                       # nothing written, nothing harmed
    assert not any(cf.is_temporary_name(x) for x in os.listdir(tmp_path))
    # the next cadence, with space again, succeeds
    c.snapshot(50, w, m, v, "cadence")
    assert c.wait().error is None
    assert [s for s, _ in cdir.list_checkpoints(tmp_path)] == [20, 30, 50]


# A child with a real file-size limit: write(2) fails with EFBIG halfway through the file.
FSIZE_CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch
    from worker.checkpointer import Checkpointer
    run_dir, n = sys.argv[1], int(sys.argv[2])
    out = []
    c = Checkpointer(run_dir, n, keep_last=2, keep_every=0,
                     on_done=lambda r: out.append([r.step, r.error]))
    w, m, v = (torch.full((n,), float(i)) for i in (1, 2, 3))
    c.snapshot(10, w, m, v, "cadence"); c.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, ((8 + 12 * n) // 2, hard))
    c.snapshot(20, w + 1, m, v, "cadence"); c.wait()
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    c.snapshot(30, w + 2, m, v, "cadence"); c.wait()
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_write_failing_midway_removes_temporary_keeps_previous_and_next_cadence_succeeds(
        tmp_path):
    n = 250_000                                   # 3 MB file, limit at 1.5 MB
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(tmp_path), str(n)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert [s for s, _ in results] == [10, 20, 30]
    assert results[0][1] is None and results[2][1] is None
    err = results[1][1]
    assert "step_000020.bin: write failed" in err and "EFBIG" in err
    assert "temporary was removed" in err and "FAILED" in r.stderr
    names = sorted(os.listdir(tmp_path))  # no temporary: only the manifest (and its lock)
    assert names == [".checkpoints.json.lock", "checkpoints.json", "step_000010.bin",
                     "step_000030.bin"]
    step, w, _, _ = cread.load_checkpoint(tmp_path / "step_000010.bin", n,
                                       cm.read_manifest(tmp_path)[10].checksum)
    assert step == 10 and (w == 1.0).all()
    assert sorted(cm.read_manifest(tmp_path)) == [10, 30]


def _lazy_free() -> int:
    """Bytes of this process's memory marked free-when-needed (MADV_FREE), per the kernel."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("LazyFree:"))


def test_host_buffer_is_reclaimable_after_each_write_and_the_writer_runs_niced(tmp_path):
    """After a background write the 12-bytes-per-parameter host buffer is marked free for the
    kernel to take when it needs memory (LazyFree in /proc/self/smaps_rollup), the next
    checkpoint reuses it and is still byte-for-byte right, and the writer thread ran at
    WRITER_NICE while the caller keeps its priority
    (docs/checkpoint-format.md#writing-without-stalling)."""
    n = 4_000_000                                   # a 48 MB buffer
    nice_seen = []
    c = Checkpointer(tmp_path, n, keep_last=2, keep_every=0,
                     on_done=lambda r: nice_seen.append(
                         os.getpriority(os.PRIO_PROCESS, __import__("threading").get_native_id())))
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    for step, seed in ((1, 1), (2, 2)):
        w, m, v = _state(n, seed)
        c.snapshot(step, w, m, v, "cadence", defer_copy=True)
        c.wait_copied()
        in_use = _lazy_free()
        assert c.wait().error is None
        assert _lazy_free() - in_use > 40e6, (in_use, _lazy_free())   # the write let it go
        got = _file_arrays(tmp_path / cf.checkpoint_name(step), n)
        assert got[0] == step and all(np.array_equal(a, t.numpy())
                                      for a, t in zip(got[1:], (w, m, v)))
    assert nice_seen == [max(ck.WRITER_NICE, mine)] * 2
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine         # the caller's own is unchanged


def test_retention_retires_one_file_that_the_next_write_overwrites(tmp_path, monkeypatch):
    # The oldest doomed checkpoint becomes the next write's file (same inode), the others
    # are deleted; a retired file of the right size counts as space the write already has.
    n = 5000
    c = Checkpointer(tmp_path, n, keep_last=2, keep_every=0)
    w, m, v = _state(n, 4)
    inodes = {}
    for step in (10, 20, 30):
        c.snapshot(step, w + step, m, v, "cadence")
        c.wait()
        inodes[step] = (tmp_path / cf.checkpoint_name(step)).stat().st_ino
    assert sorted(os.listdir(tmp_path)) == [
        ".checkpoints.json.lock", cw.RECYCLED_NAME, "checkpoints.json", "step_000020.bin",
        "step_000030.bin"]
    assert (tmp_path / cw.RECYCLED_NAME).stat().st_ino == inodes[10]
    real = shutil.disk_usage  # room for the margin only: enough, with a retired file to reuse
    monkeypatch.setattr(ck.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=ck.DISK_MARGIN_BYTES + 1))
    c.snapshot(40, w + 40, m, v, "cadence")
    assert c.wait().error is None
    monkeypatch.undo()
    assert (tmp_path / "step_000040.bin").stat().st_ino == inodes[10]
    assert (tmp_path / cw.RECYCLED_NAME).stat().st_ino == inodes[20]
    np.testing.assert_array_equal(_file_arrays(tmp_path / "step_000040.bin", n)[1],
                                  (w + 40).numpy())
    man = cm.read_manifest(tmp_path)
    assert sorted(man) == [30, 40]
    assert man[40].checksum == "crc32:%08x" % zlib.crc32((tmp_path / "step_000040.bin").read_bytes())
    # several doomed at once: the oldest is retired, the others deleted
    c.keep_last = 5
    for step in (50, 60, 70):
        c.snapshot(step, w, m, v, "cadence")
        c.wait()
    assert not (tmp_path / cw.RECYCLED_NAME).exists()  # taken by step 50's write
    inode30 = (tmp_path / "step_000030.bin").stat().st_ino
    c.keep_last = 2
    c.snapshot(80, w, m, v, "cadence")
    c.wait()
    assert [s for s, _ in cdir.list_checkpoints(tmp_path)] == [70, 80]
    assert (tmp_path / cw.RECYCLED_NAME).stat().st_ino == inode30


def test_a_retired_checkpoint_with_a_hard_link_is_deleted_not_overwritten(tmp_path):
    # an operator's `ln step_000010.bin keep.bin` must keep its bytes: only a file with no
    # other name is reused in place
    n = 3000
    c = Checkpointer(tmp_path, n, keep_last=2, keep_every=0)
    w, m, v = _state(n, 5)
    c.snapshot(10, w, m, v, "cadence")
    c.wait()
    os.link(tmp_path / "step_000010.bin", tmp_path / "keep.bin")
    kept = (tmp_path / "keep.bin").read_bytes()
    for step in (20, 30, 40):
        c.snapshot(step, w + step, m, v, "cadence")
        c.wait()
    assert [s for s, _ in cdir.list_checkpoints(tmp_path)] == [30, 40]
    assert (tmp_path / "keep.bin").read_bytes() == kept


def test_retention_removes_a_symlinked_checkpoint_and_never_reuses_its_target(tmp_path):
    # an operator moved step 10 to another disk and left a link: retention removes the link,
    # the next write makes its own file, the archive keeps its bytes
    n = 3000
    run, archive = tmp_path / "run", tmp_path / "archive"
    run.mkdir(), archive.mkdir()
    c = Checkpointer(run, n, keep_last=2, keep_every=0)
    w, m, v = _state(n, 6)
    c.snapshot(10, w, m, v, "cadence")
    c.wait()
    shutil.move(run / "step_000010.bin", archive / "step_000010.bin")
    (run / "step_000010.bin").symlink_to(archive / "step_000010.bin")
    kept = (archive / "step_000010.bin").read_bytes()
    for step in (20, 30, 40):
        c.snapshot(step, w + step, m, v, "cadence")
        c.wait()
    assert [s for s, _ in cdir.list_checkpoints(run)] == [30, 40]
    assert (archive / "step_000010.bin").read_bytes() == kept
    assert not any(p.is_symlink() for p in run.iterdir())


def test_a_directory_at_the_recycled_name_does_not_fail_retention_or_the_write(tmp_path):
    n = 3000
    (tmp_path / cw.RECYCLED_NAME).mkdir()
    done = []
    c = Checkpointer(tmp_path, n, keep_last=2, keep_every=0, on_done=done.append)
    w, m, v = _state(n, 7)
    for step in (10, 20, 30, 40):
        c.snapshot(step, w + step, m, v, "cadence")
        c.wait()
    assert [r.error for r in done] == [None] * 4
    assert [s for s, _ in cdir.list_checkpoints(tmp_path)] == [30, 40]
    assert (tmp_path / cw.RECYCLED_NAME).is_dir()
