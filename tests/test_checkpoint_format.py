"""docs/checkpoint-format.md: checkpoint layout, names, validation, atomic write, discovery, manifest, retention."""

import errno
import json
import os
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.checkpoint import directory as cdir
from shared.checkpoint import file_format as cf
from shared.checkpoint import manifest as cm
from shared.checkpoint import read as cread
from shared.checkpoint import write as cw
from shared.checkpoint.file_format import CheckpointError
from shared.run.layout import RunLayout


def _arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(n).astype(np.float32) for _ in range(3))


def _raw(step, n, w, m, v):
    return struct.pack("<ii", step, n) + w.tobytes() + m.tobytes() + v.tobytes()


def _put(path, data):
    path.write_bytes(data)
    return path


def _reason(exc_info):
    return str(exc_info.value)


# ------------------------------------------------------------------ layout

def test_hand_built_checkpoint_reads_back_exactly(tmp_path):
    w = np.array([1.0, -2.5, 3.25], dtype=np.float32)
    m = np.array([0.5, 0.0, -0.125], dtype=np.float32)
    v = np.array([1e-8, 2e-8, np.float32(3.4e38)], dtype=np.float32)
    data = struct.pack("<ii", 300, 3) + struct.pack("<3f", *w) + struct.pack("<3f", *m) \
        + struct.pack("<3f", *v)
    path = _put(tmp_path / "step_000300.bin", data)

    assert cread.read_header(path) == (300, 3)
    step, w2, m2, v2 = cread.load_checkpoint(path, 3)
    assert step == 300
    for got, want in ((w2, w), (m2, m), (v2, v)):
        assert got.dtype == np.float32 and got.shape == (3,)
        assert got.tobytes() == want.tobytes()


def test_written_checkpoint_matches_layout_byte_for_byte(tmp_path):
    w, m, v = _arrays(1000)
    path, nbytes, checksum = cw.write_checkpoint(tmp_path, 1234, w, m, v)
    want = _raw(1234, 1000, w, m, v)
    assert path == tmp_path / "step_001234.bin"
    assert path.read_bytes() == want
    assert nbytes == len(want) == cf.expected_size(1000) == 8 + 12 * 1000
    assert checksum == "crc32:%08x" % zlib.crc32(want)


def test_round_trip_returns_views_of_one_buffer(tmp_path):
    w, m, v = _arrays(257, seed=3)
    path, _, checksum = cw.write_checkpoint(tmp_path, 7, w, m, v, fsync=False)
    step, w2, m2, v2 = cread.load_checkpoint(path, 257, checksum)
    assert step == 7
    np.testing.assert_array_equal(w2, w)
    np.testing.assert_array_equal(m2, m)
    np.testing.assert_array_equal(v2, v)
    assert w2.base is not None and w2.base is m2.base is v2.base
    # one buffer laid out as the file: m right after the weights, v right after m
    assert m2.ctypes.data == w2.ctypes.data + 4 * 257 == v2.ctypes.data - 4 * 257
    assert w2.flags.c_contiguous and w2.flags.writeable
    # placed for the kernel's fast copy: the weights' address agrees with their file offset
    assert w2.ctypes.data % cread.READ_ALIGN == cf.HEADER_BYTES % cread.READ_ALIGN


def test_a_read_buffer_agrees_with_its_file_offset_for_any_offset():
    for offset in (0, 8, 12, 60, 4096 + 8, 8 + 4 * 12_811_008):
        for count in (1, 257, 10_000):
            a = cread.empty_for_read(count, offset)
            assert a.dtype == np.dtype("<f4") and a.shape == (count,)
            assert a.flags.c_contiguous and a.flags.writeable
            assert (a.ctypes.data - offset) % cread.READ_ALIGN == 0, (offset, count)


