"""Supervision overhead (docs/operations.md#benchmarks): steps/s of the worker under the proxy
(handshake read per step, a report per step, sidecars, bandit, signal checks) vs the same training
loop alone (worker.trainer.Trainer.train_step driven in-process with a fixed policy), same model,
same seed, same data, side by side, alternating, each side in a fresh process (the worker the
proxy spawns; a child running the loop alone). Target: ratio >= 0.98.

    .venv/bin/python scripts/bench_supervision.py [--preset andrea-tiny] [--steps 200] [--rounds 8]

Both sides see the bandit's prior (uniform) for every step (--bandit-warmup past the end), and no
checkpoint or sample audit falls inside the timed window (cadence past the end), so they do the
same arithmetic; the loss of every timed step is compared as a check. Steps/s under the proxy are
measured from the `time` field of `.loss.json` records (the interval before each of steps
W+1..N, so start-up and the final checkpoint are not counted); alone, from wall time around the
same steps. Rounds alternate which side goes first (scripts/bench_stats.py); each round gives one
paired ratio of median step intervals, and the median of those ratios, with its spread, is the
figure (robust to other processes' bursts on a shared machine); the mean-based ratio is printed
too.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_stats import interleaved  # noqa: E402


def proxy_args(run_dir: Path, a) -> list[str]:
    return [sys.executable, "-m", "proxy", "run", "--run-dir", str(run_dir), "--preset", a.preset,
            "--tokenizer", "bytes", "--max-steps", str(a.steps), "--checkpoint-every", str(10 * a.steps),
            "--bandit-warmup", str(10 * a.steps), "--print-every", str(10 * a.steps), "--seed", "1337",
            "--device", a.device]


def under_proxy(template: Path, work: Path, a) -> tuple[float, list[float]]:
    d = work / f"proxy-{time.monotonic_ns()}"
    shutil.copytree(template, d)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(proxy_args(d, a), cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"proxy run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    m = FILED.search(r.stderr)
    if m is None:
        raise SystemExit(f"no filing-lag line in the proxy's log:\n{r.stderr[-3000:]}")
    LAGS.append((float(m["lag_s"]), float(m["lag_steps"]), int(m["waits"]), float(m["wait_s"])))
    recs = json.loads((d / ".loss.json").read_text())
    t = {x["step"]: x["time"] for x in recs}
    w, n = a.warmup, a.steps
    intervals = [t[k] - t[k - 1] for k in range(w + 1, n + 1)]
    losses = [x["loss"] for x in recs if w < x["step"] <= n]
    direct_cost(d, recs[-1])
    shutil.rmtree(d, ignore_errors=True)
    return intervals, losses


DIRECT: list[float] = []
LAGS: list[tuple[float, float, int, float]] = []  # per proxy run: lag s, lag steps, waits, wait s
FILED = re.compile(r"step reports filed at most (?P<lag_s>[\d.]+) s \((?P<lag_steps>[\d.]+) steps\)"
                   r".*?waited for a policy (?P<waits>\d+) time\(s\), (?P<wait_s>[\d.]+) s")


def direct_cost(run_dir: Path, rec: dict, n: int = 300) -> None:
    """The worker's own per-step supervision work, timed alone (insensitive to other load):
    one read of the real `.handshake.json` (policy + control) and one report line appended."""
    from shared.run.handshake import ReportWriter, read_handshake
    from shared.run.layout import RunLayout
    layout = RunLayout(run_dir)
    layout.reports.unlink(missing_ok=True)
    w = ReportWriter(layout)
    rec = dict(rec, type="step")
    t0 = time.perf_counter()
    for _ in range(n):
        read_handshake(layout)
        w.write(rec)
    DIRECT.append((time.perf_counter() - t0) / n)
    w.close()


ALONE = r"""
import json, shutil, sys, time
run_dir, device, steps, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from worker.signals import SignalFlags
from worker.trainer import Trainer, WorkerOptions
tr = Trainer(WorkerOptions(run_dir=run_dir, device=device), SignalFlags())
probs = {n: 1.0 / len(tr.sampler.names) for n in tr.sampler.names}
losses, intervals, prev = [], [], None
for k in range(1, steps + 1):
    rec = tr.train_step(k, probs)
    now = time.time()
    if k > warmup:
        intervals.append(now - prev)
        losses.append(rec["loss"])
    prev = now
