"""Loading a checkpoint's weights for `sample`: one open file, the checksum over the bytes used.

Real checkpoint files written by the real writer; a real thread replaces the file by name while
`sample`'s loader reads it, as a run's retention does beside an operator's `sample`.
"""
import os
import threading
import time

import numpy as np
import pytest

from shared.checkpoint.file_format import CHECKSUM_CHUNK, HEADER_BYTES, CheckpointError
from shared.checkpoint.read import load_weights
from shared.checkpoint.write import write_checkpoint
from shared.run.config import PRESETS, RunConfig

VOCAB = 256


def _cfg() -> RunConfig:
    return RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], tokenizer="bytes",
                     vocab_size=VOCAB)


def _arrays(n: int, seed: int):
    rng = np.random.default_rng(seed)
    w, m = rng.standard_normal((2, n), dtype=np.float32)
    v = np.abs(rng.standard_normal(n, dtype=np.float32))
    return w, m, v


def test_load_weights_returns_the_weights_and_checks_the_whole_file(tmp_path):
    n = CHECKSUM_CHUNK // 4 + 100_000  # m and v each read as one full piece and a partial one
    w, m, v = _arrays(n, 1)
    path, _, checksum = write_checkpoint(tmp_path, 7, w, m, v)
    step, got = load_weights(path, n, checksum)
    assert step == 7 and got.dtype == np.float32 and np.array_equal(got, w)
    out = np.empty(n, dtype=np.float32)
    step, got = load_weights(path, n, checksum, out=out)
    assert got is out and np.array_equal(out, w)
    with pytest.raises(ValueError, match="float32"):
        load_weights(path, n, checksum, out=np.empty(n, dtype=np.float64))
    with pytest.raises(CheckpointError) as e:
        load_weights(path, n + 1, checksum)
    assert e.value.rule == "n_params"
    # a flipped byte in v, the region sample does not use, still fails the checksum
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 8 * n + 4 * (n - 1))
        f.write(b"\x00\x00\xc0\x7f")  # NaN in v's last element
    with pytest.raises(CheckpointError) as e:
        load_weights(path, n, checksum)
    assert e.value.rule == "checksum" and path.name in str(e.value)
    # without a checksum, rule 8 reads m and v too; values=False leaves it to the caller
    with pytest.raises(CheckpointError) as e:
        load_weights(path, n, None)
    assert e.value.rule == "values" and f"v[{n - 1:,}]" in str(e.value)
    assert np.array_equal(load_weights(path, n, None, values=False)[1], w)


def test_load_weights_refuses_a_file_cut_short_by_its_size_rule(tmp_path):
    n = 50_000
    path, _, checksum = write_checkpoint(tmp_path, 3, *_arrays(n, 2))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4)
    for expected in (checksum, None):
        with pytest.raises(CheckpointError) as e:
            load_weights(path, n, expected)
        assert e.value.rule == "size" and path.name in str(e.value)


def test_sample_loads_the_bytes_its_checksum_covered_while_the_run_replaces_the_file(tmp_path):
    """`sample` beside a run: the file at the checkpoint's name is replaced (retention retires it
    and the name is written again, or an operator copies another file over it) while it is
    loaded. The weights it returns are always those the given checksum vouches for; a load
    that read the other file fails with the checksum rule: one open both validates the file
    and reads its weights, so they can never be another file's."""
    from worker.sampling import load_weights_only
    cfg = _cfg()
    n = cfg.n_params
    wa, ma, va = _arrays(n, 3)
    wb, mb, vb = _arrays(n, 4)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    a_path, _, a_sum = write_checkpoint(a_dir, 7, wa, ma, va)
    b_path, _, _ = write_checkpoint(b_dir, 7, wb, mb, vb)
    path = tmp_path / a_path.name
    os.link(a_path, path)
    stop = threading.Event()

    def replace_forever():
        i = 0
        while not stop.is_set():
            tmp = tmp_path / f".swap-{i}"
            os.link(b_path if i % 2 == 0 else a_path, tmp)
            os.replace(tmp, path)
            i += 1

    swapper = threading.Thread(target=replace_forever, daemon=True)
    swapper.start()
    loaded, refused = 0, 0
    try:
        end = time.monotonic() + 60
        while (loaded < 20 or refused < 5) and time.monotonic() < end:
            try:
                step, model = load_weights_only(path, cfg, a_sum)
            except CheckpointError as e:
                assert e.rule == "checksum", e
                refused += 1
                continue
            got = model.flat.detach().numpy()
            assert step == 7
            assert np.array_equal(got, wa), (
                f"load {loaded + refused + 1}: weights of another file than the checksum's")
            loaded += 1
    finally:
        stop.set()
        swapper.join()
    assert loaded >= 20 and refused >= 5, (loaded, refused)  # both sides of the race were seen