def test_write_accepts_non_contiguous_float32_and_rejects_other_dtypes(tmp_path):
    big = np.arange(20, dtype=np.float32)
    path, _, _ = cw.write_checkpoint(tmp_path, 1, big[::2], big[1::2], big[:10], fsync=False)
    assert cread.load_checkpoint(path, 10)[1].tolist() == big[::2].tolist()

    with pytest.raises(CheckpointError, match="dtype float64.*float32"):
        cw.write_checkpoint(tmp_path, 2, np.zeros(4), np.zeros(4, np.float32),
                            np.zeros(4, np.float32))
    with pytest.raises(CheckpointError, match="lengths 4, 3, 4"):
        z = np.zeros(4, np.float32)
        cw.write_checkpoint(tmp_path, 2, z, z[:3], z)
    with pytest.raises(CheckpointError, match=r"shape \(2, 2\)"):
        z = np.zeros((2, 2), np.float32)
        cw.write_checkpoint(tmp_path, 2, z, z, z)
    with pytest.raises(CheckpointError, match="n_params 0"):
        z = np.zeros(0, np.float32)
        cw.write_checkpoint(tmp_path, 2, z, z, z)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001.bin"]


# ------------------------------------------------------------------ names

@pytest.mark.parametrize("name, step", [
    ("step_000000.bin", 0),
    ("step_000100.bin", 100),
    ("step_999999.bin", 999999),
    ("step_1000000.bin", 1000000),
    ("step_2147483647.bin", cf.INT32_MAX),
    ("step_2147483648.bin", None),       # does not fit int32
    ("step_0000100.bin", None),          # not canonical: would alias step_000100.bin
    ("step_latest.bin", None),
    ("step_000100.bin.bak", None),
    ("step_abc.bin", None),
    ("step_12.bin", None),
    ("step_-00001.bin", None),
    ("step_000100.BIN", None),
    ("xstep_000100.bin", None),
    (".step_000100.bin.tmp-4242", None),
    ("step_\u0661\u0662\u0663\u0664\u0665\u0666.bin", None),   # non-ASCII digits
])
def test_parse_checkpoint_name_table(name, step):
    assert cf.parse_checkpoint_name(name) == step


def test_checkpoint_name_pads_to_six_then_widens():
    assert cf.checkpoint_name(0) == "step_000000.bin"
    assert cf.checkpoint_name(300) == "step_000300.bin"
    assert cf.checkpoint_name(1_000_000) == "step_1000000.bin"
    assert cf.checkpoint_name(np.int64(42)) == "step_000042.bin"
    for step in (0, 5, 999_999, 1_000_000, cf.INT32_MAX):
        assert cf.parse_checkpoint_name(cf.checkpoint_name(step)) == step


@pytest.mark.parametrize("bad", [-1, cf.INT32_MAX + 1, 1.5, True])
def test_checkpoint_name_refuses_steps_outside_int32(bad):
    with pytest.raises(CheckpointError):
        cf.checkpoint_name(bad)


def test_temporary_names():
    assert cf.is_temporary_name(".step_000100.bin.tmp-4242")
    assert cf.is_temporary_name(".step_1000000.bin.tmp-1")
    assert not cf.is_temporary_name("step_000100.bin")
    assert not cf.is_temporary_name(".checkpoints.json.tmp-1")
    assert not cf.is_temporary_name("step_000100.bin.tmp-1")


# ------------------------------------------------------------------ limits

def test_int32_limits_name_the_value():
    cf.check_int32_limits(0, 1)
    cf.check_int32_limits(cf.INT32_MAX, cf.INT32_MAX)
    with pytest.raises(CheckpointError, match="n_params 2,147,483,648"):
        cf.check_int32_limits(0, cf.INT32_MAX + 1)
    with pytest.raises(CheckpointError, match="n_params 0"):
        cf.check_int32_limits(0, 0)
    with pytest.raises(CheckpointError, match="step -1"):
        cf.check_int32_limits(-1, 10)
    with pytest.raises(CheckpointError, match="step 2,147,483,648"):
        cf.check_int32_limits(cf.INT32_MAX + 1, 10)
    assert issubclass(CheckpointError, ValueError)


def test_validate_refuses_model_larger_than_int32(tmp_path):
    w, m, v = _arrays(2)
    path, _, _ = cw.write_checkpoint(tmp_path, 1, w, m, v, fsync=False)
    with pytest.raises(CheckpointError, match="n_params 3,000,000,000"):
        cread.validate_checkpoint(path, 3_000_000_000)


