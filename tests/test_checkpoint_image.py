"""The writer's fast path, write_checkpoint_image (one buffer laid out as the file,
written with O_DIRECT where the filesystem allows), must produce exactly the bytes of
write_checkpoint; scan_for_resume and quarantine_checkpoint keep rejected files."""
import os
import zlib

import numpy as np
import pytest

from shared.checkpoint import directory as cdir
from shared.checkpoint import file_format as cf
from shared.checkpoint import read as cread
from shared.checkpoint import write as cw


@pytest.mark.parametrize("n", [1, 341, 1000, 300_000])   # tails of every length, and none
def test_image_write_is_byte_identical_to_the_array_writer(tmp_path, n):
    rng = np.random.default_rng(n)
    image = cw.alloc_checkpoint_image(n)
    assert image.ctypes.data % cw.DIRECT_ALIGN == 0 and image.nbytes == 8 + 12 * n
    w, m, v = cw.image_arrays(image)
    for a in (w, m, v):
        a[:] = rng.standard_normal(n, dtype=np.float32)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(), b_dir.mkdir()
    pa, na, ca = cw.write_checkpoint(a_dir, 123, w.copy(), m.copy(), v.copy())
    pb, nb, cb = cw.write_checkpoint_image(b_dir, 123, image)
    assert pb.name == "step_000123.bin" and (nb, cb) == (na, ca)
    assert pb.read_bytes() == pa.read_bytes()
    assert cb == "crc32:%08x" % zlib.crc32(pb.read_bytes())
    assert os.listdir(b_dir) == ["step_000123.bin"]


def test_unaligned_image_falls_back_to_plain_writes(tmp_path):
    n = 2000
    size = 8 + 12 * n
    raw = np.zeros(size + 2 * cw.DIRECT_ALIGN, dtype=np.uint8)
    off = cw.image_offset(raw.ctypes.data) + 4           # deliberately not 4096-aligned
    image = raw[off:off + size]
    cw.image_arrays(image)[0][:] = 7.0
    path, _, checksum = cw.write_checkpoint_image(tmp_path, 5, image)
    step, w, _, _ = cread.load_checkpoint(path, n, checksum)
    assert step == 5 and (w == 7.0).all()


def test_image_of_the_wrong_shape_is_refused_before_any_file(tmp_path):
    with pytest.raises(cf.CheckpointError, match="8 \\+ 12 x n_params"):
        cw.write_checkpoint_image(tmp_path, 1, np.zeros(30, dtype=np.uint8))
    with pytest.raises(cf.CheckpointError, match="uint8"):
        cw.write_checkpoint_image(tmp_path, 1, np.zeros(5, dtype=np.float32))
    assert os.listdir(tmp_path) == []


def test_scan_for_resume_names_each_rule_and_quarantine_keeps_files(tmp_path):
    n = 10
    for step in (100, 200, 300):
        cw.write_checkpoint(tmp_path, step, *(np.ones(n, np.float32),) * 3)
    (tmp_path / "step_000300.bin").write_bytes(b"x" * 50)
    (tmp_path / "step_000200.bin").rename(tmp_path / "step_000250.bin")
    info, rejected = cdir.scan_for_resume(tmp_path, n)
    assert info.step == 100
    assert [(e.path.name, e.rule) for e in rejected] == [("step_000300.bin", "size"),
                                                        ("step_000250.bin", "step")]
    data = (tmp_path / "step_000300.bin").read_bytes()
    dest = cdir.quarantine_checkpoint(tmp_path / "step_000300.bin")
    assert dest == tmp_path / "rejected" / "step_000300.bin" and dest.read_bytes() == data
    (tmp_path / "step_000300.bin").write_bytes(b"again")
    assert cdir.quarantine_checkpoint(tmp_path / "step_000300.bin").name == "step_000300.bin.1"
    assert [s for s, _ in cdir.list_checkpoints(tmp_path)] == [100, 250]


