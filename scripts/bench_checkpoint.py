"""Benchmark the checkpoint path at the andrea-12m size (docs/operations.md#benchmarks). Prints ratios.

  .venv/bin/python scripts/bench_checkpoint.py [--dir DIR] [--repeats 5] [--n-params N]

Side by side, in one run, on the same filesystem (DIR, default: a temporary folder under the
current directory), alternating the two sides of each pair and reporting medians:

  write   the worker's write, shared.checkpoint.write.write_checkpoint_image of the file
          image (temporary, one O_DIRECT write where possible, crc32 in a helper thread,
          fsync, rename, directory fsync) vs a raw sequential buffered write + fsync of the
          same bytes                                                        target <= 1.15
          (also shown: write_checkpoint of three separate arrays, copied into an image)
  stall   how long a checkpoint holds training on the trainer's path (snapshot with the copy
          deferred into the writer thread, the forward/backward it overlaps, the wait for the
          copy), minus a plain forward/backward of the same round, vs torch.save + fsync of
          the same tensors (and vs torch.save alone, no target); rounds rotating; verdict where
          the ratio's interval and the paired test of ours - 0.10 x the save agree
                                                                            target <= 0.10
  load    load_checkpoint with the checksum, as a resume reads it, vs np.fromfile of the same
          file (target <= 1.20) and vs torch.load of nanoGPT's file of the same tensors
          (target <= 1.0); also shown: the load with no checksum (every value checked)
  cost    (--cost) lost training time per checkpoint, in probes: K+1 real andrea-12m training
          steps (worker.trainer.Trainer.train_step, batch 1 x 1024) without a checkpoint, then
          K+1 with one taken after the first and its write waited for; the difference is the
          cost, against a baseline seconds old. Ours (Trainer.checkpoint: the copy and
          checksum run in the writer thread while training goes on) vs nanoGPT's blocking save
          (torch.save of the weights and AdamW state in the training thread), probes
          alternating, --cost-rounds pairs. Ratio of the mean costs with a bootstrap interval;
          verdict where it and the paired differences ours - 0.5 x torch.save agree
                                                                            target <= 0.5
          Wall time, process CPU and training-thread CPU (CPU time hardly moves with load).

Both sides of the write pair end in fsync, so neither is flattered by the page cache; both
sides of the load pair read a file just written (page cache warm for both).
"""
from __future__ import annotations

import argparse
import json
import math
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

from scripts.bench_stats import add_result, result_line  # noqa: E402
from shared.checkpoint import file_format as cf  # noqa: E402
from shared.checkpoint import read as cread  # noqa: E402
from shared.checkpoint import write as cw  # noqa: E402

N_12M = 12_811_008