# ------------------------------------------------------------------ rejection, one rule each

def test_zero_length_file_is_rejected(tmp_path):
    path = _put(tmp_path / "step_000300.bin", b"")
    with pytest.raises(CheckpointError, match=r"step_000300.bin: 0 bytes \(zero-length") as ei:
        cread.validate_checkpoint(path, 10)
    assert ei.value.rule == "empty"
    with pytest.raises(CheckpointError, match="zero-length"):
        cread.read_header(path)


def test_file_shorter_than_header_is_rejected(tmp_path):
    path = _put(tmp_path / "step_000300.bin", b"\x01\x02\x03\x04\x05")
    with pytest.raises(CheckpointError, match="5 bytes, shorter than the 8-byte header"):
        cread.read_header(path)
    with pytest.raises(CheckpointError, match="truncated write"):
        cread.load_checkpoint(path, None)


def test_truncated_file_names_sizes_and_formula(tmp_path):
    w, m, v = _arrays(100)
    data = _raw(300, 100, w, m, v)
    path = _put(tmp_path / "step_000300.bin", data[:600])
    with pytest.raises(CheckpointError) as ei:
        cread.validate_checkpoint(path, 100)
    assert _reason(ei).startswith(
        "step_000300.bin: 600 bytes, expected 1,208 (8 + 12 x 100): truncated write?")
    assert ei.value.rule == "size" and ei.value.path == path


def test_oversized_file_is_rejected(tmp_path):
    w, m, v = _arrays(10)
    path = _put(tmp_path / "step_000300.bin", _raw(300, 10, w, m, v) + b"\0\0\0\0")
    with pytest.raises(CheckpointError, match="132 bytes, expected 128 .*trailing bytes"):
        cread.validate_checkpoint(path, 10)


@pytest.mark.parametrize("n", [0, -5])
def test_header_n_params_not_positive_is_rejected(tmp_path, n):
    path = _put(tmp_path / "step_000300.bin", struct.pack("<ii", 300, n) + b"\0" * 24)
    with pytest.raises(CheckpointError, match=f"header n_params = {n}, must be >= 1"):
        cread.validate_checkpoint(path, None)


def test_header_step_differs_from_name(tmp_path):
    w, m, v = _arrays(4)
    path = _put(tmp_path / "step_000300.bin", _raw(200, 4, w, m, v))
    with pytest.raises(CheckpointError) as ei:
        cread.validate_checkpoint(path, 4)
    assert "header step 200 differs from the name's step 300" in _reason(ei)
    assert "rename it to step_000200.bin" in _reason(ei)


def test_architecture_mismatch_names_both_counts(tmp_path):
    w, m, v = _arrays(50)
    path, _, _ = cw.write_checkpoint(tmp_path, 100, w, m, v, fsync=False)
    with pytest.raises(CheckpointError) as ei:
        cread.load_checkpoint(path, 12_811_008)
    assert ("step_000100.bin: the model has 12,811,008 parameters, the file has 50; "
            "the architecture differs") in _reason(ei)
    assert ei.value.rule == "n_params"


def test_load_into_given_arrays_reads_the_file_there_and_checks_its_checksum(tmp_path):
    # a resume reads straight into the model's and the optimizer's memory (worker/trainer.py)
    w, m, v = _arrays(3001, seed=5)
    path, _, checksum = cw.write_checkpoint(tmp_path, 9, w, m, v, fsync=False)
    out = tuple(np.full(3001, np.nan, dtype=np.float32) for _ in range(3))
    step, w2, m2, v2 = cread.load_checkpoint(path, 3001, checksum, out=out)
    assert step == 9 and w2 is out[0] and m2 is out[1] and v2 is out[2]
    for got, want in zip(out, (w, m, v)):
        assert got.tobytes() == want.tobytes()
    data = bytearray(path.read_bytes())
    data[8 + 4 * 3001 * 2 + 40] ^= 0x10                # a flipped bit inside v
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as ei:
        cread.load_checkpoint(path, 3001, checksum, out=out)
    assert ei.value.rule == "checksum"


