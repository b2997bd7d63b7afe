"""Benchmark of arm tokenization at scale (docs/data.md#benchmark): throughput of the
streaming pipeline against the tokenizer's fastest batch call, `Tokenizer.encode_batch_fast`
(what a user of `tokenizers` would run), over the same text already in memory, and the peak RSS
of creating a run over corpora of two sizes (memory must not grow with the corpus). The two
throughput sides each run in a fresh process, interleaved over --rounds rounds in alternating
order (scripts/bench_stats.py); the median of the paired ratios and its interval decide.

No downloads: the corpora are built deterministically from this Python installation's own
files (standard-library sources and the pydoc reference text), repeated with a line-level
shuffle seeded per copy until the size is reached. Each creation runs in its own process
(`python -m proxy` is not needed: `proxy.supervision.run_setup.create_run` with `--tokenizer bpe`), and its
peak RSS is that process's ru_maxrss. The memory figure pairs the peak RSS of re-tokenizing the
large corpus with that of the small one (the tokenizer kept), --rounds rounds in alternating
order: target <= 1.2, memory flat in the corpus's size.

    .venv/bin/python scripts/bench_data.py                     # 100 MB and 1000 MB
    .venv/bin/python scripts/bench_data.py --sizes-mb 20 200    # quicker
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def seed_lines() -> list[str]:
    """Lines of local text: the stdlib's .py files and the pydoc topics, in a fixed order."""
    lines = []
    std = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(std.glob("*.py")):
        lines += f.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    try:
        from pydoc_data.topics import topics
        for k in sorted(topics):
            lines += topics[k].splitlines(keepends=True)
    except ImportError:
        pass
    return [ln for ln in lines if ln.strip()]


def build_corpus(path: Path, size: int) -> None:
    """Write about `size` bytes of text to `path` (deterministic), in 4 MB blocks."""
    lines = seed_lines()
    rng = random.Random(1234)
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            start = rng.randrange(len(lines))
            block = "".join(lines[start:start + 40_000])
            b = block[:size - written] if written + len(block) > size else block
            f.write(b)
            written += len(b.encode("utf-8"))


CHILD = r"""
import json, resource, sys, time, logging
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stderr)
from shared.run.config import PRESETS, ArmSpec, RunConfig
from shared.run.layout import RunLayout
from proxy.supervision.run_setup import create_run
cfg = RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], tokenizer=sys.argv[4],
                arms=[ArmSpec("corpus", "text", sys.argv[2])])
t = time.perf_counter()
create_run(RunLayout(sys.argv[3]), cfg)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def create_in_child(corpus: Path, run_dir: Path, tokenizer: str = "bpe") -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(corpus), str(run_dir),
                          tokenizer], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"creation failed:\n{out.stderr[-3000:]}")
    sys.stderr.write(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


BASELINE = r"""
import json, sys, time
from tokenizers import Tokenizer
corpus, tok_json, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = Tokenizer.from_file(tok_json)
with open(corpus, encoding="utf-8") as f:
    text = f.read(limit)
items = [text[i:i + (1 << 16)] for i in range(0, len(text), 1 << 16)]
nbytes = len(text.encode("utf-8"))
encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
t = time.perf_counter()
for i in range(0, len(items), 128):
    encode(items[i:i + 128])
print(json.dumps({"mb_s": nbytes / 1e6 / (time.perf_counter() - t), "bytes": nbytes,
                  "call": encode.__name__}))
