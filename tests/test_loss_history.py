"""`.loss.json` (docs/history.md): valid JSON between appends, O(1) appends, torn-tail repair on
open without losing a complete record, rewind to `.loss.rewound.json`. Real files only."""

import json
import math
import os
import re

import pytest

from shared.run.loss_history import LossHistory, iter_records, iter_records_after, repair, rewind


def rec(step, **extra):
    r = {"step": step, "loss": 4.0 / step, "lr": 3e-4, "tokens": 4096 * step,
         "arms": {"repo-code": step % 3, "repo-docstrings": 1, "python-docs": 2},
         "phase": {"label": "base", "index": 0}, "time": 1.7e9 + step}
    r.update(extra)
    return r


def build(path, n, start=1):
    with LossHistory(path) as h:
        for s in range(start, start + n):
            h.append(rec(s))
    return path.read_bytes()


def steps_on_disk(path):
    with open(path) as f:
        return [r["step"] for r in json.load(f)]


@pytest.fixture
def hist(tmp_path):
    return tmp_path / ".loss.json"


# --- format and appends -----------------------------------------------------------------------

def test_new_history_is_empty_json_array(hist):
    with LossHistory(hist) as h:
        assert len(h) == 0 and h.last_step is None and h.repairs == []
    assert hist.read_bytes() == b"[\n]\n"
    assert json.loads(hist.read_text()) == []


def test_file_is_valid_json_after_every_append(hist):
    with LossHistory(hist) as h:
        for s in range(1, 40):
            h.append(rec(s))
            assert steps_on_disk(hist) == list(range(1, s + 1))
        h.append_many([rec(s) for s in range(40, 50)])
        assert steps_on_disk(hist) == list(range(1, 50))


def test_one_record_per_line_layout(hist):
    build(hist, 3)
    lines = hist.read_text().split("\n")
    assert lines[0] == "[" and lines[-2:] == ["]", ""]
    assert [json.loads(line.rstrip(","))["step"] for line in lines[1:-2]] == [1, 2, 3]
    assert lines[1].startswith('{"step":1,') and lines[1].endswith("},")
    assert lines[3].endswith("}")


def test_thousand_appends_read_back(hist):
    with LossHistory(hist) as h:
        for s in range(1, 1001):
            h.append(rec(s))
        assert len(h) == 1000 and h.last_step == 1000
    records = list(iter_records(hist))
    assert [r["step"] for r in records] == list(range(1, 1001))
    assert records[499] == json.loads(json.dumps(rec(500)))
    assert [r["step"] for r in iter_records(hist)] == list(range(1, 1001))
    assert [r["step"] for r in iter_records_after(hist, 9, 20)] == list(range(10, 21))
    with LossHistory(hist) as h:          # reopen: count and last step recovered
        assert len(h) == 1000 and h.last_step == 1000 and h.repairs == []
        h.append(rec(1001))
    assert steps_on_disk(hist)[-1] == 1001


def test_append_refuses_step_not_after_last(hist):
    with LossHistory(hist) as h:
        h.append(rec(5))
        for bad in (5, 4):
            with pytest.raises(ValueError, match=rf"step {bad} .*last step 5"):
                h.append(rec(bad))
        with pytest.raises(ValueError):                 # all-or-nothing batch
            h.append_many([rec(6), rec(7), rec(7)])
        with pytest.raises(ValueError, match="int"):
            h.append({"loss": 1.0})
        with pytest.raises(ValueError, match="int"):
            h.append({"step": 6.0})
        assert h.last_step == 5 and len(h) == 1
    assert steps_on_disk(hist) == [5]


def test_nan_and_inf_become_null_and_nothing_is_added(hist):
    with LossHistory(hist) as h:
        h.append({"step": 1, "loss": float("nan"), "arm_loss": {"a": float("inf"), "b": 1.5},
                  "p": [0.5, float("-inf")], "t": (1, 2)})
    (r,) = json.loads(hist.read_text())
    assert r == {"step": 1, "loss": None, "arm_loss": {"a": None, "b": 1.5},
                 "p": [0.5, None], "t": [1, 2]}