@pytest.mark.parametrize("bad", [
    lambda n: (np.zeros(n, np.float32), np.zeros(n, np.float32)),            # two arrays
    lambda n: tuple(np.zeros(n + 1, np.float32) for _ in range(3)),          # wrong length
    lambda n: tuple(np.zeros(n, np.float64) for _ in range(3)),              # wrong dtype
    lambda n: tuple(np.zeros(2 * n, np.float32)[::2] for _ in range(3)),     # not contiguous
], ids=["two", "length", "dtype", "strided"])
def test_load_into_arrays_that_do_not_fit_is_refused_before_reading(tmp_path, bad):
    w, m, v = _arrays(64)
    path, _, _ = cw.write_checkpoint(tmp_path, 3, w, m, v, fsync=False)
    with pytest.raises(ValueError, match="load_checkpoint"):
        cread.load_checkpoint(path, 64, out=bad(64))


def _shrink_at(monkeypatch, end):
    """Every file `cread` opens reads as if it ended at byte `end`: what a reader sees of a file
    that shrinks after its size was checked."""
    real_open = cread._open_regular

    class Shrunk:
        def __init__(self, opened):
            self.opened = opened

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            self.f = self.opened.__enter__()
            return self

        def __exit__(self, *exc):
            return self.opened.__exit__(*exc)

        def readinto(self, view):
            return self.f.readinto(view[: max(0, end - self.f.tell())])

    monkeypatch.setattr(cread, "_open_regular", lambda *a, **k: Shrunk(real_open(*a, **k)))


def test_load_into_arrays_names_the_offset_where_a_shrinking_file_ended(tmp_path, monkeypatch):
    w, m, v = _arrays(100)
    path, _, _ = cw.write_checkpoint(tmp_path, 4, w, m, v, fsync=False)
    out = tuple(np.zeros(100, np.float32) for _ in range(3))
    _shrink_at(monkeypatch, 8 + 4 * 150)  # half of m is all there is
    with pytest.raises(CheckpointError, match=f"ended after {8 + 4 * 150:,} of"):
        cread.load_checkpoint(path, 100, out=out)


def test_checksum_mismatch_is_rejected_only_when_checksum_given(tmp_path):
    w, m, v = _arrays(50)
    path, _, checksum = cw.write_checkpoint(tmp_path, 100, w, m, v, fsync=False)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF                                  # one flipped byte inside weights
    path.write_bytes(bytes(data))
    assert cread.validate_checkpoint(path, 50).step == 100  # structurally fine
    for check in (cread.validate_checkpoint, cread.load_checkpoint):
        with pytest.raises(CheckpointError) as ei:
            check(path, 50, checksum)
        assert f"the manifest records {checksum}" in _reason(ei)
        assert ei.value.rule == "checksum"
    with pytest.raises(CheckpointError, match="not of the form crc32"):
        cread.validate_checkpoint(path, 50, "md5:abc")


def test_unparseable_name_is_rejected(tmp_path):
    w, m, v = _arrays(4)
    path = _put(tmp_path / "step_latest.bin", _raw(300, 4, w, m, v))
    with pytest.raises(CheckpointError, match="step_latest.bin: not a checkpoint name"):
        cread.validate_checkpoint(path, 4)


def test_first_failing_rule_is_reported(tmp_path):
    # truncated AND wrong step AND wrong n_params: size comes first
    w, m, v = _arrays(10)
    path = _put(tmp_path / "step_000300.bin", _raw(200, 10, w, m, v)[:-1])
    with pytest.raises(CheckpointError) as ei:
        cread.validate_checkpoint(path, 99, "crc32:00000000")
    assert ei.value.rule == "size"
    # right size, wrong step AND wrong n_params: step comes before n_params
    path.write_bytes(_raw(200, 10, w, m, v))
    with pytest.raises(CheckpointError) as ei:
        cread.validate_checkpoint(path, 99, "crc32:00000000")
    assert ei.value.rule == "step"


def test_missing_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        cread.validate_checkpoint(tmp_path / "step_000100.bin", None)


# ------------------------------------------------------------------ directories

