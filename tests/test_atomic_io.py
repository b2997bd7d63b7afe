"""shared/atomic_io.py: the one fsync-a-directory helper and its one error policy, used by the
checkpoint writer and every small-file writer alike. Fast."""

from __future__ import annotations

import errno
import os

import pytest

from shared import atomic_io
from shared.atomic_io import DIR_FSYNC_UNSUPPORTED, atomic_write_json, fsync_dir, read_json


def test_fsync_dir_of_a_directory_returns_and_changes_nothing(tmp_path):
    """A directory given as a Path or a str is fsynced without an error and left as it was."""
    (tmp_path / "a").write_text("x")
    assert fsync_dir(tmp_path) is None
    assert fsync_dir(str(tmp_path)) is None
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def test_a_file_system_that_cannot_fsync_a_directory_is_tolerated():
    """procfs answers a directory fsync with EINVAL (checked here, so the tolerated branch is
    the one exercised); fsync_dir returns quietly: the rename stays atomic, nothing to report."""
    fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as e:
            os.fsync(fd)
        assert e.value.errno in DIR_FSYNC_UNSUPPORTED
    finally:
        os.close(fd)
    assert fsync_dir("/proc") is None


def test_a_missing_directory_or_a_file_is_an_error_not_silence(tmp_path):
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError) as e:
        fsync_dir(tmp_path / "f")
    assert e.value.errno == errno.ENOTDIR


def test_checkpoints_and_sidecars_use_the_same_helper(tmp_path):
    assert atomic_io.fsync_dir is fsync_dir
    atomic_write_json(tmp_path / "x.json", {"a": 1})
    assert read_json(tmp_path / "x.json") == {"a": 1}


def test_stale_temporaries_of_a_killed_writer_are_removed_and_young_ones_and_others_kept(tmp_path):
    """A writer SIGKILLed between its write and its rename leaves `.NAME.XXXXXXXX.tmp`; the next
    start removes those older than 60 s, so they never pile up in the run directory
    (`.status.json` is rewritten every second), and keeps young ones and other files."""
    import os
    import tempfile
    import time

    from shared.atomic_io import clean_stale_writes

    old = [
        tempfile.mkstemp(prefix=f".{n}.", suffix=".tmp", dir=tmp_path)[1]
        for n in (".status.json", "arms.json")
    ]
    young = tempfile.mkstemp(prefix="..state.json.", suffix=".tmp", dir=tmp_path)[1]
    keep = [tmp_path / ".status.json", tmp_path / "notes.tmp", tmp_path / ".step_000010.bin.tmp-1"]
    for p in keep:
        p.write_text("x")
    hour_ago = time.time() - 3600
    for p in old + [str(x) for x in keep]:
        os.utime(p, (hour_ago, hour_ago))
    removed = clean_stale_writes(tmp_path)
    assert removed == sorted(os.path.basename(p) for p in old)
    assert os.path.exists(young) and all(p.exists() for p in keep)
    assert clean_stale_writes(tmp_path / "missing") == []
    named = tempfile.mkstemp(prefix="..pivot.request.json.", suffix=".tmp", dir=tmp_path)[1]
    assert clean_stale_writes(tmp_path, targets={".pivot.request.json"}) == [
        os.path.basename(named)]  # a young one whose every writer the caller's locks exclude
    assert clean_stale_writes(tmp_path, older_than_s=0) == [os.path.basename(young)]  # any age
    assert all(p.exists() for p in keep)


def test_an_atomic_write_gets_the_mode_a_plain_open_gives_not_mkstemps_0600(tmp_path):
    """Every atomic write (run.json, the sidecars, a safetensors export) came out 0600 from
    tempfile.mkstemp whatever the umask, so a group that shares runs could not read them."""
    import os
    import stat

    from shared.atomic_io import atomic_write_bytes, current_umask

    old = os.umask(0o027)
    try:
        assert current_umask() == 0o027
        atomic_write_bytes(tmp_path / "a.json", b"{}")
        assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640
        os.umask(0o022)
        atomic_write_bytes(tmp_path / "a.json", b"{}")  # a replacement too
        assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    finally:
        os.umask(old)
