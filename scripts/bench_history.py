"""Benchmark `.loss.json` (docs/operations.md#benchmarks): append cost at 200,000 records vs at 0, bytes written
vs file size, read-back and rewind times. Ratios are measured side by side in one run.

`--memory` measures instead what the proxy's resume does with a long history, each step in a
fresh process (so that nothing the parent allocated counts): open (the torn-tail check),
replay the bandit from the phase start (no snapshot), replay from an old snapshot (the tail
after step 1,000), and rewind 1,000 records. Each prints its peak resident memory (VmHWM: heap
and the file pages mapped in) and its time, `--repeats` times; the target is 150 MB peak
(docs/history.md#cost).

    python scripts/bench_history.py [--records 200000] [--dir /tmp]
    python scripts/bench_history.py --memory [--records 200000] [--repeats 6]
    python scripts/bench_history.py --plot [--records 200000] [--repeats 6] [--baseline-rev REV]

`--plot` measures `python -m proxy plot`'s work (proxy.observation.plot.plot_run: read the
history, draw, write the PNG) on a long history, in fresh processes, side by side with the
plot module of git revision REV (default 041693b: it read the whole history as a list), rounds
interleaved with alternating order: peak RSS (VmHWM) and time of each, the paired ratio of the
peaks and the verdict against 150 MB (docs/operations.md#watching).
"""

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shared.run.loss_history import LossHistory, iter_records, rewind

ARMS = ("repo-docstrings", "repo-code", "python-docs")
WINDOW = 1_000          # appends timed at the start and at the end; records rewound
BATCH = 500             # appends per side per round of the paired append figure


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


MEMORY_TARGET_MB = 150.0
_STEPS = ("open", "replay", "replay_after_snapshot", "rewind")
_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
def hwm():   # peak resident set of this process (the parent's is not inherited, unlike ru_maxrss)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
what, d = sys.argv[1], sys.argv[2]
import proxy.supervision.supervisor  # noqa: F401  (the proxy's imports: its resident floor)
from proxy.mixture.controller import MixtureController
from proxy.run_files.phases import Phase
from shared.run.loss_history import LossHistory, iter_records, iter_records_after
from shared.run.layout import RunLayout
path = d + "/.loss.json"
arms = ["python-docs", "repo-code", "repo-docstrings"]
base, t, n = hwm(), time.perf_counter(), 0
if what == "open":
    with LossHistory(path) as h:
        n = len(h)
elif what.startswith("replay"):
    mix = MixtureController(arms, Phase(0, "initial", 0), "heldout_progress", 200, 25)
    it = iter_records(path) if what == "replay" else iter_records_after(path, 1000)
    for r in it:
        mix.observe(r)
        n += 1
else:
    with LossHistory(path) as h:
        n = h.rewind(h.last_step - 1000, d + "/.loss.rewound.json", "bench")
print(json.dumps({"step": what, "records": n, "seconds": time.perf_counter() - t,
                  "base_mb": base, "peak_mb": hwm()}))