def test_list_sorts_by_integer_and_ignores_other_names(tmp_path):
    for name in ["step_1000000.bin", "step_999999.bin", "step_000100.bin", "step_latest.bin",
                 "step_000100.bin.bak", "step_abc.bin", "step_12.bin",
                 ".step_000200.bin.tmp-77", "checkpoints.json", "notes.txt"]:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "step_000500.bin").mkdir()
    got = cdir.list_checkpoints(tmp_path)
    assert got == [(100, tmp_path / "step_000100.bin"),
                   (999999, tmp_path / "step_999999.bin"),
                   (1000000, tmp_path / "step_1000000.bin")]


def test_list_of_missing_directory_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot list"):
        cdir.list_checkpoints(tmp_path / "no-such-run")


def test_scan_for_resume_skips_truncated_newest_and_deletes_nothing(tmp_path):
    n = 64
    for step in (100, 200, 300):
        cw.write_checkpoint(tmp_path, step, *_arrays(n, seed=step), fsync=False)
    newest = tmp_path / "step_000300.bin"
    newest.write_bytes(newest.read_bytes()[:400])       # torn by a kill
    _put(tmp_path / "step_000250.bin", b"")             # zero-length
    before = sorted(os.listdir(tmp_path))

    info, rejected = cdir.scan_for_resume(tmp_path, n)

    assert info == cf.CheckpointInfo(tmp_path / "step_000200.bin", 200, n, 8 + 12 * n)
    assert [e.path.name for e in rejected] == ["step_000300.bin", "step_000250.bin"]
    assert str(rejected[0]).startswith(
        f"step_000300.bin: 400 bytes, expected {8 + 12 * n:,} (8 + 12 x {n}): truncated")
    assert "zero-length" in str(rejected[1])
    assert sorted(os.listdir(tmp_path)) == before


def test_scan_for_resume_orders_past_999999_and_uses_checksums(tmp_path):
    n = 8
    _, _, c1 = cw.write_checkpoint(tmp_path, 999_999, *_arrays(n), fsync=False)
    _, _, c2 = cw.write_checkpoint(tmp_path, 1_000_000, *_arrays(n, seed=1), fsync=False)
    info, rejected = cdir.scan_for_resume(tmp_path, n)
    assert info.step == 1_000_000 and rejected == []

    info, rejected = cdir.scan_for_resume(tmp_path, n, {1_000_000: c1, 999_999: c1})
    assert info.step == 999_999
    assert rejected[0].path.name == "step_1000000.bin" and "checksum" in str(rejected[0])


def test_scan_for_resume_with_nothing_valid(tmp_path):
    cw.write_checkpoint(tmp_path, 100, *_arrays(5), fsync=False)
    info, rejected = cdir.scan_for_resume(tmp_path, 6)
    assert info is None
    assert "the model has 6 parameters, the file has 5" in str(rejected[0])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cdir.scan_for_resume(empty, 6) == (None, [])


def test_clean_stale_temporaries_removes_only_temporaries(tmp_path):
    cw.write_checkpoint(tmp_path, 100, *_arrays(3), fsync=False)
    for name in (".step_000200.bin.tmp-123", ".step_1000000.bin.tmp-9", "step_000100.bin.bak"):
        (tmp_path / name).write_bytes(b"junk")
    removed = cdir.clean_stale_temporaries(tmp_path)
    assert [p.name for p in removed] == [".step_000200.bin.tmp-123", ".step_1000000.bin.tmp-9"]
    assert sorted(os.listdir(tmp_path)) == ["step_000100.bin", "step_000100.bin.bak"]
    assert cdir.clean_stale_temporaries(tmp_path) == []


# ------------------------------------------------------------------ atomic write under faults

def test_disk_full_at_fsync_leaves_no_temporary_and_previous_intact(tmp_path, monkeypatch):
    w, m, v = _arrays(100)
    old_path, _, old_sum = cw.write_checkpoint(tmp_path, 100, w, m, v)
    old_bytes = old_path.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError) as ei:
        cw.write_checkpoint(tmp_path, 200, *_arrays(100, seed=1))
    monkeypatch.undo()

    assert isinstance(ei.value.__cause__, OSError)
    assert ei.value.__cause__.errno == errno.ENOSPC
    assert "step_000200.bin" in _reason(ei) and "ENOSPC" in _reason(ei)
    assert os.listdir(tmp_path) == ["step_000100.bin"]
    assert old_path.read_bytes() == old_bytes
    assert cdir.scan_for_resume(tmp_path, 100, {100: old_sum})[0].step == 100


