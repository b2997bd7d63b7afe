"""Restart cost: `python -m proxy run` on an existing andrea-12m run, to its first resumed step,
against nanoGPT's resume of the same state. Prints times and the ratio.

    .venv/bin/python scripts/bench_resume.py [--rounds 12] [--dir DIR]

Builds one andrea-12m run (BPE on two standard-library files, batch 1 x 1024, cadence 1) and
trains its first step, then saves the same weights and AdamW state as nanoGPT's `ckpt.pt`
(torch.save of the model's and the optimizer's state_dicts). Then, in interleaved rounds whose
order alternates (ours first, then nanoGPT first, ...: scripts/bench_stats.py):
  ours       a new process `python -m proxy run --run-dir R --max-steps S+1`: lock, resume scan
             (size, header, checksum), bandit rebuild, worker start, checkpoint load, the first
             resumed update; timed from the launch to the moment `.loss.json` holds step S+1;
  nanoGPT    a new process doing what nanoGPT's train.py does with init_from='resume': import
             torch, torch.load the checkpoint, build the model (plain nn.Module, the same shape),
             load_state_dict, build torch.optim.AdamW (not fused: nanoGPT's configure_optimizers
             asks for fused only on CUDA), load its state_dict, and run one update of the same batch shape; timed
             from the launch to the end of that update.
Each round's ratio is ours / nanoGPT; the median of the paired ratios with its 95 % interval
decides (target <= 1.0: no slower), or says it cannot. Beside wall time, each side's CPU time
(ours: the proxy and its worker, sampled from /proc every 10 ms; nanoGPT: its process) is
paired the same way: other processes' load stretches wall time, hardly CPU time, and start-up is
mostly single-threaded imports, so the CPU ratio is what a quiet machine's wall ratio tends to.
Run with ANDREA_LOG_LEVEL=DEBUG to see each stage of ours (docs/operations.md#start-and-resume).
A measurement, never a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REFERENCE = r'''
import json, os, sys, time
t0 = float(sys.argv[3])
sys.path.insert(0, sys.argv[1] + "/scripts"); sys.path.insert(0, sys.argv[1])
import torch
from torch.nn import functional as F
from bench_train import RefGPT
path, V, d, h, L, T = sys.argv[2], *map(int, sys.argv[4:9])
ckpt = torch.load(path, map_location="cpu")
model = RefGPT(V, d, h, L, T)
model.load_state_dict(ckpt["model"])
decay = [p for p in model.parameters() if p.dim() >= 2]
rest = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                         {"params": rest, "weight_decay": 0.0}], lr=1e-3, fused=False)
opt.load_state_dict(ckpt["optimizer"])
ckpt = None
x = torch.randint(0, V, (1, T + 1))
loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
opt.zero_grad(set_to_none=True); loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step()
t = os.times()   # CPU of this process to here (the nanoGPT side has no children)
print(json.dumps({"wall": time.time() - t0, "cpu": t.user + t.system}))
'''

SAVE = r'''
import sys
sys.path.insert(0, sys.argv[1] + "/scripts"); sys.path.insert(0, sys.argv[1])
import numpy as np, torch
from bench_train import RefGPT
path, out, V, d, h, L, T = sys.argv[2], sys.argv[3], *map(int, sys.argv[4:9])
model = RefGPT(V, d, h, L, T)
raw = np.fromfile(path, dtype=np.float32, offset=8)
n = sum(p.numel() for p in model.parameters())
w, m, v = raw[:n], raw[n:2 * n], raw[2 * n:3 * n]
decay = [p for p in model.parameters() if p.dim() >= 2]
rest = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                         {"params": rest, "weight_decay": 0.0}], lr=1e-3, fused=False)
off = 0
with torch.no_grad():
    for p in model.parameters():
        k = p.numel()
        p.copy_(torch.from_numpy(w[off:off + k]).view_as(p))
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.from_numpy(m[off:off + k].copy()).view_as(p),
                        "exp_avg_sq": torch.from_numpy(v[off:off + k].copy()).view_as(p)}
        off += k
torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 1}, out)
'''


def _step_record(run: Path, step: int) -> dict | None:
    """The history's record of `step` (None while it is not there yet)."""
    try:
        recs = json.loads((run / ".loss.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return next((r for r in reversed(recs) if r.get("step") == step and "loss" in r), None)


def _tree_cpu(pid: int, seen: dict[int, float]) -> float:
    """CPU seconds (user + system) of `pid` and its live descendants, remembering in `seen`
    the last value read of each process (one that has exited keeps its last reading)."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return sum(seen.values())
    for q in procs:
        try:
            c = q.cpu_times()
            seen[q.pid] = c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return sum(seen.values())


def ours(run: Path, step: int, env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the proxy and its worker) from launch to step + 1 in
    the history. The wall time ends at the record's own "time" (the worker's clock when the
    update was done), as the nanoGPT side reads its clock in-process: the poll's latency is
    not counted. The poll is cheap (a stat every 20 ms; the history is parsed only when it
    grew), so this process takes little CPU from the two it times. The CPU is sampled at each
    poll, so a process that exits early (none should) keeps its last reading."""
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-m", "proxy", "run", "--run-dir", str(run),
                          "--max-steps", str(step + 1), "--print-every", "1000"], cwd=ROOT,
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[int, float] = {}
    history, size, rec = run / ".loss.json", -1, None
    while rec is None:
        if p.poll() is not None and _step_record(run, step + 1) is None:
            raise SystemExit(f"proxy exited with {p.returncode} before step {step + 1}")
        _tree_cpu(p.pid, seen)
        try:
            now = history.stat().st_size
        except FileNotFoundError:
            now = -1
        if now != size:
            size, rec = now, _step_record(run, step + 1)
        if rec is None:
            time.sleep(0.02)
    cpu = _tree_cpu(p.pid, seen)
    p.wait(600)
    return rec["time"] - t0, cpu


def _dims(cfg) -> list[str]:
    return [str(cfg.vocab_size), str(cfg.model.n_embd), str(cfg.model.n_head),
            str(cfg.model.n_layer), str(cfg.model.block_size)]


def reference(ckpt: Path, cfg, env: dict) -> tuple[float, float]:
    """(wall seconds from launch to the end of the first update, CPU seconds of it)."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", REFERENCE, str(ROOT), str(ckpt), repr(t0),
                          *_dims(cfg)], env=env, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["wall"], r["cpu"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    from scripts.bench_stats import PairedRatio, interleaved
    from shared.checkpoint.file_format import checkpoint_name
    from shared.run.config import load_run_config
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        run = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "proxy", "run", "--run-dir", str(run), "--preset",
                        "andrea-12m", "--batch-size", "1", "--checkpoint-every", "1",
                        "--max-steps", "1", "--print-every", "1000",
                        "--arm", f"argparse=text:{stdlib / 'argparse.py'}",
                        "--arm", f"typing=text:{stdlib / 'typing.py'}"], cwd=ROOT, env=env,
                       check=True, capture_output=True)
        cfg = load_run_config(run / "run.json")
        pt = Path(tmp) / "ckpt.pt"
        subprocess.run([sys.executable, "-c", SAVE, str(ROOT), str(run / checkpoint_name(1)),
                        str(pt), *_dims(cfg)], env=env, check=True)
        print(f"andrea-12m: {cfg.n_params:,} parameters, checkpoint {cfg.checkpoint_bytes:,} "
              f"bytes, ckpt.pt {pt.stat().st_size:,} bytes, batch 1 x {cfg.model.block_size}; "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
        step = [1]

        def run_ours():
            got = ours(run, step[0], env)
            step[0] += 1
            return got

        def show(i, o, f, x):
            print(f"  round {i}: ours {o[0]:.2f} s ({o[1]:.2f} s CPU), nanoGPT {f[0]:.2f} s "
                  f"({f[1]:.2f} s CPU), ratio {x:.3f} wall, {o[1] / f[1]:.3f} CPU; load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)

        pr = interleaved(run_ours, lambda: reference(pt, cfg, env), a.rounds,
                         lambda o, f: o[0] / f[0], show)
        print(f"\nmedian: ours {statistics.median(o[0] for o in pr.a):.2f} s, nanoGPT "
              f"{statistics.median(f[0] for f in pr.b):.2f} s to the first resumed step (load "
              f"average {os.getloadavg()[0]:.2f} at the end)")
        print(pr.report("resume_vs_nanogpt", 1.0))
        cpu = PairedRatio([o[1] / f[1] for o, f in zip(pr.a, pr.b)], [o[1] for o in pr.a],
                          [f[1] for f in pr.b])
        print(f"CPU seconds to the first resumed step (proxy + worker vs nanoGPT's process): "
              f"median ours {statistics.median(cpu.a):.2f} s, nanoGPT "
              f"{statistics.median(cpu.b):.2f} s. CPU time hardly moves with other processes' "
              f"load, and start-up is mostly single-threaded imports, so this ratio is what the "
              f"wall ratio tends to on a quiet machine")
        print(cpu.report("resume_cpu_vs_nanogpt", 1.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