def _raw_write(path: pathlib.Path, header: bytes, arrays) -> None:
    with open(path, "wb") as f:
        f.write(header)
        for a in arrays:
            f.write(memoryview(a).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path) -> None:
    """Write a file's page-cache bytes to the disk and wait (fsync of a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    ap.add_argument("--k-steps", type=int, default=6,
                    help="--cost: steps after the checkpoint's own step in each probe (K)")
    ap.add_argument("--cost-rounds", type=int, default=16, help="--cost: pairs of probes")
    ap.add_argument("--until-landed", action="store_true",
                    help="--cost: the window with a checkpoint trains on (at least K+1 steps) "
                    "until the write has landed, then a baseline of as many steps follows; "
                    "default: K+1 steps each, baseline first, the write waited for")
    ap.add_argument("--cost-only", action="store_true", help="measure --cost alone")
    ap.add_argument("--writeback", choices=("kernel", "counted", "natural"), default="kernel",
                    help="--cost: torch.save's write to the disk, the kernel's writeback of "
                    "its page-cache bytes: left to the kernel and not waited for (kernel, "
                    "default; where it falls depends on the filesystem: ext4, whose "
                    "auto_da_alloc starts the writeback of a file truncated and written again "
                    "when it is closed, writes a re-save at once, in the window's next steps; "
                    "elsewhere it may come vm.dirty_expire_centisecs later, 30 s, after the "
                    "window), started in the background at once and counted like ours's "
                    "(counted), or left to the kernel and counted: with --until-landed "
                    "torch.save's window trains on until the kernel has written its file "
                    "(natural: however long the kernel takes; Linux >= 6.5, cachestat(2))")
    ap.add_argument("--profile", action="store_true",
                    help="CPU time of each stage of a background checkpoint, per thread")
    ap.add_argument("--diagnose", default="", help="--cost: extra sides, comma-separated: "
                    "plain (writer at normal priority, buffer kept), sync_copy (copy in the "
                    "training thread), old (the Checkpointer of --old-rev: an A/B of two "
                    "versions under the same load), blocking_durable (torch.save, its "
                    "writeback started at once and counted), copy, copy_crc, copy_write (ours's "
                    "stages alone: where its cost goes)")
    ap.add_argument("--old-rev", default="main",
                    help="--diagnose old: git revision whose worker/checkpointer.py is the "
                    "'old' side")
    a = ap.parse_args(argv)
    if a.writeback == "natural" and not a.until_landed:
        ap.error("--writeback natural trains on until the kernel has written torch.save's "
                 "file: add --until-landed")
    n = a.n_params
    rng = np.random.default_rng(0)
    buf = rng.standard_normal(3 * n, dtype=np.float32)
    w, m, v = buf[:n], buf[n:2 * n], buf[2 * n:]
    np.abs(v, out=v)   # AdamW's v is an average of squares: a loader checks it is >= 0
    header = cf.HEADER.pack(100, n)
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

        def do_ours(i=i):
            ours.append(_timed(lambda: cw.write_checkpoint_image(d, 100 + i, image)))
            os.unlink(d / cf.checkpoint_name(100 + i))
        for f in ((do_raw, do_ours) if i % 2 == 0 else (do_ours, do_raw)):
            f()
        arrays.append(_timed(lambda i=i: cw.write_checkpoint(d, 100 + i, w, m, v)))
        if i < a.repeats - 1:
            os.unlink(d / cf.checkpoint_name(100 + i))
    t_ours, t_raw, t_arr = (statistics.median(x) for x in (ours, raw, arrays))
    print(f"write   ours {t_ours:.4f} s   raw write+fsync {t_raw:.4f} s   "
          f"ratio {t_ours / t_raw:.3f}  (target <= 1.15)")
    add_result(result_line("checkpoint_write_vs_raw_write_fsync",
                           [o / r for o, r in zip(ours, raw)], 1.15))
    print(f"        write_checkpoint of three arrays (copied into an image) {t_arr:.4f} s   "
          f"ratio {t_arr / t_raw:.3f}")
    crc = statistics.median(_timed(lambda: zlib.crc32(buf)) for _ in range(3))
    print(f"        (crc32 of the same bytes alone: {crc:.4f} s; ours computes it in a "
          f"helper thread during the write and fsync; {os.cpu_count()} CPUs, load "
          f"average {os.getloadavg()[0]:.1f})")



def bench_load(d: pathlib.Path, a) -> None:
    """Print the load figures (bench_write's last file): load_checkpoint with the manifest's
    checksum, as a resume reads it, vs np.fromfile of the same file (target <= 1.2) and vs
    nanoGPT's torch.load of the same three tensors (target <= 1.0), rounds rotating; also shown:
    a load with no checksum, which checks every value instead (rule 8)."""
    n = a.n_params
    path = d / cf.checkpoint_name(100 + a.repeats - 1)
    checksum = cread.validate_checkpoint(path, n, values=True).checksum
    ours, raw, checked = [], [], []
    import torch
    pt = d / "ckpt.pt"   # nanoGPT's file of the same three arrays: what a user would load
    _, w, m, v = cread.load_checkpoint(path, n, checksum)
    torch.save({"model": torch.from_numpy(w), "exp_avg": torch.from_numpy(m),
                "exp_avg_sq": torch.from_numpy(v)}, pt)
    del w, m, v
    tload = []
    for i in range(a.repeats):   # rotating order: each side in each slot
        sides = [lambda: raw.append(_timed(lambda: np.fromfile(path, dtype=np.uint8))),
                 lambda: ours.append(_timed(lambda: cread.load_checkpoint(path, n))),
                 lambda: checked.append(_timed(lambda: cread.load_checkpoint(path, n, checksum))),
                 lambda: tload.append(_timed(lambda: torch.load(pt, map_location="cpu")))]
        for f in sides[i % 4:] + sides[:i % 4]:
            f()
    os.unlink(pt)
    t_ours, t_raw, t_chk = (statistics.median(x) for x in (ours, raw, checked))
    t_tl = statistics.median(tload)
    print(f"load    with the checksum (resume path) {t_chk:.4f} s   raw np.fromfile {t_raw:.4f} s"
          f"   ratio {t_chk / t_raw:.3f}  (target <= 1.20)")
    print(f"        torch.load of nanoGPT's ckpt.pt {t_tl:.4f} s; ratio {t_chk / t_tl:.3f} "
          f"(target <= 1.0); without a checksum, every value checked (rule 8) {t_ours:.4f} s")
    add_result(result_line("checkpoint_load_checksummed_vs_np_fromfile",
                           [c / r for c, r in zip(checked, raw)], 1.2))
    add_result(result_line("checkpoint_load_checksummed_vs_torch_load",
                           [c / t for c, t in zip(checked, tload)], 1.0))
    os.unlink(path)


def bench_stall(d: pathlib.Path, a, w, m, v) -> None:
    """Print how long a checkpoint holds training: ours (the trainer's path) vs a blocking save
    of the same three tensors, in rounds with rotating order.

    Each round times four windows: a plain andrea-12m forward/backward (1 x 128 tokens); ours,
    Checkpointer.snapshot with the copy deferred into the writer thread, the same
    forward/backward overlapping it, then the wait for the copy (what the optimizer step waits
    for); torch.save then os.fsync (a blocking save that is on disk when it returns, as ours is
    soon after) then the forward/backward; and torch.save alone then the forward/backward
    (nanoGPT's, its bytes left in the page cache). A side's stall is its window minus the plain
    one of the same round, so a forward/backward slowed by the copy running beside it counts.
    After each side its disk write is waited for, untimed, so no side's tail lands in another's
    window. Figures: ours / the durable blocking save (target <= 0.10) and ours / torch.save
    alone (no target here: what a checkpoint costs training against nanoGPT's save is the
    --cost figure, over whole windows with the write landed)."""
    import torch

    from shared.run.config import PRESETS
    from worker.checkpointer import Checkpointer
    from worker.model import GPT
    tw, tm, tv = (torch.from_numpy(x) for x in (w, m, v))
    ck = Checkpointer(d, a.n_params, keep_last=2, keep_every=0)
    model = GPT(PRESETS["andrea-12m"], 2305)
    x = torch.randint(0, 2305, (1, 128))

    def fb():
        model(x).float().mean().backward()

    pt = d / "ckpt.pt"
    step = [0]

    def plain():
        return _timed(fb)

    def ours():
        step[0] += 1
        t0 = time.perf_counter()
        ck.snapshot(step[0], tw, tm, tv, "cadence", defer_copy=True)
        fb()
        ck.wait_copied()
        t = time.perf_counter() - t0
        ck.wait()   # the write's tail, untimed
        return t

    def save(durable):
        def side():
            t0 = time.perf_counter()
            torch.save({"model": tw, "exp_avg": tm, "exp_avg_sq": tv}, pt)
            if durable:
                fsync_path(pt)
            fb()
            t = time.perf_counter() - t0
            if not durable:
                fsync_path(pt)   # its writeback, untimed
            return t
        return side

    sides = {"plain": plain, "ours": ours, "durable": save(True), "blocking": save(False)}
    for f in sides.values():   # warm-up of each side
        f()
    names = list(sides)
    rows = []
    for i in range(max(a.repeats, 1)):   # rotating order: each side in each slot
        order = names[i % 4:] + names[:i % 4]
        if i % 2:
            order.reverse()
        rows.append({k: sides[k]() for k in order})
    stall = {k: [r[k] - r["plain"] for r in rows] for k in ("ours", "durable", "blocking")}
    med = {k: statistics.median(x) for k, x in stall.items()}
    print(f"stall   ours (copy deferred behind a {statistics.median(r['plain'] for r in rows):.3f}"
          f" s forward/backward) {med['ours']:.4f} s   torch.save + fsync {med['durable']:.4f} s"
          f"   torch.save alone {med['blocking']:.4f} s  ({len(rows)} rounds, load average "
          f"{os.getloadavg()[0]:.1f})")
    vs_durable = [o / b for o, b in zip(stall["ours"], stall["durable"])]
    vs_blocking = [o / b for o, b in zip(stall["ours"], stall["blocking"])]
    # a stall is a difference of two windows whose noise can exceed it, and a ratio of two
    # such differences can go negative by noise alone: the verdict also needs the paired test
    # of ours - 0.10 x the durable save (never dividing by a noisy number) to agree
    from scripts.bench_stats import decide, median_ci
    diff = [o - 0.10 * b for o, b in zip(stall["ours"], stall["durable"])]
    dlo, dhi = (round(v, 4) for v in median_ci(diff))
    paired = decide(dlo, dhi, 0.0) if len(diff) >= 6 else None
    line = json.loads(result_line("checkpoint_stall_vs_durable_torch_save", vs_durable,
                                  0.10)[len("RESULT "):])
    if line["met"] != paired:
        line["met"] = None
    line |= {"diff_low": dlo, "diff_high": dhi}
    print(f"        median paired ratio to the durable save {statistics.median(vs_durable):.3f} "
          f"(target <= 0.10), to torch.save alone {statistics.median(vs_blocking):.3f}; ours - "
          f"0.10 x the durable save: median {statistics.median(diff):+.4f} s "
          f"[{dlo:+.4f}..{dhi:+.4f}]: {({True: 'meets', False: 'misses', None: 'cannot decide'})[line['met']]}")
    add_result("RESULT " + json.dumps(line))
    add_result(result_line("checkpoint_stall_vs_torch_save", vs_blocking, None))
    pt.unlink(missing_ok=True)


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
    for name, fn in (("crc32 of the same bytes (checkpoint.file_format)", cf.crc32),
                     ("zlib.crc32 of the same bytes", zlib.crc32)):
        c0 = time.thread_time()
        fn(buf)
        print(f"  {name:<46} CPU {time.thread_time() - c0:.3f} s")
    del buf
    # nanoGPT's blocking save of the same three tensors, in this (the training) thread: all of
    # its CPU is time training waits for; its wall time adds the page-cache writes' waits
    saves = []
    for _ in range(rounds):
        c0, t0 = time.thread_time(), time.perf_counter()
        torch.save({"model": w, "exp_avg": m, "exp_avg_sq": v}, d / "ckpt.pt")
        saves.append((time.thread_time() - c0, time.perf_counter() - t0))
        os.unlink(d / "ckpt.pt")
    saves = saves[1:] or saves
    print(f"  {'torch.save of the same tensors (blocking)':<46} CPU "
          f"{statistics.median(x[0] for x in saves):.3f} s   wall "
          f"{statistics.median(x[1] for x in saves):.3f} s")


COST_CHILD = r"""
import json, logging, os, pathlib, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from worker.signals import SignalFlags
from worker.trainer import Trainer, WorkerOptions
from worker.checkpointer import WRITER_NICE
run, pairs, K, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
extra = sys.argv[6].split(",") if len(sys.argv) > 6 and sys.argv[6] else []
old_path = sys.argv[7] if len(sys.argv) > 7 else ""
LANDED = len(sys.argv) > 8 and sys.argv[8] == "landed"
WRITEBACK = sys.argv[9] if len(sys.argv) > 9 else "kernel"
import threading
pending = []   # background threads of this probe still in flight (waited for at its end)
logging.getLogger("worker").setLevel(logging.WARNING)
tr = Trainer(WorkerOptions(run_dir=run, device="cpu", keep_last=2, keep_every=0), SignalFlags())
probs = {n: 1.0 / len(tr.sampler.names) for n in tr.sampler.names}
k = [0]
new_ck = tr.ckpt
if old_path:   # the Checkpointer of another revision, on the same run directory
    import importlib.util
    spec = importlib.util.spec_from_file_location("old_checkpointer", old_path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_checkpointer"] = mod   # dataclasses look their module up
    spec.loader.exec_module(mod)
    old_ck = mod.Checkpointer(tr.layout.root, tr.model.n_params, 2, 0,
                              on_done=tr._on_checkpoint_done)
def ours(step):
    tr.ckpt = new_ck
    tr.ckpt.writer_nice, tr.ckpt.release_after_write = WRITER_NICE, True
    tr.checkpoint(step, ["cadence"])
def old(step):
    tr.ckpt = old_ck
    tr.checkpoint(step, ["cadence"])
def plain(step):      # diagnostic: the writer at normal priority, the buffer kept resident
    tr.ckpt = new_ck
    tr.ckpt.writer_nice, tr.ckpt.release_after_write = 0, False
    tr.checkpoint(step, ["cadence"])
def sync_copy(step):  # diagnostic: the copy in the training thread, then the niced writer
    tr.ckpt = new_ck
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
import ctypes
_libc = ctypes.CDLL(None, use_errno=True)
class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]
class _CacheStat(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint64) for f in ("nr_cache", "nr_dirty", "nr_writeback",
                                                "nr_evicted", "nr_recently_evicted")]
def unwritten_pages(path):   # the file's page-cache pages not yet on the disk (cachestat(2))
    fd = os.open(path, os.O_RDONLY)
    try:
        r, c = _Range(0, 0), _CacheStat()
        if _libc.syscall(451, fd, ctypes.byref(r), ctypes.byref(c), 0) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"cachestat of {path} (--writeback natural needs Linux >= 6.5)")
        return c.nr_dirty + c.nr_writeback
    finally:
        os.close(fd)
watched = []   # files whose page-cache bytes the kernel is still to write (natural)
from scripts.bench_checkpoint import fsync_path as _writeback
def blocking(step):   # nanoGPT train.py: torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))
    path = os.path.join(out, "ckpt.pt")
    torch.save({"model": tr.model.state_dict(), "optimizer": optimizer_state_dict(),
                "iter_num": step}, path)
    # torch.save leaves its bytes in the page cache, for the kernel to write to the disk: on
    # ext4 (auto_da_alloc, the default) at once when the save truncated an existing file, as
    # every save after a run's first does; otherwise within vm.dirty_expire_centisecs (30 s).
    # "kernel" (nanoGPT as a user runs it): leave it to the kernel, not waited for. "counted":
    # start that writeback now, in the background, and train on until it has landed, as ours
    # does. "natural": leave it to the kernel, and train on (with --until-landed) until the
    # kernel has written the file (cachestat): however long its delay, all of it counts
    if WRITEBACK == "counted":
        background(_writeback, path)
    elif WRITEBACK == "natural":
        watched.append(path)
def background(fn, *args):
    t = threading.Thread(target=fn, args=args)
    t.start()
    pending.append(t)
def blocking_durable(step):   # diagnostic: torch.save, its writeback started at once, counted
    path = os.path.join(out, "ckpt_durable.pt")
    torch.save({"model": tr.model.state_dict(), "optimizer": optimizer_state_dict(),
                "iter_num": step}, path)
    background(_writeback, path)
# Where ours's cost goes (diagnostics): its stages one at a time, each in the writer's place
ck_image = memoryview(new_ck._image).cast("B")
def copy(step):        # the copy into the host buffer alone, in the training thread
    new_ck._copy(tr.model.flat, tr.opt.m, tr.opt.v)
def copy_crc(step):    # the copy, then the file's crc32 in a background thread
    copy(step)
    from shared.checkpoint.file_format import crc32
    background(crc32, ck_image)
def copy_write(step):  # the copy, then the file's write (O_DIRECT, fsync) in the background
    copy(step)
    from shared.checkpoint.write import _write_image
    def write():
        tmp = os.path.join(out, "image.tmp")
        _write_image(pathlib.Path(tmp), ck_image, True, True)
        os.unlink(tmp)
    background(write)
def busy():
    if watched and unwritten_pages(watched[0]) == 0:
        watched.clear()
    return tr.ckpt.busy() or any(t.is_alive() for t in pending) or bool(watched)
def clocks():
    t = os.times()
    return time.perf_counter(), t.user + t.system, time.thread_time()
def steps(n, save=None, until_landed=False):
    # n training steps, `save` (if any) after the first; then (until_landed) more steps while
    # the write is still in flight, as a run would go on training, and the write waited for,
    # so all of it counts. Returns (wall, process CPU, training-thread CPU, seconds the end
    # waited for the write, steps taken).
    a = clocks()
    i = 0
    while i < n or (until_landed and busy()):
        k[0] += 1
        tr.train_step(k[0], probs)
        if save is not None and i == 0:
            save(k[0])
        i += 1
    t = time.perf_counter()
    tr.ckpt.wait()
    for w in pending:
        w.join()
    pending.clear()
    watched.clear()
    b = clocks()
    return [y - x for x, y in zip(a, b)] + [b[0] - t, i]
def probe(save):
    # default: the K+1 steps before (no checkpoint) and the K+1 steps from the checkpoint on;
    # the checkpoint's cost is the difference, against a baseline taken seconds before it.
    # LANDED: the window with the checkpoint first, on until its write has landed (n >= K+1
    # steps), then a baseline of the same n steps right after it.
    # Last two: seconds the window's end waited for the write, steps in each window.
    if LANDED:
        after = steps(K + 1, save, until_landed=True)
        before = steps(after[4])
    else:
        before = steps(K + 1)
        after = steps(K + 1, save)
    return [y - x for x, y in zip(before[:3], after[:3])] + after[3:5]
table = {"ours": ours, "blocking": blocking, "plain": plain, "sync_copy": sync_copy,
         "blocking_durable": blocking_durable, "copy": copy, "copy_crc": copy_crc,
         "copy_write": copy_write}
if old_path:
    table["old"] = old
names = ["ours", "blocking"] + extra
steps(2 * K, None)
for side in names:
    steps(K + 1, table[side], until_landed=LANDED)   # warm-up
for r in range(pairs):
    order = names[r % len(names):] + names[:r % len(names)]   # rotate: each side in each slot
    if r % 2:
        order.reverse()
    got = {side: probe(table[side]) for side in order}
    print(json.dumps({"pair": r + 1, "load": os.getloadavg()[0],
                      **{s: dict(zip(("wall", "cpu", "thread_cpu", "end_wait", "steps"), v))
                         for s, v in got.items()}}),
          flush=True)
"""


def bootstrap_ratio_ci(a: list[float], b: list[float], seed: int = 0, n: int = 2000,
                       conf: float = 0.95) -> tuple[float, float, float]:
    """(ratio, low, high): sum(a) / sum(b) (the ratio of the mean costs) and its percentile
    bootstrap interval, resampling the pairs (a_i, b_i) together (Efron & Tibshirani, "An
    Introduction to the Bootstrap", 1993, ch. 13). Resamples whose sum(b) <= 0 count as an
    infinite ratio (the baseline cost is lost in the noise). Raises ValueError on no pairs."""
    import random
    if not a or len(a) != len(b):
        raise ValueError(f"bootstrap_ratio_ci needs pairs: {len(a)} and {len(b)} values")
    rng = random.Random(seed)
    idx = range(len(a))
    rs = []
    for _ in range(n):
        pick = [rng.choice(idx) for _ in idx]
        sb = sum(b[i] for i in pick)
        rs.append(sum(a[i] for i in pick) / sb if sb > 0 else float("inf"))
    rs.sort()
    lo, hi = rs[int((1 - conf) / 2 * n)], rs[int((1 + conf) / 2 * n) - 1]
    return sum(a) / sum(b) if sum(b) > 0 else float("inf"), lo, hi


WRITEBACK_MODES = {
    "kernel": "its writeback left to the kernel, after the window",
    "counted": "its writeback to the disk started at once and counted",
    "natural": "its writeback left to the kernel and counted: the window trains on until the "
               "kernel has written the file, as in a run whose saves are minutes apart"}


def lost_training_time(d: pathlib.Path, a) -> None:
    """What a checkpoint costs a real training loop, as lost time, measured so that a loaded
    machine can still decide: in one fresh process (not the one that created the run:
    create_run pins glibc's mmap threshold), each probe times K+1 training steps without a
    checkpoint and right after them K+1 steps with one taken after the first (the write waited
    for at the end, so all of it counts); the cost is the difference, against a baseline
    seconds old instead of minutes. Probes of ours (Trainer.checkpoint) and nanoGPT's blocking
    torch.save alternate, in rotating order, --cost-rounds pairs. The figure is the ratio of
    the mean costs with a bootstrap interval over pairs, plus a paired test of
    ours - 0.5 x torch.save (95 % interval of its median) that decides the target without
    dividing by a noisy number. Wall time, process CPU time and the training thread's CPU time
    are all reported: CPU time hardly moves with other processes' load; beside the ratio of the
    means, the ratio of the median costs (one burst of other load cannot wreck it)."""
    import json
    import subprocess

    from scripts.bench_stats import ROOT as REPO
    from scripts.bench_stats import decide, median_ci
    from scripts.bench_train import make_run_fresh
    run = make_run_fresh(d / "cost", 1)
    out = d / "nanogpt"
    out.mkdir()
    K, target = a.k_steps, 0.5
    window = (f"{K + 1}+ steps with a checkpoint after the first, on until its write has "
              f"landed, then as many without" if a.until_landed else
              f"K+1 = {K + 1} steps without, then {K + 1} with a checkpoint after the first")
    print(f"cost    {a.cost_rounds} pairs of probes ({window}; batch 1 x 1024): ours vs "
          f"nanoGPT torch.save ({WRITEBACK_MODES[a.writeback]})"
          f"{', ' + a.diagnose if a.diagnose else ''}, order rotating, one fresh process; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    old_path = ""
    if "old" in a.diagnose.split(","):
        old_path = str(d / "old_checkpointer.py")
        pathlib.Path(old_path).write_text(subprocess.run(
            ["git", "show", f"{a.old_rev}:worker/checkpointer.py"], cwd=REPO, check=True,
            capture_output=True, text=True).stdout)
        print(f"        old = worker/checkpointer.py at {a.old_rev}", flush=True)
    p = subprocess.Popen([sys.executable, "-c", COST_CHILD, REPO, str(run), str(a.cost_rounds),
                          str(K), str(out), a.diagnose, old_path,
                          "landed" if a.until_landed else "", a.writeback],
                         stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, PYTHONPATH=REPO),
                         start_new_session=True)   # as the proxy starts a worker: its own
    # session, hence its own scheduling group, where the niced writer competes only with it
    rows = []
    assert p.stdout is not None
    for line in p.stdout:
        r = json.loads(line)
        rows.append(r)
        sides = [x for x in r if x not in ("pair", "load")]
        print(f"  pair {r['pair']:>2} (load {r['load']:.1f}): " + ", ".join(
            f"{x} {r[x]['wall']:+.3f} s wall / {r[x]['cpu']:+.3f} s CPU / "
            f"{r[x]['thread_cpu']:+.3f} s thread / {r[x]['end_wait']:.3f} s end wait / "
            f"{r[x]['steps']} steps"
            for x in sides), flush=True)
    if p.wait() != 0:
        raise SystemExit(f"cost child exited {p.returncode}")
    loads = [r["load"] for r in rows]
    print(f"cost    {len(rows)} pairs; load average {min(loads):.1f}..{max(loads):.1f} during, "
          f"{os.getloadavg()[0]:.2f} at the end; seed 0 (bootstrap)")
    blk = {m: [r["blocking"][m] for r in rows] for m in ("wall", "cpu", "thread_cpu")}
    sides = ["ours"] + [x for x in a.diagnose.split(",") if x]
    for side in sides:
        for m in ("wall", "cpu", "thread_cpu"):
            x = [r[side][m] for r in rows]
            ratio, lo, hi = (round(v, 4) for v in bootstrap_ratio_ci(x, blk[m]))
            diff = [xi - target * bi for xi, bi in zip(x, blk[m])]
            dlo, dhi = (round(v, 4) for v in median_ci(diff))   # verdicts on printed values
            se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else 0.0
            # two tests: the paired median of ours - target x torch.save (never divides by a
            # noisy number) and the bootstrap interval of the ratio of the means (what the
            # RESULT line's low/high are); the verdict is theirs only where both agree, so
            # `met` always agrees with low, high and the target
            paired = decide(dlo, dhi, 0.0) if len(diff) >= 6 else None
            by_ratio = decide(lo, hi, target) if len(diff) >= 6 and math.isfinite(lo) and \
                math.isfinite(hi) else None
            met = paired if paired == by_ratio else None
            verdict = {True: "meets", False: "misses", None: "cannot decide"}[met]
            if paired != by_ratio:
                verdict += (f" (the paired test says {paired}, the ratio's interval "
                            f"{by_ratio}: they disagree near the target)")
            mb = statistics.median(blk[m])   # robust to one burst, unlike the ratio of means
            med = f"{statistics.median(x) / mb:.3f}" if mb > 0 else "unbounded"
            print(f"  {side:<9} {m:<10} mean cost {statistics.fmean(x):+.3f} s vs torch.save "
                  f"{statistics.fmean(blk[m]):+.3f} s: ratio {ratio:.3f} [{lo:.3f}..{hi:.3f}] "
                  f"(bootstrap 95 %), ratio of the medians {med}; {side} - {target} x "
                  f"torch.save: median "
                  f"{statistics.median(diff):+.3f} s [{dlo:+.3f}..{dhi:+.3f}], mean s.e. "
                  f"{se:.3f}: {verdict} the target {target}")
            if m == "wall":
                fig = "checkpoint_cost_vs_torch_save" if side == "ours" else \
                    f"checkpoint_cost_{side}_vs_torch_save"
                ours_side = side == "ours"
                def num(x):   # strict JSON: an unbounded end (baseline lost in noise) is null
                    return round(x, 4) if math.isfinite(x) else None
                # `met`: both tests agree (above); the paired test's interval in
                # diff_low/diff_high, seconds of ours - target x torch.save
                add_result("RESULT " + json.dumps({
                    "figure": fig, "ratio": num(ratio), "low": num(lo),
                    "high": num(hi), "target": target if ours_side else None,
                    "met": met if ours_side else None, "rounds": len(rows),
                    "decided_by": "the paired median of ours - 0.5 x torch.save and the "
                    "bootstrap interval of the ratio of the means, where they agree"
                    if ours_side else None, "diff_low": num(dlo), "diff_high": num(dhi)}))
    if "old" in sides:   # A/B of two writer versions under the same load, pair by pair
        for m in ("wall", "cpu", "thread_cpu"):
            x, y = [r["ours"][m] for r in rows], [r["old"][m] for r in rows]
            diff = [xi - yi for xi, yi in zip(x, y)]
            dlo, dhi = median_ci(diff)
            ratio, lo, hi = bootstrap_ratio_ci(x, y)
            se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else 0.0
            verdict = {True: "ours costs less", False: "ours costs more",
                       None: "cannot decide"}[decide(dlo, dhi, 0.0) if len(diff) >= 6 else None]
            print(f"  ours - old ({a.old_rev}) {m:<10} mean {statistics.fmean(diff):+.3f} s "
                  f"(s.e. {se:.3f}), median {statistics.median(diff):+.3f} s "
                  f"[{dlo:+.3f}..{dhi:+.3f}]; ratio of the mean costs {ratio:.3f} "
                  f"[{lo:.3f}..{hi:.3f}]: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