def test_interrupt_during_write_removes_temporary_and_propagates(tmp_path, monkeypatch):
    cw.write_checkpoint(tmp_path, 100, *_arrays(10))
    old = (tmp_path / "step_000100.bin").read_bytes()

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cw.write_checkpoint(tmp_path, 100, *_arrays(10, seed=9))   # same step: overwrite
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["step_000100.bin"]
    assert (tmp_path / "step_000100.bin").read_bytes() == old


def test_write_into_missing_directory_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="write failed") as ei:
        cw.write_checkpoint(tmp_path / "gone", 1, *_arrays(3))
    assert isinstance(ei.value.__cause__, FileNotFoundError)


def test_rewriting_a_step_replaces_the_file(tmp_path):
    cw.write_checkpoint(tmp_path, 100, *_arrays(10))
    w, m, v = _arrays(10, seed=5)
    path, _, _ = cw.write_checkpoint(tmp_path, 100, w, m, v)
    assert path.read_bytes() == _raw(100, 10, w, m, v)
    assert os.listdir(tmp_path) == ["step_000100.bin"]


# ------------------------------------------------------------------ manifest

def _entry(step, **kw):
    base = dict(step=step, file=cf.checkpoint_name(step), nbytes=68,
                checksum="crc32:0000abcd", reason="cadence", pinned=False, time=1.5)
    base.update(kw)
    return cm.ManifestEntry(**base)


def test_manifest_round_trip_and_remove(tmp_path):
    assert cm.read_manifest(tmp_path) == {}
    cm.record_checkpoint(tmp_path, _entry(200))
    cm.record_checkpoint(tmp_path, _entry(100, reason="sigusr1", pinned=True))
    cm.record_checkpoint(tmp_path, _entry(200, reason="final", pinned=True))
    got = cm.read_manifest(tmp_path)
    assert list(got) == [100, 200]
    assert got[200] == _entry(200, reason="final", pinned=True)
    assert got[100].pinned and got[100].reason == "sigusr1"
    assert cm.manifest_checksums(got) == {100: "crc32:0000abcd", 200: "crc32:0000abcd"}
    with cm.editing_manifest(tmp_path) as entries:
        del entries[100]
    assert list(cm.read_manifest(tmp_path)) == [200]
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".lock")) == [RunLayout(tmp_path).manifest.name]


def test_garbage_manifest_warns_and_reads_empty(tmp_path):
    RunLayout(tmp_path).manifest.write_text('{"checkpoints": [{"step": 1,')
    with pytest.warns(UserWarning, match="checkpoints.json: not valid JSON"):
        assert cm.read_manifest(tmp_path) == {}
    RunLayout(tmp_path).manifest.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.warns(UserWarning, match="checkpoints.json"):
        assert cm.read_manifest(tmp_path) == {}
    RunLayout(tmp_path).manifest.write_text("[1, 2]")
    with pytest.warns(UserWarning, match="no 'checkpoints' list"):
        assert cm.read_manifest(tmp_path) == {}


def test_bad_manifest_entry_is_skipped_with_warning(tmp_path):
    good = vars(_entry(100)).copy()
    bad = dict(good, step=200, reason="because")
    RunLayout(tmp_path).manifest.write_text(json.dumps({"checkpoints": [good, bad, 7]}))
    with pytest.warns(UserWarning) as record:
        assert list(cm.read_manifest(tmp_path)) == [100]
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "checkpoints.json: entry 1 skipped" in messages[0] and "reason" in messages[0]
    assert "entry 2 skipped (expected an object, got int)" in messages[1]


