"""Benchmark `.loss.json` (docs/operations.md#benchmarks): append cost at 200,000 records vs at 0, bytes written
vs file size, read-back and rewind times. Ratios are measured side by side in one run.

    python scripts/bench_history.py [--records 200000] [--dir /tmp]
"""

import argparse
import math
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shared.loss_history import LossHistory, read_records, rewind  # noqa: E402

ARMS = ("repo-docstrings", "repo-code", "python-docs")
WINDOW = 1_000          # appends timed at the start and at the end


def make_record(step: int, rng: random.Random) -> dict:
    weights = [rng.random() + 0.1 for _ in ARMS]
    total = sum(weights)
    r = {
        "step": step,
        "loss": 10.0 * math.exp(-step / 40_000) + rng.random() * 0.1,
        "lr": 6e-4 * min(1.0, step / 2_000),
        "tokens": step * 64 * 256,
        "arms": {a: rng.randint(0, 64) for a in ARMS},
        "p": {a: w / total for a, w in zip(ARMS, weights)},
        "arm_loss": {a: 3.0 + rng.random() for a in ARMS},
        "phase": {"label": "base", "index": 0},
        "time": 1.7e9 + step * 0.35,
        "step_time": 0.3 + rng.random() * 0.1,
    }
    if step % 25 == 0:
        r["probe"] = {a: {"loss": 3.0 + rng.random(), "ppl": 20.0 + rng.random()} for a in ARMS}
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)   # history length at the end
    ap.add_argument("--dir", default=None)                    # where the temporary history goes
    args = ap.parse_args()
    n = args.records
    rng = random.Random(0)
    records = [make_record(s, rng) for s in range(1, n + 1)]

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, ".loss.json")
        per_append = [0.0] * n
        clock = time.perf_counter
        t0 = clock()
        with LossHistory(path) as h:
            for i, r in enumerate(records):
                t = clock()
                h.append(r)
                per_append[i] = clock() - t
            written = h.bytes_written
        total_s = clock() - t0
        size = os.path.getsize(path)
        first = sum(per_append[:WINDOW]) / WINDOW
        last = sum(per_append[-WINDOW:]) / WINDOW

        t = clock()
        with LossHistory(path) as h:
            assert len(h) == n and not h.repairs
        open_s = clock() - t

        t = clock()
        back = read_records(path)
        read_s = clock() - t
        assert [r["step"] for r in back] == list(range(1, n + 1))

        t = clock()
        moved = rewind(path, n - WINDOW, os.path.join(d, ".loss.rewound.json"), "bench")
        rewind_s = clock() - t
        assert moved == WINDOW

    print(f"records                      {n:,}  ({size / n:.0f} bytes/record on disk)")
    print(f"appends total                {total_s:.2f} s")
    print(f"mean append, first {WINDOW:,}     {first * 1e6:.1f} us")
    print(f"mean append, last {WINDOW:,}      {last * 1e6:.1f} us")
    print(f"  ratio last/first           {last / first:.2f}   (target <= 1.5)")
    print(f"bytes written                {written:,}")
    print(f"final file size              {size:,}")
    print(f"  ratio written/size         {written / size:.3f}  (target <= 1.2)")
    print(f"open (check) at {n:,}       {open_s:.3f} s")
    print(f"read all records in order    {read_s:.3f} s")
    print(f"rewind last {WINDOW:,} records     {rewind_s:.3f} s  (target < 2 s)")


if __name__ == "__main__":
    main()