def test_append_is_o1_bytes_written_independent_of_history_length(hist):
    record = rec(10**6, probe={"a": 1.0})
    with LossHistory(hist) as h:
        h.append_many([rec(s) for s in range(1, 20_001)])
        growth = {}
        for label, step in (("early", 20_001), ("late", 20_002)):
            size0, written0 = os.stat(hist).st_size, h.bytes_written
            calls = []
            real = h._write_at
            h._write_at = lambda off, buf, calls=calls, real=real: (calls.append(len(buf)), real(off, buf))
            h.append(dict(record, step=step))
            h._write_at = real
            line = len(json.dumps(dict(record, step=step), separators=(",", ":")))
            growth[label] = (os.stat(hist).st_size - size0, h.bytes_written - written0)
            assert calls == [line + 5]                  # ",\n" + record + "\n]\n", one write
            assert growth[label] == (line + 2, line + 5)
    # a fresh history: the same cost as at 20,000 records
    small = hist.parent / "small.json"
    with LossHistory(small) as h:
        h.append(rec(1))
        size0, written0 = os.stat(small).st_size, h.bytes_written
        h.append(dict(record, step=20_001))
        assert (os.stat(small).st_size - size0, h.bytes_written - written0) == growth["early"]


# --- torn tails -------------------------------------------------------------------------------

@pytest.mark.slow
def test_cut_at_every_byte_of_the_last_record_keeps_all_complete_records(hist):
    full = build(hist, 5)
    end4 = full.index(b'{"step":5') - 2               # end of record 4 ("},\n" before record 5)
    end5 = len(full) - 3
    for k in range(end4, len(full)):
        hist.write_bytes(full[:k])
        with LossHistory(hist) as h:
            want = 5 if k >= end5 else 4
            assert len(h) == want and h.last_step == want, k
            if k == len(full):
                assert h.repairs == []
            else:
                assert len(h.repairs) == 1, k
                assert f"torn tail at byte {end4 if k < end5 else end5}" in h.repairs[0], k
                assert str(hist) in h.repairs[0]
        assert steps_on_disk(hist) == list(range(1, want + 1)), k
        if want == 4:
            assert hist.read_bytes() == full[:end4] + b"\n]\n"
        with LossHistory(hist) as h:                    # repaired: appends continue
            assert h.repairs == []
            h.append(rec(6))
        assert steps_on_disk(hist) == list(range(1, want + 1)) + [6]


@pytest.mark.parametrize("torn_at", [None, 7])
def test_nul_padding_after_power_cut_is_dropped(hist, torn_at, caplog):
    full = build(hist, 5)
    body = full if torn_at is None else full[:len(full) - 3 - torn_at]
    hist.write_bytes(body + b"\x00" * 4096)
    with caplog.at_level("WARNING", logger="shared.run.loss_history"):
        with LossHistory(hist) as h:
            want = 5 if torn_at is None else 4
            assert len(h) == want
            assert "NUL bytes" in h.repairs[0] and "torn tail at byte" in h.repairs[0]
    assert "torn tail at byte" in caplog.text
    assert steps_on_disk(hist) == list(range(1, want + 1))
    assert b"\x00" not in hist.read_bytes()


def test_nul_block_over_the_tail_keeps_complete_records(hist):
    full = build(hist, 5)
    k = full.index(b'{"step":4') + 10                  # record 4 and 5 overwritten by zeros
    hist.write_bytes(full[:k] + b"\x00" * (len(full) - k))
    with LossHistory(hist) as h:
        assert len(h) == 3 and "NUL bytes" in h.repairs[0]
    assert steps_on_disk(hist) == [1, 2, 3]


def test_glued_records_are_both_recovered(hist):
    full = build(hist, 3)
    r4, r5 = (json.dumps(rec(s), separators=(",", ":")).encode() for s in (4, 5))
    hist.write_bytes(full[:-3] + b",\n" + r4 + r5 + b"\n]\n")
    with LossHistory(hist) as h:
        assert len(h) == 5 and h.last_step == 5
        assert f"torn tail at byte {len(full) - 3 + 2 + len(r4)}" in h.repairs[0]  # after r4
        assert "glued" in h.repairs[0] and "0 bytes dropped" in h.repairs[0]
    assert steps_on_disk(hist) == [1, 2, 3, 4, 5]
    assert hist.read_text().count("\n") == 5 + 2        # one record per line again