def test_manifest_entry_refuses_bad_values():
    with pytest.raises(ValueError, match="reason"):
        _entry(1, reason="whim")
    with pytest.raises(ValueError, match="step"):
        _entry(-1)
    with pytest.raises(ValueError, match="pinned"):
        _entry(1, pinned="yes")


# ------------------------------------------------------------------ retention

def test_retention_example_from_spec_defaults():
    steps = [100, 200, 10_000, 10_100, 10_200, 10_300, 10_400]
    assert cm.plan_retention(steps, {200}, keep_last=3, keep_every=10_000) == [100, 10_100]
    assert cm.plan_retention(steps, set(), keep_last=3, keep_every=0) == \
        [100, 200, 10_000, 10_100]


@pytest.mark.parametrize("keep_last", [1, 0, -3])
def test_retention_refuses_keep_last_below_two(keep_last):
    with pytest.raises(ValueError, match="keep_last"):
        cm.plan_retention([1, 2, 3], set(), keep_last=keep_last, keep_every=0)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.integers(0, 50_000), max_size=40),
       pinned_pick=st.lists(st.integers(0, 39), max_size=10),
       keep_last=st.integers(2, 8), keep_every=st.sampled_from([0, 1, 7, 100, 10_000]))
def test_retention_keeps_exactly_pinned_newest_and_multiples(steps, pinned_pick, keep_last,
                                                             keep_every):
    pinned = {steps[i] for i in pinned_pick if i < len(steps)}
    delete = cm.plan_retention(list(steps), pinned, keep_last, keep_every)
    newest = set(sorted(set(steps))[-keep_last:])
    protected = pinned | newest | {s for s in steps if keep_every and s % keep_every == 0}
    assert set(delete) == set(steps) - protected
    assert delete == sorted(set(delete))


def test_the_checksum_function_gives_zlib_crc32_values_for_every_length_and_running_value():
    """The manifest's checksum is zlib.crc32's (docs/checkpoint-format.md): the faster crc32
    used to compute it returns the same value for any bytes, length and starting value, also
    over a buffer fed in uneven pieces, and over numpy float32 memory."""
    import random

    from shared.checkpoint.file_format import crc32

    rng = random.Random(0)
    for n in (0, 1, 7, 64, 4095, 4096, 65_537, 1 << 20):
        data = rng.randbytes(n)
        for start in (0, 1, 0xFFFFFFFF, rng.getrandbits(32)):
            assert crc32(data, start) == zlib.crc32(data, start), (n, start)
    data = rng.randbytes(3_000_001)
    running, cut = 0, 0
    while cut < len(data):
        step = rng.randint(1, 300_000)
        running = crc32(memoryview(data)[cut : cut + step], running)
        cut += step
    assert running == zlib.crc32(data)
    arr = np.random.default_rng(0).standard_normal(100_003, dtype=np.float32)
    assert crc32(arr) == zlib.crc32(arr.tobytes())


# ---------------------------------------------------------------------------- rule 8: values


def _three(n=100):
    rng = np.random.default_rng(3)
    w = rng.standard_normal(n).astype(np.float32)
    return w, (w * 0.1).astype(np.float32), (np.abs(w) * 0.01).astype(np.float32)


@pytest.mark.parametrize("region, index, value, shown", [
    ("weights", 0, np.nan, "weights[0] = nan"),
    ("m", 57, np.inf, "m[57] = inf"),
    ("v", 99, -1e-8, "v[99] = -1e-08"),
    ("v", 31, -np.inf, "v[31] = -inf"),
])
def test_a_file_no_checksum_vouches_for_is_refused_with_a_non_finite_or_negative_v(
        tmp_path, monkeypatch, region, index, value, shown):
    # docs/checkpoint-format.md#validity rule 8: a .bin without a manifest entry (a copy
    # from a diverged run, a corrupt file) is never trained from with NaN in it
    arrays = dict(zip(("weights", "m", "v"), _three()))
    arrays[region][index] = value
    path, _, checksum = cw.write_checkpoint(tmp_path, 7, *arrays.values())
    for load in (lambda: cread.load_checkpoint(path, 100),
                 lambda: cread.validate_checkpoint(path, 100, values=True)):
        with pytest.raises(CheckpointError) as e:
            load()
        assert e.value.rule == "values" and e.value.path == path
        assert str(e.value).startswith(f"step_000007.bin: {shown}")
        assert "resume from an older checkpoint" in str(e.value)
    monkeypatch.setattr(cread, "VALUE_CHUNK", 64)  # 16 floats a piece: the index counts across
    with pytest.raises(CheckpointError, match=f"^step_000007.bin: {shown.replace('[', '.')}"):
        cread.validate_checkpoint(path, 100, values=True)
    # a checksum vouches for the bytes; without `values` nothing is read; inspect reads it all
    assert cread.validate_checkpoint(path, 100).step == 7
    assert cread.validate_checkpoint(path, 100, checksum, values=True).step == 7
    assert np.isnan(cread.load_checkpoint(path, 100, checksum)[1]).any() == np.isnan(value)
    assert cread.load_checkpoint(path, 100, values=False)[0] == 7