"""


def memory(args) -> None:
    """Peak RSS of each resume step on a long history, in fresh processes (see the docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_rewind import record  # records the mixture controller reads
    from bench_stats import add_result, result_line
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, ".loss.json")
        with open(path, "wb") as f:   # written in one go: the appender is measured elsewhere
            f.write(b"[\n" + b",\n".join(
                json.dumps(record(k, rng), separators=(",", ":")).encode()
                for k in range(1, args.records + 1)) + b"\n]\n")
        size = os.path.getsize(path)
        print(f"history: {args.records:,} records, {size / 2**20:.0f} MiB; seed 0; "
              f"{args.repeats} fresh processes per step; load {os.getloadavg()[0]:.2f}")
        got: dict[str, list[dict]] = {s: [] for s in _STEPS}
        for _ in range(args.repeats):
            for what in _STEPS:
                out = subprocess.run([sys.executable, "-c", _CHILD, what, d, root],
                                     capture_output=True, text=True, check=True)
                got[what].append(json.loads(out.stdout.splitlines()[-1]))
            rw = os.path.join(d, ".loss.rewound.json")
            if os.path.exists(rw):    # put the rewound records back for the next round
                with open(path, "r+b") as f:
                    f.seek(-3, os.SEEK_END)
                    tail = b"".join(b",\n" + json.dumps({k: v for k, v in r.items()
                                                          if not k.startswith("rewound_")},
                                                         separators=(",", ":")).encode()
                                    for r in _read_all(rw))
                    f.write(tail + b"\n]\n")
                os.remove(rw)
    for what in _STEPS:
        runs = got[what]
        peaks = sorted(r["peak_mb"] for r in runs)
        secs = sorted(r["seconds"] for r in runs)
        print(f"{what:<22} {runs[0]['records']:>8,} records  peak RSS {peaks[len(peaks) // 2]:6.1f} MB "
              f"[{peaks[0]:.1f}..{peaks[-1]:.1f}] (floor after imports {runs[0]['base_mb']:.1f})  "
              f"time {secs[len(secs) // 2]:.2f} s [{secs[0]:.2f}..{secs[-1]:.2f}]")
    for what in _STEPS:
        peaks = [r["peak_mb"] / MEMORY_TARGET_MB for r in got[what]]
        add_result(result_line(f"history_{what}_peak_rss_vs_150MB", peaks, target=1.0))


_PLOT_CHILD = r"""
import importlib.util, json, sys, time
sys.path.insert(0, sys.argv[3])
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
src, run = sys.argv[1], sys.argv[2]
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: F401  (both sides import it: part of the floor)
spec = importlib.util.spec_from_file_location("plot_under_test", src)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
base, t = hwm(), time.perf_counter()
mod.plot_run(run)
print(json.dumps({"seconds": time.perf_counter() - t, "base_mb": base, "peak_mb": hwm()}))
"""


