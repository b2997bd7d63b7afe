#!/usr/bin/env python3
"""Benchmark (docs/history.md): the rewind path with 200,000 realistic records.

Resume from an older checkpoint S = what the proxy does: rewind `.loss.json` past S into
`.loss.rewound.json`, read the phase's records back, and rebuild the bandit (`.state.json`) by
replaying them. The issue's bar is under 2 s in all; this prints each part and the total
(medians of --rounds rewinds, each followed by appending the records again), and the replay
rate. Not a test: run it by hand.  python scripts/bench_rewind.py [--records N]
"""
import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.mixture.controller import MixtureController
from proxy.run_files.phases import Phase
from proxy.run_files.state_snapshots import append_snapshot, find_snapshot, mark_rewound  # noqa: E402
from shared.run.layout import RunLayout  # noqa: E402
from shared.run.loss_history import LossHistory, iter_records_after  # noqa: E402

ARMS = ["python-docs", "repo-code", "repo-docstrings"]


def record(k: int, rng: random.Random) -> dict:
    counts = {a: 0 for a in ARMS}
    for _ in range(16):
        counts[rng.choice(ARMS)] += 1
    r = {"step": k, "loss": 4.0 - k * 1e-5 + rng.random() * 0.1, "lr": 3e-3, "tokens": k * 16 * 128,
         "arms": counts, "p": {a: 1 / 3 for a in ARMS}, "period": (k - 1) // 25,
         "grad_norm": rng.random(), "arm_loss": {a: 3.0 + rng.random() for a in ARMS if counts[a]},
         "step_time": 0.05, "time": 1.7e9 + k, "phase": {"label": "initial", "index": 0}}
    if k % 25 == 0:
        r["probe"] = {a: 3.0 - k * 1e-5 + rng.random() * 0.01 for a in ARMS}
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--rewind", type=int, default=500, help="records past the checkpoint")
    ap.add_argument("--rounds", type=int, default=8,
                    help="rewinds timed (each followed, untimed, by appending the records again)")
    a = ap.parse_args()
    rng = random.Random(0)
    from scripts.bench_stats import add_result, result_line
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ".loss.json"
        layout = RunLayout(d)
        live = MixtureController(ARMS, Phase(0, "initial", 0), "heldout_progress", 200, 25)
        keep = a.rewind + 100   # the newest records, to append again after each rewind
        newest = []
        with LossHistory(path) as h:  # the live run: history + a snapshot per checkpoint (100)
            for k in range(1, a.records + 1):
                r = record(k, rng)
                h.append(r)
                live.observe(r)
                if k > a.records - keep:
                    newest.append(r)
                if k % 100 == 0:
                    append_snapshot(layout, live.to_snapshot())
        s = a.records - a.rewind
        s -= s % 100  # the older checkpoint resumed from
        totals, parts = [], []
        for i in range(a.rounds):
            t0 = time.perf_counter()
            with LossHistory(path) as h:
                moved = h.rewind(s, Path(d) / f".loss.rewound-{i}.json", f"resumed from step {s}")
            mark_rewound(layout, s)
            t_rewind = time.perf_counter() - t0

            t0 = time.perf_counter()  # what the proxy does: snapshot at or before S + tail replay
            snap = find_snapshot(layout, 0, 0, s)
            fast = MixtureController(ARMS, Phase(0, "initial", 0), "heldout_progress", 200, 25)
            fast.restore(snap)
            tail = list(iter_records_after(path, snap["step"], s))
            for r in tail:
                fast.observe(r)
            t_fast = time.perf_counter() - t0
            totals.append(t_rewind + t_fast)
            parts.append((t_rewind, t_fast))
            with LossHistory(path) as h:   # the run goes on past S again (untimed)
                for r in newest:
                    if r["step"] > s:
                        h.append(r)

        t0 = time.perf_counter()  # the fallback: replay the phase from its start
        recs = list(iter_records_after(path, 0, s))
        t_read = time.perf_counter() - t0
        mix = MixtureController(ARMS, Phase(0, "initial", 0), "heldout_progress", 200, 25)
        for r in recs:
            mix.observe(r)
        t_replay = time.perf_counter() - t0 - t_read
        assert fast.to_snapshot() == mix.to_snapshot(), "snapshot path differs from full replay"
    med = statistics.median(totals)
    print(f"records {a.records:,}, rewound {moved:,} past step {s:,}, {a.rounds} rounds")
    print(f"rewind .loss.json                  {statistics.median(p[0] for p in parts):6.3f} s")
    print(f"rebuild from snapshot + {len(tail)} records {statistics.median(p[1] for p in parts):6.3f} s")
    print(f"  rewind + rebuild (the proxy's path) {med:6.3f} s median  (bar < 2 s; ratio to "
          f"bar {med / 2:.2f})")
    add_result(result_line("rewind_and_rebuild_seconds_over_2s", [x / 2 for x in totals], 1.0))
    print(f"fallback: read {len(recs):,} records {t_read:6.3f} s, replay {t_replay:6.3f} s "
          f"({len(recs) / t_replay:,.0f} records/s); identical state: yes")

if __name__ == "__main__":
    main()