def test_finite_values_and_a_zero_v_pass_rule_8(tmp_path, monkeypatch):
    w, m, v = _three()
    v[:10] = 0.0  # a parameter that never had a gradient
    path, _, _ = cw.write_checkpoint(tmp_path, 3, w, m, v)
    monkeypatch.setattr(cread, "VALUE_CHUNK", 40)
    assert cread.validate_checkpoint(path, 100, values=True).step == 3
    step, w2, m2, v2 = cread.load_checkpoint(path, 100)
    assert step == 3 and np.array_equal(v2, v)


def test_a_file_shrinking_while_its_values_are_read_names_where(tmp_path, monkeypatch):
    path, _, _ = cw.write_checkpoint(tmp_path, 3, *_three())
    _shrink_at(monkeypatch, cf.HEADER_BYTES + 4 * 150)  # weights and half of m
    for read in (lambda: cread.validate_checkpoint(path, 100, values=True),
                 lambda: cread.load_weights(path, 100)):
        with pytest.raises(CheckpointError) as e:
            read()
        assert e.value.rule == "size" and f"ended after {8 + 4 * 150:,} of 1,208 bytes" in str(e.value)


def test_the_resume_scan_passes_over_a_newest_file_with_nan_that_no_checksum_vouches_for(
        tmp_path):
    from shared.checkpoint.directory import scan_for_resume
    w, m, v = _three()
    cw.write_checkpoint(tmp_path, 10, w, m, v)
    w_nan = w.copy()
    w_nan[5] = np.nan
    _, _, ck20 = cw.write_checkpoint(tmp_path, 20, w_nan, m, v)
    info, rejected = scan_for_resume(tmp_path, 100, values=True)
    assert info.step == 10
    assert [(e.path.name, e.rule) for e in rejected] == [("step_000020.bin", "values")]
    assert scan_for_resume(tmp_path, 100)[0].step == 20  # without values: header and size only
    assert scan_for_resume(tmp_path, 100, {20: ck20}, values=True)[0].step == 20


def test_a_fifo_or_directory_named_like_a_checkpoint_is_refused_without_blocking(tmp_path):
    """A FIFO named step_*.bin hung every reader (sample, status, inspect, export) in its open;
    now each check refuses it at once with rule io, as it does a directory."""
    import subprocess
    import sys as _sys
    fifo = tmp_path / "step_000010.bin"
    os.mkfifo(fifo)
    (tmp_path / "step_000020.bin").mkdir()
    code = (
        "import sys; from shared.checkpoint import read as cread\n"
        "for name in ('step_000010.bin', 'step_000020.bin'):\n"
        "    p = sys.argv[1] + '/' + name\n"
        "    for f in (lambda: cread.validate_checkpoint(p, None), lambda: cread.load_checkpoint(p, None),\n"
        "              lambda: cread.load_weights(p, None), lambda: cread.read_header(p)):\n"
        "        try:\n"
        "            f()\n"
        "        except cread.CheckpointError as e:\n"
        "            print(e.rule, str(e).split(':')[1].strip())\n"
    )
    r = subprocess.run([_sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)),
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines == ["io a FIFO, not a checkpoint file"] * 4 + ["io a directory, not a checkpoint file"] * 4, lines
