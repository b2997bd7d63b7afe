"""shared/atomic_io.py: the one fsync-a-directory helper and its one error policy, used by the
checkpoint writer and every small-file writer alike. Fast."""
from __future__ import annotations

import errno

import pytest

import shared.checkpoint_format as checkpoint_format
from shared.atomic_io import atomic_write_json, fsync_dir, read_json


def test_fsync_dir_of_a_directory_works(tmp_path):
    fsync_dir(tmp_path)
    fsync_dir(str(tmp_path))


def test_a_file_system_that_cannot_fsync_a_directory_is_tolerated():
    fsync_dir("/proc")  # procfs answers EINVAL: the rename stays atomic, nothing to report


def test_a_missing_directory_or_a_file_is_an_error_not_silence(tmp_path):
    with pytest.raises(FileNotFoundError):
        fsync_dir(tmp_path / "missing")
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError) as e:
        fsync_dir(tmp_path / "f")
    assert e.value.errno == errno.ENOTDIR


def test_checkpoints_and_sidecars_use_the_same_helper(tmp_path):
    assert checkpoint_format.fsync_dir is fsync_dir
    atomic_write_json(tmp_path / "x.json", {"a": 1})
    assert read_json(tmp_path / "x.json") == {"a": 1}