@pytest.mark.parametrize("old_n", [1000, 3000, 400])  # same size, larger, smaller
def test_a_retired_checkpoint_is_overwritten_in_place_as_the_next_file(tmp_path, old_n):
    # docs/checkpoint-format.md#retention: retention renames a doomed file to RECYCLED_NAME
    # and the next write takes that file (same inode: no new blocks, no delete) instead of
    # creating one; the result is byte-identical to a fresh write, cut to its own size.
    n = 1000
    rng = np.random.default_rng(old_n)
    old = cw.alloc_checkpoint_image(old_n)
    for a in cw.image_arrays(old):
        a[:] = rng.standard_normal(old_n, dtype=np.float32)
    retired, _, _ = cw.write_checkpoint_image(tmp_path, 10, old)
    inode = retired.stat().st_ino
    assert cw.recycle_checkpoint(retired) == tmp_path / cw.RECYCLED_NAME
    assert [s for s, _ in cdir.list_checkpoints(tmp_path)] == []
    assert not cf.is_temporary_name(cw.RECYCLED_NAME)
    image = cw.alloc_checkpoint_image(n)
    for a in cw.image_arrays(image):
        a[:] = rng.standard_normal(n, dtype=np.float32)
    path, nbytes, checksum = cw.write_checkpoint_image(tmp_path, 20, image)
    assert os.listdir(tmp_path) == ["step_000020.bin"] and path.stat().st_ino == inode
    assert path.stat().st_size == nbytes == 8 + 12 * n
    assert path.read_bytes() == image.tobytes() and checksum == "crc32:%08x" % zlib.crc32(path.read_bytes())
    # recycle=False never takes it
    cw.recycle_checkpoint(path)
    fresh, _, _ = cw.write_checkpoint_image(tmp_path, 30, image, recycle=False)
    assert sorted(os.listdir(tmp_path)) == [cw.RECYCLED_NAME, "step_000030.bin"]
    assert fresh.stat().st_ino != inode and fresh.read_bytes() == image.tobytes()


def _image(n, seed):
    image = cw.alloc_checkpoint_image(n)
    for a in cw.image_arrays(image):
        a[:] = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    return image


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo", "hard link"])
def test_a_recycled_name_that_is_not_a_lone_regular_file_is_never_written_through(
        tmp_path, kind):
    # Only a regular file with one name is overwritten in place: a symlink's target outside
    # the run, a directory, a FIFO (an open would block for ever) or a file with another name
    # are never written into; the write makes a new file instead.
    run, outside = tmp_path / "run", tmp_path / "elsewhere.bin"
    run.mkdir()
    outside.write_bytes(b"operator's bytes")
    recycled = run / cw.RECYCLED_NAME
    if kind == "symlink":
        recycled.symlink_to(outside)
    elif kind == "directory":
        recycled.mkdir()
    elif kind == "fifo":
        os.mkfifo(recycled)
    else:
        os.link(outside, recycled)
    image = _image(500, 1)
    path, nbytes, checksum = cw.write_checkpoint_image(run, 7, image)
    assert path.read_bytes() == image.tobytes() and not path.is_symlink()
    assert path.stat().st_ino != outside.stat().st_ino and path.stat().st_nlink == 1
    assert outside.read_bytes() == b"operator's bytes"
    assert recycled.is_dir() if kind == "directory" else not os.path.lexists(recycled)
    assert not [x for x in os.listdir(run) if cf.is_temporary_name(x)]


def test_the_scan_for_values_also_gives_the_files_checksum(tmp_path):
    image = _image(1000, 2)
    v = cw.image_arrays(image)[2]
    v[:] = np.abs(v)  # rule 8: v >= 0
    path, _, checksum = cw.write_checkpoint_image(tmp_path, 3, image)
    assert cread.validate_checkpoint(path, 1000, values=True).checksum == checksum
    assert cread.validate_checkpoint(path, 1000).checksum is None  # nothing read
    assert cread.validate_checkpoint(path, 1000, checksum, values=True).checksum is None
