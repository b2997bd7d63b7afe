"""`sample` beside a live training run vs on an idle run (docs/operations.md#beside-a-live-run):
the wall time of `python -m proxy sample --samples 2` while the same run's copy trains on the
same machine, against the same command while that training is paused. Target: within 2x
(ratio <= 2.0); before the read-only commands took one thread by default it was 15-25x on 2
cores (129.7 s vs 5.3 s for andrea-12m).

    .venv/bin/python scripts/bench_sample.py [--preset andrea-12m] [--rounds 6] [--tokens 50]

One run is created (bytes tokenizer, seed 1337, --batch-size 8 --micro-batch-size 4) and trained
to a checkpoint; a copy of it then trains in the background for the whole benchmark. Each round
times `sample` twice, side by side, alternating which goes first (scripts/bench_stats.py):
"beside" with the training running, "idle" with the training's processes stopped (SIGSTOP, then
SIGCONT), so both see the same files, page cache and machine. Each round gives one ratio
beside / idle; the figure is their median with the lowest and highest, the geometric mean with
the 95 % interval of the median that decides (scripts/bench_stats.py), and the training's
seconds per update while sampling vs with neither side running. The sampling seed is 0 (the
same text each time). The last line is `RESULT {json}`: figure, ratio, low, high, target, met
(null when the interval straddles the target or under 6 rounds: it cannot decide).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_stats import interleaved  # noqa: E402

TARGET = 2.0


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    return dict(env, PYTHONPATH=str(ROOT))


def _run_args(run: Path, a, steps: int) -> list[str]:
    return [sys.executable, "-m", "proxy", "run", "--run-dir", str(run), "--preset", a.preset,
            "--tokenizer", "bytes", "--batch-size", "8", "--micro-batch-size", "4",
            "--max-steps", str(steps), "--checkpoint-every", "2", "--seed", "1337",
            "--print-every", "1", "--device", "cpu", "--arm", f"code=text:{a.corpus}"]


def _sample(run: Path, a) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "proxy", "sample", "--run-dir", str(run),
                        "--samples", "2", "--tokens", str(a.tokens), "--seed", "0"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"sample failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def _tree(pid: int) -> list:
    import psutil
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_tree(pid: int, sig: int) -> None:
    import psutil
    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):   # gone meanwhile
            p.send_signal(sig)


def _last_step(run: Path) -> int:
    try:
        with open(run / ".loss.json", "rb") as f:
            f.seek(max(0, (run / ".loss.json").stat().st_size - 4096))
            tail = f.read().decode("utf-8", "replace")
        return max(int(x) for x in re.findall(r'"step":\s*(\d+)', tail))
    except (OSError, ValueError):
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="andrea-12m")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=50, help="tokens per sample (default 50)")
    ap.add_argument("--corpus", default=None, help="a text file or directory to train on "
                    "(default: this project's own *.py files)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_sample."))
    if a.corpus is None:
        a.corpus = str(work / "corpus")
        os.makedirs(a.corpus)
        for i, f in enumerate(sorted(ROOT.rglob("*.py"))):
            shutil.copyfile(f, Path(a.corpus) / f"{i:04d}.py")
    live = None
    try:
        idle = work / "idle"
        print(f"# creating {a.preset} run {idle} and training it to step 2 ...", flush=True)
        r = subprocess.run(_run_args(idle, a, 2), cwd=ROOT, env=_env(), capture_output=True,
                           text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"run failed ({r.returncode}):\n{r.stderr[-3000:]}")
        train = work / "train"
        shutil.copytree(idle, train)
        with open(work / "train.log", "wb") as log:   # the child keeps its own descriptor
            live = subprocess.Popen(_run_args(train, a, 100000), cwd=ROOT, env=_env(),
                                    stdout=log, stderr=subprocess.STDOUT)
        t_end = time.monotonic() + 1800
        while _last_step(train) < 4:   # the worker is training, past its start-up
            if live.poll() is not None or time.monotonic() > t_end:
                raise SystemExit(f"the training run did not train: see {work / 'train.log'}")
            time.sleep(0.5)
        windows: list[tuple[str, float, float]] = []

        def beside() -> float:
            t0 = time.time()
            s = _sample(idle, a)
            windows.append(("beside", t0, time.time()))
            return s

        def quiet() -> float:
            t0 = time.time()
            _signal_tree(live.pid, signal.SIGSTOP)
            try:
                return _sample(idle, a)
            finally:
                _signal_tree(live.pid, signal.SIGCONT)
                windows.append(("idle", t0, time.time()))

        def report(i, b, q, ratio):
            print(f"round {i}: beside {b:.2f} s, idle {q:.2f} s, ratio {ratio:.2f}", flush=True)

        t_warm = time.time()
        _sample(idle, a)   # warm the page cache and the imports once, untimed
        windows.append(("warm-up", t_warm, time.time()))
        res = interleaved(beside, quiet, a.rounds, lambda b, q: b / q, report)
        recs = json.loads((train / ".loss.json").read_text())
        gaps_in, gaps_out = [], []

        def overlaps(kind: str, t0: float, t1: float) -> bool:
            return any(k == kind and t0 < w1 and w0 < t1 for k, w0, w1 in windows)

        for x, y in itertools.pairwise(recs):
            if y["step"] != x["step"] + 1 or x["step"] < 4:
                continue
            if overlaps("idle", x["time"], y["time"]) or overlaps("warm-up", x["time"], y["time"]):
                continue   # stopped (SIGSTOP) for part of it, or beside the untimed warm-up
            inside = overlaps("beside", x["time"], y["time"])
            (gaps_in if inside else gaps_out).append(y["time"] - x["time"])
        print(res.report("sample_beside_over_idle", TARGET))
        print(f"sampling seed 0, training seed 1337, preset {a.preset}, {a.tokens} tokens x 2 "
              f"samples; load average {os.getloadavg()[0]:.2f}")
        if gaps_in and gaps_out:
            print(f"training: {statistics.median(gaps_in):.2f} s per update while sampling "
                  f"({len(gaps_in)} updates) vs {statistics.median(gaps_out):.2f} s with neither "
                  f"side of a round running ({len(gaps_out)}; updates that a SIGSTOP paused are "
                  f"left out)")
        return 0
    finally:
        if live is not None and live.poll() is None:
            _signal_tree(live.pid, signal.SIGCONT)
            live.send_signal(signal.SIGTERM)
            try:
                live.wait(timeout=120)
            except subprocess.TimeoutExpired:
                _signal_tree(live.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