"""


def baseline_mb_s(corpus: Path, tok_json: Path, limit: int) -> dict:
    """encode_batch_fast over the first `limit` bytes of `corpus`, already in memory, in the
    same 64K-character items the pipeline uses, in a fresh process: MB/s of UTF-8 text."""
    out = subprocess.run([sys.executable, "-c", BASELINE, str(corpus), str(tok_json), str(limit)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=int, nargs=2, default=[100, 1000], metavar=("SMALL", "LARGE"))
    ap.add_argument("--baseline-mb", type=int, default=100,
                    help="text held in memory for the encode_batch_fast baseline (MB)")
    ap.add_argument("--rounds", type=int, default=6, help="paired throughput rounds")
    ap.add_argument("--workdir", default=None, help="where corpora and runs go (a temp dir)")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="andrea-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"cores: {os.cpu_count()}, workdir {work}")
    res = {}
    for mb in a.sizes_mb:
        corpus = work / f"corpus-{mb}mb.txt"
        if not corpus.exists() or corpus.stat().st_size < mb * 10**6 * 0.99:
            t = time.perf_counter()
            build_corpus(corpus, mb * 10**6)
            print(f"built {corpus.name}: {corpus.stat().st_size:,} bytes in {time.perf_counter() - t:.1f} s")
        run = work / f"run-{mb}mb"
        if run.exists():
            import shutil
            shutil.rmtree(run)
        r = create_in_child(corpus, run)
        r["bytes"] = corpus.stat().st_size
        r["mb_s"] = r["bytes"] / 1e6 / r["seconds"]
        res[mb] = r
        print(f"{mb} MB corpus: run created in {r['seconds']:.1f} s ({r['mb_s']:.2f} MB/s end to "
              f"end, BPE training included), peak RSS {r['maxrss_kb'] / 1024:.0f} MiB")
    small = a.sizes_mb[0]
    run = work / f"run-{small}mb"
    corpus = work / f"corpus-{small}mb.txt"
    from scripts.bench_stats import interleaved
    seen = {}

    def base() -> float:
        b = baseline_mb_s(corpus, run / "tokenizer.json", a.baseline_mb * 10**6)
        seen.update(b)
        return b["mb_s"]

    def pipeline() -> float:
        # the pipeline's tokenization throughput alone: the same corpus re-tokenized into a run
        # whose tokenizer is already trained (its recipe matches, so only the arm is redone)
        for name in ("data/corpus.done.json", "run.json"):
            (run / name).unlink(missing_ok=True)
        return res[small]["bytes"] / 1e6 / create_in_child(corpus, run)["seconds"]

    pr = interleaved(pipeline, base, a.rounds, lambda p, b: p / b,
                     lambda i, p, b, x: print(f"  round {i}: pipeline {p:.2f} MB/s, "
                                              f"{seen.get('call')} {b:.2f} MB/s, ratio {x:.3f}",
                                              flush=True))
    lo, hi = res[a.sizes_mb[0]], res[a.sizes_mb[1]]
    print(f"\n{seen.get('call')} over {seen.get('bytes', 0) / 1e6:.0f} MB in memory vs the "
          f"pipeline (read + encode + write, {small} MB from disk); load average "
          f"{os.getloadavg()[0]:.2f}")
    print(pr.report("data_pipeline_vs_encode_batch_fast", 0.8, lower_is_better=False))
    print(f"peak RSS of the first creations (BPE training included): {lo['maxrss_kb'] / 1024:.0f}"
          f" MiB at {a.sizes_mb[0]} MB, {hi['maxrss_kb'] / 1024:.0f} MiB at {a.sizes_mb[1]} MB")

    def retokenize(mb: int) -> float:
        # the arm re-tokenized in a fresh process (the tokenizer kept: its recipe matches)
        r_dir = work / f"run-{mb}mb"
        for name in ("data/corpus.done.json", "run.json"):
            (r_dir / name).unlink(missing_ok=True)
        return create_in_child(work / f"corpus-{mb}mb.txt", r_dir)["maxrss_kb"] / 1024

    large = a.sizes_mb[1]
    rss = interleaved(lambda: retokenize(large), lambda: retokenize(small), a.rounds,
                      lambda x, y: x / y,
                      lambda i, x, y, q: print(f"  round {i}: peak RSS {x:.0f} MiB at {large} MB,"
                                               f" {y:.0f} MiB at {small} MB, ratio {q:.3f}",
                                               flush=True))
    print(rss.report("data_peak_rss_large_vs_small", 1.2))
    print(f"largest peak {max(rss.a):.0f} MiB (must stay < 1.5 GB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