print(json.dumps({"intervals": intervals, "losses": losses}))
"""


def alone(template: Path, work: Path, a) -> tuple[list[float], list[float]]:
    """The same loop without the proxy: Trainer.train_step(k, uniform policy) for k = 1..N, in
    a fresh process like the worker under the proxy (not this one, which created the run: run
    creation pins glibc's mmap threshold, which slowed that side's every large allocation)."""
    from scripts.bench_stats import run_json
    d = work / f"alone-{time.monotonic_ns()}"
    shutil.copytree(template, d)
    try:
        r = run_json(["-c", ALONE, str(d), a.device, str(a.steps), str(a.warmup)])
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return r["intervals"], r["losses"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="andrea-tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20, help="untimed first steps")
    ap.add_argument("--rounds", type=int, default=8, help="paired rounds (at least 6 to decide)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda (the same on both sides)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-supervision-"))
    try:
        from proxy.commands.run_args import add_run_args, config_from_args
        from proxy.supervision.run_setup import create_run
        from shared.run.layout import RunLayout
        template = work / "template"
        p = argparse.ArgumentParser()
        add_run_args(p)
        args = p.parse_args(proxy_args(template, a)[4:])
        create_run(RunLayout(template), config_from_args(args))
        sup, alo, losses = [], [], {"p": [], "a": []}

        def side(fn, into, key):
            def run():
                intervals, ls = fn(template, work, a)
                into.extend(intervals)
                losses[key].append(ls)
                return statistics.median(intervals)
            return run

        pr = interleaved(side(under_proxy, sup, "p"), side(alone, alo, "a"), a.rounds,
                         lambda p, q: q / p,
                         lambda i, p, q, x: print(f"round {i}: step time (median) under the proxy "
                                                  f"{p * 1e3:.1f} ms, alone {q * 1e3:.1f} ms, "
                                                  f"ratio {x:.3f}", flush=True))
        same = all(lp == la for lp, la in zip(losses["p"], losses["a"]))
        # the median step interval resists bursts of load from other processes on a shared
        # machine; the mean (total time) is printed too
        med_p, med_a = statistics.median(sup), statistics.median(alo)
        print(f"\n{a.preset}, {a.steps} steps (timed {a.warmup + 1}..{a.steps}), {a.rounds} rounds")
        print(f"steps/s under the proxy (median step) {1 / med_p:.2f}   (mean: {1 / statistics.mean(sup):.2f})")
        print(f"steps/s alone (median step)           {1 / med_a:.2f}   (mean: {1 / statistics.mean(alo):.2f})")
        print(f"identical losses on both sides        {'yes' if same else 'NO'}")
        print(pr.report("supervision_alone_over_proxy_step_time", 0.98, lower_is_better=False))
        print(f"ratio, mean step                      {statistics.mean(alo) / statistics.mean(sup):.3f}")
        from shared.run.config import load_run_config
        period = load_run_config(RunLayout(template).run_json).probe_every  # the policy period
        print(f"filing lag, worst over {len(LAGS)} proxy runs   {max(x[0] for x in LAGS):.3f} s = "
              f"{max(x[1] for x in LAGS):.1f} steps (a policy period is {period} steps)")
        print(f"worker waits for a policy              {sum(x[2] for x in LAGS)} in all "
              f"({sum(x[3] for x in LAGS):.3f} s)")
        per = statistics.median(DIRECT)
        print(f"worker's supervision work per step    {per * 1e6:.0f} us (handshake read + report) = "
              f"{per / med_a * 100:.2f}% of a step -> ratio bound {med_a / (med_a + per):.4f}")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
