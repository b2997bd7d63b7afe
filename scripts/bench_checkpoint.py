"""Benchmark the checkpoint path at the andrea-12m size (docs/operations.md#benchmarks). Prints ratios.

  .venv/bin/python scripts/bench_checkpoint.py [--dir DIR] [--repeats 5] [--n-params N]

Side by side, in one run, on the same filesystem (DIR, default: a temporary folder under the
current directory), alternating the two sides of each pair and reporting medians:

  write   the worker's write, shared.checkpoint_write.write_checkpoint_image of the file
          image (temporary, one O_DIRECT write where possible, crc32 in a helper thread,
          fsync, rename, directory fsync) vs a raw sequential buffered write + fsync of the
          same bytes                                                        target <= 1.15
          (also shown: write_checkpoint of three separate arrays, buffered)
  stall   seconds Checkpointer.snapshot() holds training (copy into the host buffer, background
          write) vs a synchronous Checkpointer write of the same state (copy + write, in the
          training thread)                                                  target <= 0.10
          (also shown: vs write_checkpoint of the live arrays, no copy, in the training thread)
  load    load_checkpoint (validated, one readinto) vs np.fromfile of the same file
          target <= 1.20; also shown: the load with the manifest checksum verified (resume)
  cost    (--cost) lost training time: a window of --window real andrea-12m training steps
          (worker.trainer.Trainer.train_step, batch 1 x 1024) with one checkpoint taken after
          its first step, minus the same window without one; ours (Trainer.checkpoint: the
          copy and checksum run in the writer thread while training goes on) vs nanoGPT's
          blocking save (torch.save of the weights and AdamW state in the training thread).
          Paired rounds (scripts/bench_stats.py); the ratio of the median costs counts.

Both sides of the write pair end in fsync, so neither is flattered by the page cache; both
sides of the load pair read a file just written (page cache warm for both).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time
import zlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from scripts.bench_stats import result_line  # noqa: E402
from shared import checkpoint_format as cf  # noqa: E402

from shared import checkpoint_write as cw

N_12M = 12_811_008


def _raw_write(path: pathlib.Path, header: bytes, arrays) -> None:
    with open(path, "wb") as f:
        f.write(header)
        for a in arrays:
            f.write(memoryview(a).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="folder on the filesystem to measure")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--n-params", type=int, default=N_12M)
    ap.add_argument("--cost", action="store_true",
                    help="also measure a checkpoint's cost as lost training time (slow: trains)")
    ap.add_argument("--window", type=int, default=41, help="training steps per --cost window")
    ap.add_argument("--every", type=int, default=10, help="--cost: steps between checkpoints")
    ap.add_argument("--cost-rounds", type=int, default=8, help="--cost: paired rounds")
    ap.add_argument("--cost-only", action="store_true", help="measure --cost alone")
    ap.add_argument("--profile", action="store_true",
                    help="CPU time of each stage of a background checkpoint, per thread")
    ap.add_argument("--diagnose", default="", help="--cost: extra sides, comma-separated: "
                    "plain (writer at normal priority, buffer kept), sync_copy (copy in the "
                    "training thread)")
    a = ap.parse_args(argv)
    n = a.n_params
    rng = np.random.default_rng(0)
    buf = rng.standard_normal(3 * n, dtype=np.float32)
    w, m, v = buf[:n], buf[n:2 * n], buf[2 * n:]
    header = cf._HEADER.pack(100, n)
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_", dir=a.dir or os.getcwd()) as d:
        d = pathlib.Path(d)
        print(f"checkpoint benchmark: n_params {n:,}, file {cf.expected_size(n):,} bytes, "
              f"{a.repeats} repeats, in {d}")
        if a.profile:
            profile_stages(d, n)
            return 0
        if not a.cost_only:
            bench_write(d, a, header, buf, w, m, v)
            bench_load(d, a)
            bench_stall(d, a, w, m, v)
        if a.cost or a.cost_only:
            lost_training_time(d, a)
    return 0


def bench_write(d: pathlib.Path, a, header: bytes, buf, w, m, v) -> None:
    """Print the write pair: ours vs a raw write + fsync of the same bytes."""
    n = a.n_params
    # ---- write: ours vs raw write + fsync
    # Each side creates a new file, as a run does (a new step each time); the previous
    # file is deleted outside the timed region (retention's job, after the write).
    # "ours" is the worker's path: write_checkpoint_image of the Checkpointer's host
    # buffer (the file image); "arrays" is write_checkpoint of three separate arrays.
    image = cw.alloc_checkpoint_image(n)
    for dst, src in zip(cw.image_arrays(image), (w, m, v)):
        dst[:] = src
    ours, raw, arrays = [], [], []
    for i in range(a.repeats):   # alternating which side goes first
        def do_raw():
            raw.append(_timed(lambda: _raw_write(d / "raw.bin", header, (w, m, v))))
            os.unlink(d / "raw.bin")

        def do_ours():
            ours.append(_timed(lambda: cw.write_checkpoint_image(d, 100 + i, image)))
            os.unlink(d / cf.checkpoint_name(100 + i))
        for f in ((do_raw, do_ours) if i % 2 == 0 else (do_ours, do_raw)):
            f()
        arrays.append(_timed(lambda: cw.write_checkpoint(d, 100 + i, w, m, v)))
        if i < a.repeats - 1:
            os.unlink(d / cf.checkpoint_name(100 + i))
    t_ours, t_raw, t_arr = (statistics.median(x) for x in (ours, raw, arrays))
    print(f"write   ours {t_ours:.4f} s   raw write+fsync {t_raw:.4f} s   "
          f"ratio {t_ours / t_raw:.3f}  (target <= 1.15)")
    print(result_line("checkpoint_write_vs_raw_write_fsync", [o / r for o, r in zip(ours, raw)],
                      1.15))
    print(f"        write_checkpoint of three arrays (buffered) {t_arr:.4f} s   "
          f"ratio {t_arr / t_raw:.3f}")
    crc = statistics.median(_timed(lambda: zlib.crc32(buf)) for _ in range(3))
    print(f"        (crc32 of the same bytes alone: {crc:.4f} s; ours computes it in a "
          f"helper thread during the write and fsync; {os.cpu_count()} CPUs, load "
          f"average {os.getloadavg()[0]:.1f})")



def bench_load(d: pathlib.Path, a) -> None:
    """Print the load pair: load_checkpoint vs np.fromfile (of bench_write's last file)."""
    n = a.n_params
    # ---- load: ours vs np.fromfile
    path = d / cf.checkpoint_name(100 + a.repeats - 1)
    checksum = cf.file_checksum(path)
    ours, raw, checked = [], [], []
    import torch
    pt = d / "ckpt.pt"   # nanoGPT's file of the same three arrays: what a user would load
    _, w, m, v = cf.load_checkpoint(path, n)
    torch.save({"model": torch.from_numpy(w), "exp_avg": torch.from_numpy(m),
                "exp_avg_sq": torch.from_numpy(v)}, pt)
    del w, m, v
    tload = []
    for i in range(a.repeats):   # rotating order: each side in each slot
        sides = [lambda: raw.append(_timed(lambda: np.fromfile(path, dtype=np.uint8))),
                 lambda: ours.append(_timed(lambda: cf.load_checkpoint(path, n))),
                 lambda: checked.append(_timed(lambda: cf.load_checkpoint(path, n, checksum))),
                 lambda: tload.append(_timed(lambda: torch.load(pt, map_location="cpu")))]
        for f in sides[i % 4:] + sides[:i % 4]:
            f()
    os.unlink(pt)
    t_ours, t_raw, t_chk = (statistics.median(x) for x in (ours, raw, checked))
    print(f"load    ours {t_ours:.4f} s   raw np.fromfile {t_raw:.4f} s   "
          f"ratio {t_ours / t_raw:.3f}  (target <= 1.20)")
    print(f"load+checksum (resume path) {t_chk:.4f} s   ratio to raw {t_chk / t_raw:.3f}")
    t_tl = statistics.median(tload)
    print(f"        torch.load of nanoGPT's ckpt.pt {t_tl:.4f} s; load+checksum / torch.load "
          f"{t_chk / t_tl:.3f}")
    print(result_line("checkpoint_load_vs_np_fromfile", [o / r for o, r in zip(ours, raw)], 1.2))
    print(result_line("checkpoint_load_checksummed_vs_torch_load",
                      [c / t for c, t in zip(checked, tload)], 1.0))
    os.unlink(path)


def bench_stall(d: pathlib.Path, a, w, m, v) -> None:
    """Print how long a checkpoint holds training: snapshot() vs a synchronous write."""
    n = a.n_params
    # ---- stall: snapshot() held time vs a synchronous write of the same state
    import torch
    from worker.checkpointer import Checkpointer
    tw, tm, tv = (torch.from_numpy(x) for x in (w, m, v))
    ck = Checkpointer(d, n, keep_last=2, keep_every=0)
    held, sync = [], []
    step = 1
    for i in range(a.repeats):   # keep_last=2: retention deletes outside snapshot()
        sync.append(_timed(lambda: ck.snapshot(step, tw, tm, tv, "cadence",
                                               background=False)))
        step += 1
        held.append(ck.snapshot(step, tw, tm, tv, "cadence"))
        t_bg = _timed(ck.wait)   # the write goes on while "training" would
        step += 1
    # the trainer's path: the copy is deferred into the writer thread and overlaps the next
    # forward/backward (a real andrea-12m pass, 1 x 128 tokens); the optimizer step then
    # waits for it. Stall = snapshot() held + that wait.
    from shared.config import PRESETS
    from worker.model import GPT
    model = GPT(PRESETS["andrea-12m"], 2305)
    x = torch.randint(0, 2305, (1, 128))
    fb = lambda: model(x).float().mean().backward()
    fb()
    t_fb = statistics.median(_timed(fb) for _ in range(3))
    deferred = []
    for i in range(a.repeats):
        h = ck.snapshot(step, tw, tm, tv, "cadence", defer_copy=True)
        fb()
        t1 = time.perf_counter()
        ck.wait_copied()
        deferred.append(h + time.perf_counter() - t1)
        ck.wait()
        step += 1
    live = []   # the classic synchronous checkpoint: write the live arrays, then train on
    for i in range(a.repeats):
        live.append(_timed(lambda: cw.write_checkpoint(d, 10_000 + i, w, m, v)))
        os.unlink(d / cf.checkpoint_name(10_000 + i))
    t_held, t_sync, t_live = (statistics.median(x) for x in (held, sync, live))
    print(f"stall   snapshot held {t_held:.4f} s   synchronous write {t_sync:.4f} s   "
          f"ratio {t_held / t_sync:.3f}  (target <= 0.10)")
    print(f"        vs a synchronous write_checkpoint of the live arrays {t_live:.4f} s   "
          f"ratio {t_held / t_live:.3f}")
    print(f"        (last background write finished {t_bg:.3f} s after snapshot returned)")
    t_def = statistics.median(deferred)
    print(f"stall, trainer path (copy deferred behind a {t_fb:.3f} s forward/backward): "
          f"{t_def:.4f} s   ratio to synchronous write {t_def / t_sync:.3f}  (target <= 0.10)")
    print(result_line("checkpoint_stall_vs_synchronous_write",
                      [h / y for h, y in zip(deferred, sync)], 0.10))


def profile_stages(d: pathlib.Path, n: int, rounds: int = 5) -> None:
    """Where a background checkpoint's CPU goes: thread CPU time (time.thread_time, not wall
    time, so other processes' load does not change it) of each stage in the thread that runs
    it, wrapped around the real functions; the crc32 thread's share as the crc32 of the same
    bytes alone; the process's total CPU per checkpoint. The first (cold) round is dropped."""
    import collections
    import torch
    from worker import checkpointer as ck
    rows: list[tuple[str, float, float]] = []

    def timed(name, fn):
        def f(*args, **kw):
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                rows.append((name, time.thread_time() - c0, time.perf_counter() - t0))
        return f
    C = ck.Checkpointer
    saved = {k: getattr(C, k) for k in ("_copy", "_release_host_buffer", "apply_retention")}
    saved_mod = {k: getattr(ck, k) for k in ("write_checkpoint_image", "record_checkpoint")}
    C._copy = timed("copy into the host buffer", C._copy)
    C._release_host_buffer = timed("host buffer marked free", C._release_host_buffer)
    C.apply_retention = timed("retention", C.apply_retention)
    ck.write_checkpoint_image = timed("write + fsync + rename (waits for the crc32)",
                                      ck.write_checkpoint_image)
    ck.record_checkpoint = timed("manifest", ck.record_checkpoint)
    try:
        g = torch.Generator().manual_seed(0)
        w, m, v = (torch.randn(n, generator=g) for _ in range(3))
        c = C(d, n, keep_last=2, keep_every=0)
        for step in range(1, rounds + 1):
            p0 = os.times()
            c.snapshot(step, w, m, v, "cadence", defer_copy=True)
            c.wait()
            p1 = os.times()
            rows.append(("process CPU per checkpoint", (p1.user + p1.system)
                         - (p0.user + p0.system), 0.0))
    finally:
        for k, f in saved.items():
            setattr(C, k, f)
        for k, f in saved_mod.items():
            setattr(ck, k, f)
    agg: dict[str, list] = collections.defaultdict(list)
    for name, cpu, wall in rows:
        agg[name].append((cpu, wall))
    print(f"profile of {rounds - 1} background checkpoints (median; load average "
          f"{os.getloadavg()[0]:.1f}):")
    for name, xs in agg.items():
        xs = xs[1:] or xs
        print(f"  {name:<46} CPU {statistics.median(x[0] for x in xs):.3f} s   wall "
              f"{statistics.median(x[1] for x in xs):.3f} s")
    buf = bytearray(cf.expected_size(n))
    c0 = time.thread_time()
    zlib.crc32(buf)
    print(f"  {'crc32 of the same bytes (its own thread)':<46} CPU {time.thread_time() - c0:.3f} s")


COST_CHILD = r"""
import json, logging, os, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from worker.signals import SignalFlags
from worker.trainer import Trainer, WorkerOptions
from worker.checkpointer import WRITER_NICE
run, rounds, steps, every, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
extra = sys.argv[7].split(",") if len(sys.argv) > 7 and sys.argv[7] else []
logging.getLogger("worker").setLevel(logging.WARNING)
tr = Trainer(WorkerOptions(run_dir=run, device="cpu", keep_last=2, keep_every=0), SignalFlags())
probs = {n: 1.0 / len(tr.sampler.names) for n in tr.sampler.names}
k = [0]
def ours(step):
    tr.ckpt.writer_nice, tr.ckpt.release_after_write = WRITER_NICE, True
    tr.checkpoint(step, ["cadence"])
def plain(step):      # diagnostic: the writer at normal priority, the buffer kept resident
    tr.ckpt.writer_nice, tr.ckpt.release_after_write = 0, False
    tr.checkpoint(step, ["cadence"])
def sync_copy(step):  # diagnostic: the copy in the training thread, then the niced writer
    tr.ckpt.writer_nice, tr.ckpt.release_after_write = WRITER_NICE, True
    tr.ckpt.snapshot(step, tr.model.flat, tr.opt.m, tr.opt.v, "cadence")
    tr.last_written = step
params = list(tr.model.parameters())
index = {id(p): i for i, p in enumerate(params)}
def optimizer_state_dict():   # what torch.optim.AdamW.state_dict() holds: the same tensors
    st = tr.opt.opt.state
    return {"state": {i: dict(st[p]) for i, p in enumerate(params)},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} | {"params": [
                index[id(p)] for p in g["params"]]} for g in tr.opt.opt.param_groups]}
def blocking(step):   # nanoGPT train.py: torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    torch.save({"model": tr.model.state_dict(), "optimizer": optimizer_state_dict(),
                "iter_num": step}, os.path.join(out, "ckpt.pt"))
def window(save):
    c0, t0 = os.times(), time.perf_counter()
    for i in range(steps):
        k[0] += 1
        tr.train_step(k[0], probs)
        if save is not None and (i + 1) % every == 0 and i + 1 < steps:
            save(k[0])
    tr.ckpt.wait()   # a write still going at the end counts against the window
    c1 = os.times()
    return time.perf_counter() - t0, (c1.user + c1.system) - (c0.user + c0.system)
window(None)          # warm-up: allocator, thread pool, first checkpoint buffer touched
window(ours)
window(blocking)
table = {"never": None, "ours": ours, "blocking": blocking, "plain": plain, "sync_copy": sync_copy}
names = ["never", "ours", "blocking"] + extra
for r in range(rounds):
    got = {}
    order = names[r % len(names):] + names[:r % len(names)]   # rotate: each side in each slot
    if r % 2:
        order.reverse()
    for side in order:
        got[side] = window(table[side])
    print(json.dumps({"round": r + 1, **{s: {"wall": w, "cpu": c} for s, (w, c) in got.items()}}),
          flush=True)
"""


def lost_training_time(d: pathlib.Path, a) -> None:
    """What checkpoints cost a real training loop, as lost time over long windows: a window of
    --window steps with a checkpoint every --every steps minus the same window without any,
    ours (Trainer.checkpoint) vs nanoGPT's blocking torch.save, in one fresh process (not the
    one that created the run: create_run pins glibc's mmap threshold), sides interleaved in
    rotating order, --cost-rounds rounds."""
    import json
    import subprocess
    from scripts.bench_stats import PairedRatio, ROOT as REPO
    from scripts.bench_train import make_run_fresh
    run = make_run_fresh(d / "cost", 1)
    out = d / "nanogpt"
    out.mkdir()
    n_ckpt = (a.window - 1) // a.every
    print(f"cost    {a.cost_rounds} rounds of three {a.window}-step windows (batch 1 x 1024): "
          f"never, ours, nanoGPT torch.save, {n_ckpt} checkpoints each, in rotating order, one "
          f"fresh process; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
          flush=True)
    p = subprocess.Popen([sys.executable, "-c", COST_CHILD, REPO, str(run), str(a.cost_rounds),
                          str(a.window), str(a.every), str(out), a.diagnose],
                         stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=REPO))
    rows = []
    for line in p.stdout:
        r = json.loads(line)
        rows.append(r)
        lo = (r["ours"]["wall"] - r["never"]["wall"]) / n_ckpt
        lb = (r["blocking"]["wall"] - r["never"]["wall"]) / n_ckpt
        co = (r["ours"]["cpu"] - r["never"]["cpu"]) / n_ckpt
        cb = (r["blocking"]["cpu"] - r["never"]["cpu"]) / n_ckpt
        more = "".join(
            f", {x} {(r[x]['wall'] - r['never']['wall']) / n_ckpt:+.3f} s "
            f"(+{(r[x]['cpu'] - r['never']['cpu']) / n_ckpt:.3f} s CPU)"
            for x in r if x not in ("round", "never", "ours", "blocking"))
        print(f"  round {r['round']}: window {r['never']['wall']:.2f} s without; lost per "
              f"checkpoint: ours {lo:+.3f} s (+{co:.3f} s CPU), torch.save {lb:+.3f} s "
              f"(+{cb:.3f} s CPU), ratio {lo / lb:.3f}{more}", flush=True)
    if p.wait() != 0:
        raise SystemExit(f"cost child exited {p.returncode}")
    ours_lost = [(r["ours"]["wall"] - r["never"]["wall"]) / n_ckpt for r in rows]
    blk_lost = [(r["blocking"]["wall"] - r["never"]["wall"]) / n_ckpt for r in rows]
    pr = PairedRatio([o / b for o, b in zip(ours_lost, blk_lost)], ours_lost, blk_lost)
    print(f"cost    lost training time per checkpoint: ours {statistics.median(ours_lost):+.3f} s, "
          f"nanoGPT torch.save {statistics.median(blk_lost):+.3f} s (medians; load average "
          f"{os.getloadavg()[0]:.2f} at the end)")
    print(pr.report("checkpoint_cost_vs_torch_save", 0.5))
    for x in a.diagnose.split(",") if a.diagnose else []:
        lost = [(r[x]["wall"] - r["never"]["wall"]) / n_ckpt for r in rows]
        print(PairedRatio([v / b for v, b in zip(lost, blk_lost)], lost, blk_lost)
              .report(f"checkpoint_cost_{x}_vs_torch_save", None))


if __name__ == "__main__":
    sys.exit(main())