def test_torn_record_glued_to_a_complete_one(hist):
    full = build(hist, 3)
    r4, r5 = (json.dumps(rec(s), separators=(",", ":")).encode() for s in (4, 5))
    hist.write_bytes(full[:-3] + b",\n" + r4[:20] + r5 + b"\n]\n")
    with LossHistory(hist) as h:
        assert h.last_step == 5 and len(h) == 4
        assert "incomplete record" in h.repairs[0]
    assert steps_on_disk(hist) == [1, 2, 3, 5]


def test_missing_closing_bracket(hist):
    full = build(hist, 3)
    hist.write_bytes(full[:-2])                          # "...}\n"
    with LossHistory(hist) as h:
        assert len(h) == 3 and "no closing ]" in h.repairs[0]
        assert f"torn tail at byte {len(full) - 3}" in h.repairs[0]
    assert hist.read_bytes() == full


def test_duplicate_steps_after_a_crash_are_dropped_with_a_warning(hist):
    full = build(hist, 4)
    r3 = json.dumps(rec(3), separators=(",", ":")).encode()
    r5 = json.dumps(rec(5), separators=(",", ":")).encode()
    hist.write_bytes(full[:-3] + b",\n" + r3 + b",\n" + r5 + b"\n]\n")
    with LossHistory(hist) as h:
        assert len(h) == 5 and h.last_step == 5
        assert any("step 3 not after step 4" in m for m in h.repairs)
    assert steps_on_disk(hist) == [1, 2, 3, 4, 5]


def test_garbage_file_is_moved_aside_and_a_fresh_history_started(hist):
    hist.write_bytes(b"\x00\x00garbage that is not a history")
    with LossHistory(hist) as h:
        assert len(h) == 0 and "moved aside" in h.repairs[0]
        h.append(rec(1))
    (aside,) = [p for p in hist.parent.iterdir() if ".corrupt-" in p.name]
    assert aside.read_bytes() == b"\x00\x00garbage that is not a history"
    assert steps_on_disk(hist) == [1]


def test_zero_length_file_starts_fresh(hist):
    hist.write_bytes(b"")
    with LossHistory(hist) as h:
        assert len(h) == 0 and "empty file" in h.repairs[0]
    assert hist.read_bytes() == b"[\n]\n"


def test_readers_tolerate_damage_without_writing(hist):
    full = build(hist, 5)
    damaged = full[:-20] + b"\x00" * 50
    hist.write_bytes(damaged)
    assert [r["step"] for r in iter_records(hist)] == [1, 2, 3, 4]
    assert hist.read_bytes() == damaged
    assert list(iter_records(hist.parent / "missing.json")) == []


def test_explicit_repair_returns_messages(hist):
    full = build(hist, 3)
    hist.write_bytes(full[:-10])
    (msg,) = repair(hist)
    assert "torn tail at byte" in msg
    assert repair(hist) == []
    assert steps_on_disk(hist) == [1, 2]


# --- rewind -----------------------------------------------------------------------------------

def test_rewind_moves_records_past_the_checkpoint_with_the_reason(hist):
    build(hist, 250)
    rewound = hist.parent / ".loss.rewound.json"
    assert rewind(hist, 200, rewound, "resumed from step_000200.bin") == 50
    assert steps_on_disk(hist) == list(range(1, 201))
    moved = json.loads(rewound.read_text())
    assert [r["step"] for r in moved] == list(range(201, 251))
    assert all(r["rewound_reason"] == "resumed from step_000200.bin" for r in moved)
    assert all(isinstance(r["rewound_at"], float) for r in moved)
    assert {k: v for k, v in moved[0].items() if not k.startswith("rewound_")} == \
        json.loads(json.dumps(rec(201)))
    # a second crash: the rewound file is appended to, even with steps going back
    with LossHistory(hist) as h:
        assert h.last_step == 200
        h.append_many([rec(s) for s in range(201, 231)])
    assert rewind(hist, 200, rewound, "second crash") == 30
    assert [r["step"] for r in json.loads(rewound.read_text())] == \
        list(range(201, 251)) + list(range(201, 231))
    assert rewind(hist, 200, rewound, "nothing to do") == 0
    assert rewind(hist, 0, rewound, "from scratch") == 200
    assert hist.read_bytes() == b"[\n]\n"