def plot_memory(args) -> None:
    """Peak RSS and time of plot_run on a long history: this tree's plot module vs the one
    at --baseline-rev, each in a fresh process, rounds interleaved with alternating order."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_rewind import record
    from bench_stats import PairedRatio

    root = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, ".loss.json")
        with open(path, "wb") as f:
            f.write(
                b"[\n"
                + b",\n".join(
                    json.dumps(record(k, rng), separators=(",", ":")).encode()
                    for k in range(1, args.records + 1)
                )
                + b"\n]\n"
            )
        before = os.path.join(d, "plot_before.py")
        with open(before, "wb") as f:
            f.write(
                subprocess.run(
                    ["git", "show", f"{args.baseline_rev}:proxy/observation/plot.py"],
                    cwd=root,
                    capture_output=True,
                    check=True,
                ).stdout
            )
        after = os.path.join(root, "proxy", "observation", "plot.py")
        print(
            f"plot: {args.records:,} records, {os.path.getsize(path) / 2**20:.0f} MiB; seed 0; "
            f"{args.repeats} rounds, fresh processes, order alternating; baseline plot.py at "
            f"{args.baseline_rev}; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        got: dict[str, list[dict]] = {"before": [], "after": []}
        for i in range(args.repeats):
            for side in ("before", "after") if i % 2 == 0 else ("after", "before"):
                out = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        _PLOT_CHILD,
                        before if side == "before" else after,
                        d,
                        root,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                got[side].append(json.loads(out.stdout.splitlines()[-1]))
            b, a = got["before"][-1], got["after"][-1]
            print(
                f"  round {i + 1}: peak RSS before {b['peak_mb']:.1f} MB ({b['seconds']:.1f} s), "
                f"after {a['peak_mb']:.1f} MB ({a['seconds']:.1f} s); floor after imports "
                f"{a['base_mb']:.1f} MB; load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    pb = [r["peak_mb"] for r in got["before"]]
    pa = [r["peak_mb"] for r in got["after"]]
    print(
        PairedRatio([x / y for x, y in zip(pa, pb)], pa, pb).report("plot_peak_rss_vs_before", None)
    )
    print(
        PairedRatio([x / MEMORY_TARGET_MB for x in pa], pa, [MEMORY_TARGET_MB] * len(pa)).report(
            "plot_peak_rss_vs_150MB", 1.0
        )
    )
    ta = [r["seconds"] for r in got["after"]]
    tb = [r["seconds"] for r in got["before"]]
    print(PairedRatio([x / y for x, y in zip(ta, tb)], ta, tb).report("plot_time_vs_before", None))


def _read_all(path):
    with open(path, "rb") as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)   # history length at the end
    ap.add_argument("--dir", default=None)                    # where the temporary history goes
    ap.add_argument("--memory", action="store_true", help="peak RSS of the resume steps")
    ap.add_argument("--repeats", type=int, default=6, help="--memory: processes per step")
    ap.add_argument("--rounds", type=int, default=10, help="default mode: paired rounds of "
                    f"{BATCH} appends at the full length vs at 0, and rewinds")
    ap.add_argument("--plot", action="store_true", help="peak RSS of plot_run, before vs after")
    ap.add_argument("--baseline-rev", default="041693b", help="--plot: git revision of the "
                    "baseline proxy/observation/plot.py")
    args = ap.parse_args()
    if args.plot:
        plot_memory(args)
        return
    if args.memory:
        memory(args)
        return
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
        back = list(iter_records(path))
        read_s = clock() - t
        assert [r["step"] for r in back] == list(range(1, n + 1))

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_stats import add_result, exact_result_line, interleaved, result_line
        # appends at n records vs at 0, paired: each round appends BATCH records one call each
        # (as the proxy does, one per step) to the long history and to a new one, in
        # alternating order, so a burst of other load lands on both sides of a round
        nxt = [n + 1]
        small = os.path.join(d, "small.loss.json")

        def append_long() -> float:
            recs = [make_record(s, rng) for s in range(nxt[0], nxt[0] + BATCH)]
            nxt[0] += BATCH
            with LossHistory(path) as h:
                t = clock()
                for r in recs:
                    h.append(r)
                return clock() - t

        def append_new() -> float:
            if os.path.exists(small):
                os.unlink(small)
            recs = [make_record(s, rng) for s in range(1, BATCH + 1)]
            with LossHistory(small) as h:
                t = clock()
                for r in recs:
                    h.append(r)
                return clock() - t

        appends = interleaved(append_long, append_new, args.rounds, lambda x, y: x / y)
        # rewinds of the last WINDOW records, each followed (untimed) by appending them again
        rewinds = []
        for i in range(args.rounds):
            with LossHistory(path) as h:
                end = h.last_step
            t = clock()
            moved = rewind(path, end - WINDOW, os.path.join(d, f".loss.rewound-{i}.json"),
                           "bench")
            rewinds.append(clock() - t)
            assert moved == WINDOW
            with LossHistory(path) as h:
                for s in range(end - WINDOW + 1, end + 1):
                    h.append(make_record(s, rng))

    print(f"records                      {n:,}  ({size / n:.0f} bytes/record on disk)")
    print(f"appends total                {total_s:.2f} s")
    print(f"mean append, first {WINDOW:,}     {first * 1e6:.1f} us   (while building)")
    print(f"mean append, last {WINDOW:,}      {last * 1e6:.1f} us")
    print(f"bytes written                {written:,}")
    print(f"final file size              {size:,}")
    print(f"  ratio written/size         {written / size:.3f}  (target <= 1.2; an exact count)")
    print(f"open (check) at {n:,}       {open_s:.3f} s")
    print(f"read all records in order    {read_s:.3f} s")
    print(appends.report("history_append_at_n_over_at_0", 1.5))
    print(f"rewind last {WINDOW:,} records: median {statistics.median(rewinds):.3f} s over "
          f"{len(rewinds)} rounds (target < 2 s); load average {os.getloadavg()[0]:.2f}")
    add_result(exact_result_line("history_bytes_written_over_size", written / size, 1.2))
    add_result(result_line("history_rewind_seconds_over_2s", [x / 2.0 for x in rewinds], 1.0))

if __name__ == "__main__":
    main()