def test_rewind_through_an_open_history(hist):
    rewound = hist.parent / ".loss.rewound.json"
    with LossHistory(hist) as h:
        h.append_many([rec(s) for s in range(1, 11)])
        assert h.rewind(6, rewound, "resume") == 4
        assert len(h) == 6 and h.last_step == 6
        h.append(rec(7))
    assert steps_on_disk(hist) == list(range(1, 8))


def test_rewind_repairs_a_torn_tail_first(hist):
    full = build(hist, 10)
    hist.write_bytes(full[:-15])
    rewound = hist.parent / ".loss.rewound.json"
    assert rewind(hist, 5, rewound, "crash") == 4
    assert steps_on_disk(hist) == [1, 2, 3, 4, 5]
    assert steps_on_disk(rewound) == [6, 7, 8, 9]


def test_numpy_like_scalars_are_converted(hist):
    class Scalar:
        def __init__(self, v):
            self.v = v

        def tolist(self):
            return self.v

    with LossHistory(hist) as h:
        h.append({"step": 1, "loss": Scalar(float("nan")), "n": Scalar(3)})
    assert json.loads(hist.read_text()) == [{"step": 1, "loss": None, "n": 3}]


# --- cost with the history's size ---------------------------------------------------------------

def _big_history(path, n):
    """A canonical history of n records written as bytes (fast), about 230 bytes per record."""
    lines = [json.dumps(rec(s), separators=(",", ":")).encode() for s in range(1, n + 1)]
    path.write_bytes(b"[\n" + b",\n".join(lines) + b"\n]\n")


def test_opening_and_rewinding_a_long_history_reads_it_without_holding_it(hist):
    """Opening (the proxy does it at every start) and rewinding read the file through a memory
    map: the heap they use does not grow with the history (80 MB at 200,000 records would;
    docs/history.md#cost)."""
    import tracemalloc
    _big_history(hist, 60_000)
    size = hist.stat().st_size
    assert size > 10_000_000
    tracemalloc.start()
    try:
        with LossHistory(hist) as h:
            assert len(h) == 60_000 and h.last_step == 60_000 and h.repairs == []
            h.append(rec(60_001))
        assert rewind(hist, 59_990, hist.with_name(".loss.rewound.json"), "test") == 11
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * 2**20 < size / 3, (peak, size)         # a few 1 MiB scan chunks
    with LossHistory(hist) as h:
        assert len(h) == 59_990 and h.last_step == 59_990


def test_whole_file_scans_in_small_chunks_find_exactly_what_one_pass_finds(hist, monkeypatch):
    """The chunked scans (shared/run/loss_history.py _count, _CHUNK) at a chunk of a few bytes, so
    patterns cross every boundary: healthy, torn, glued and out-of-order histories open
    exactly as with one chunk."""
    import shared.run.loss_history as lh
    full = build(hist, 12)
    cases = {"healthy": full, "torn": full[:-40], "no close": full[:-3],
             "glued": full.replace(b'},\n{"step":7', b'}{"step":7'),
             "dup": full.replace(b'{"step":9,', b'{"step":8,'),
             "nul": full[:-3] + b"\x00" * 64}
    results = {}
    for chunk in (1 << 22, 1, 2, 3, 5, 64):
        monkeypatch.setattr(lh, "_CHUNK", chunk)
        for name, body in cases.items():
            hist.write_bytes(body)
            with LossHistory(hist) as h:  # the copy of damaged bytes is named by the second
                got = (len(h), h.last_step,
                       [re.sub(r"damaged-\d+(\.\d+)?", "damaged-T", m.split(": ", 1)[1])
                        for m in h.repairs], hist.read_bytes())
            results.setdefault(name, got)
            assert got == results[name], (name, chunk)
    assert results["healthy"][:3] == (12, 12, [])
    assert results["dup"][1] == 12 and results["torn"][1] == 11


# --- memory and the tail reader -----------------------------------------------------------------

def test_tail_reader_finds_every_range_with_a_tiny_search_window(hist, monkeypatch):
    """iter_records_after's binary search (a probe window of a few bytes, so probes land inside
    records) returns exactly the whole-file reader's range, on a healthy history and on one damaged in
    the middle (NUL block, glued records)."""
    import shared.run.loss_history as lh
    full = build(hist, 300)
    bodies = {"healthy": full,
              "damaged": full.replace(b'},\n{"step":150,', b'},\n' + b"\x00" * 40 + b'{"step":150,')
              .replace(b'},\n{"step":201', b'}{"step":201')}
    for window in (1 << 16, 7, 64, 300):
        monkeypatch.setattr(lh, "_SEEK_WINDOW", window)
        for name, body in bodies.items():
            hist.write_bytes(body)
            for after, end in ((0, None), (-5, 3), (10, 20), (149, 151), (150, None),
                               (200, 202), (299, None), (300, None), (400, None)):
                got = [r["step"] for r in iter_records_after(hist, after, end)]
                want = [r["step"] for r in iter_records(hist)
                        if after < r["step"] <= (math.inf if end is None else end)]
                assert got == want, (name, window, after, end)


def _write_long_history(path, n):
    """A canonical history of `n` realistic records (~480 bytes each), written in one go."""
    arms = ("python-docs", "repo-code", "repo-docstrings")
    lines = []
    for k in range(1, n + 1):
        r = {"step": k, "loss": 4.0 - k * 1e-5, "lr": 3e-3, "tokens": k * 2048,
             "arms": {a: (k + i) % 7 for i, a in enumerate(arms)}, "p": {a: 1 / 3 for a in arms},
             "period": (k - 1) // 25, "grad_norm": 0.123456789,
             "arm_loss": {a: 3.0 + k % 11 / 10 for a in arms}, "step_time": 0.05,
             "time": 1.7e9 + k, "phase": {"label": "initial", "index": 0}}
        lines.append(json.dumps(r, separators=(",", ":")))
    path.write_bytes(b"[\n" + ",\n".join(lines).encode() + b"\n]\n")


_PEAK_SCRIPT = r"""
import json, sys
from shared.run.loss_history import LossHistory, iter_records_after
path, after = sys.argv[1], int(sys.argv[2])
def peak():   # this process's peak resident set, mapped file pages included (ru_maxrss
    with open("/proc/self/status") as f:   # would carry the forking parent's over)
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) * 1024
base = peak()
with LossHistory(path) as h:
    n = len(h)
opened = peak()
k = sum(1 for _ in iter_records_after(path, after))
print(json.dumps({"records": n, "tail": k, "base": base, "open": opened, "tail_peak": peak()}))
"""


@pytest.mark.slow
def test_opening_and_reading_a_long_tail_keep_peak_rss_flat(tmp_path):
    """A fresh process opens a 100,000-record history (48 MB) and streams the 99,000 records
    after an old snapshot: its peak resident memory (VmHWM, page-cache pages mapped in
    included) grows by less than 10 MiB, far below the file's size (docs/history.md#cost)."""
    import subprocess
    import sys
    hist = tmp_path / ".loss.json"
    _write_long_history(hist, 100_000)
    size = hist.stat().st_size
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(hist), "1000"],
                         capture_output=True, text=True, check=True, timeout=120)
    m = json.loads(out.stdout)
    assert (m["records"], m["tail"]) == (100_000, 99_000)
    mib = 2 ** 20
    assert m["open"] - m["base"] < 10 * mib < size / 3, (m, size)
    assert m["tail_peak"] - m["base"] < 10 * mib, (m, size)


def test_the_tail_reads_the_last_complete_records_from_the_end(hist):
    """`tail_records`: the records in the last N bytes, the cut first line and a torn last one
    skipped, glued records split, exactly what the whole-file reader gives for those steps."""
    from shared.run.loss_history import tail_records
    full = build(hist, 300)
    whole = list(iter_records(hist))
    tail = tail_records(hist, 4096)
    assert 10 < len(tail) < 300 and tail == whole[-len(tail):]
    assert tail_records(hist, 10 ** 9) == whole
    hist.write_bytes(full[:-40])  # a torn last record
    assert tail_records(hist, 4096)[-1]["step"] == 299
    hist.write_bytes(full.replace(b'},\n{"step":298', b'}{"step":298'))  # glued
    assert [r["step"] for r in tail_records(hist, 4096)][-3:] == [298, 299, 300]
    assert tail_records(hist.parent / "missing.json") == []
