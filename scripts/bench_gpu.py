"""GPU throughput side by side with nanoGPT (docs/operations.md#benchmarks): tokens/s, MFU,
step time and peak memory of the worker's own training loop for eager and compiled steps, each
SDPA backend and each micro-batch, nanoGPT's `model.py` and training loop (compiled, same shape,
batch and precision) in the same call, and what a checkpoint at cadence 100 costs training.

    python scripts/bench_gpu.py [--nanogpt third_party/nanoGPT] [--budget-s 420]
    python scripts/bench_gpu.py --smoke            (CPU, andrea-test, seconds: the plumbing only)

scripts/gpu_bench.sh runs it on a GPU machine. Each configuration runs in a fresh child process
(eager configurations of one preset share one child): warm-up updates (the compile included),
then `--rounds` timed windows of `--steps` updates, each window between two device
synchronisations, so a window's time is the device's. Ours is `_window`, the pipelined
loop `run` trains with (each update's values read while the next one runs, batches drawn from
the run's arms and uploaded from pinned memory), without the proxy; nanoGPT's is its
`train.py` loop (gradient accumulation, clipping, fused AdamW, `loss.item()` never inside the
window) on random tokens of the same vocabulary. MFU is model FLOPs (worker/model.py
`flops_per_token`, the same formula for nanoGPT's model of the same shape) over the table peak
(989 TFLOP/s dense bf16 for H100/H200) and over a bf16 matmul peak measured in the same call
(8192^3, mean of 10 after 3 warm-ups). A checkpoint's cost is paired windows with and without
one snapshot through the real Checkpointer (its write waited for outside the window), as a
fraction of 100 updates.

The configurations run in order of importance and are skipped, saying so, once the remaining
`--budget-s` would not cover them: the compiled default first, then nanoGPT, the checkpoint
cost, the eager sweep, the other compiled micro-batches, then andrea-12m. RESULT lines (median
over the rounds, with the rounds' 95 % interval; ours / nanoGPT pairs window i with window i):
andrea-120m MFU at its best micro-batch (target 0.45), ours / nanoGPT tokens/s at the same
micro-batch (1.1), andrea-12m MFU (0.30), checkpoint cost (0.01).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.bench_stats import add_result, result_line, run_json  # noqa: E402

TABLE_PEAK = 989e12  # H100/H200 SXM dense bf16, the issue's and the peers' denominator
BATCH = {"andrea-120m": 128, "andrea-12m": 128, "andrea-test": 8}  # sequences per update
MICROS = {"andrea-120m": (16, 32, 64), "andrea-12m": (16, 32, 64, 128), "andrea-test": (4, 8)}
BACKENDS = ("flash", "cudnn", "efficient")
# rough seconds a configuration takes on one H200, for the budget: child start, compile, windows
COST_S = {("andrea-120m", "compiled"): 60, ("andrea-120m", "eager"): 12,
          ("andrea-12m", "compiled"): 35, ("andrea-12m", "eager"): 5, "nanogpt": 60, "start": 20}


# ---------------------------------------------------------------------------------- children
def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sdpa(backend: str):
    """The context that restricts SDPA to `backend` (flash, cudnn, efficient), or none."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend])


def _peak_memory(device) -> float | None:
    import torch
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def child_matmul(a) -> dict:
    """bf16 matmul FLOP/s: 8192^3 (CPU smoke: 512^3), mean of 10 after 3 warm-ups."""
    import torch
    dev = torch.device(a.device)
    n = 8192 if dev.type == "cuda" else 512
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        x @ y
    _sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        x @ y
    _sync(dev)
    flops = 2 * n**3 * 10 / (time.perf_counter() - t)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"matmul_flops": flops, "device": name, "torch": torch.__version__}


def _window(tr, k0: int, n: int, probs: dict, ckpt_at: int | None = None) -> float:
    """Seconds of updates k0 .. k0+n-1 through the trainer's pipelined loop, between two
    synchronisations; `ckpt_at`: a cadence checkpoint at that step, as `run` takes it (the
    pending report read first)."""
    _sync(tr.device)
    t = time.perf_counter()
    prev = None
    for k in range(k0, k0 + n):
        q = tr._queue_update(k, probs)
        if prev is not None:
            tr._read_update(prev)
        prev = q
        if k == ckpt_at:
            tr._read_update(q)
            prev, tr.step = None, k
            tr.checkpoint(k, ["cadence"])
    if prev is not None:
        tr._read_update(prev)
    _sync(tr.device)
    return time.perf_counter() - t


def child_ours(a) -> dict:
    """Our loop for each of `a.configs` ("micro:backend") in one process; one Trainer each."""
    import torch

    from worker.signals import SignalFlags
    from worker.trainer import Trainer, WorkerOptions
    out = []
    for spec in a.configs.split(","):
        micro, backend = spec.split(":")
        row = {"side": "ours", "preset": a.preset, "micro": int(micro), "backend": backend,
               "compiled": a.compile == "on"}
        try:
            tr = Trainer(WorkerOptions(run_dir=Path(a.run_dir), device=a.device, compile=a.compile,
                                       micro_batch_size=int(micro)), SignalFlags())
            probs = {n: 1.0 / len(tr.sampler.names) for n in tr.sampler.names}
            if tr.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(tr.device)
            with _sdpa(backend):
                row["warmup_s"] = _window(tr, 1, a.warmup, probs)  # the compile included
                k = a.warmup + 1
                row["step_s"] = []
                for _ in range(a.rounds):
                    row["step_s"].append(_window(tr, k, a.steps, probs) / a.steps)
                    k += a.steps
                if a.checkpoint:
                    row["ckpt_extra_s"] = []
                    for r in range(a.rounds):  # paired windows, the order alternating
                        times = {}
                        for with_ckpt in ((False, True) if r % 2 == 0 else (True, False)):
                            times[with_ckpt] = _window(
                                tr, k, a.steps, probs, k + a.steps // 3 if with_ckpt else None)
                            tr.ckpt.wait()  # the write's tail outside the windows
                            k += a.steps
                        row["ckpt_extra_s"].append(times[True] - times[False])
            row.update(tokens_per_step=tr.cfg.batch_size * tr.cfg.model.block_size,
                       flops_per_token=tr.flops_per_token, peak_gib=_peak_memory(tr.device),
                       n_params=tr.model.n_params, accumulation=tr.accum)
            del tr
        except Exception as e:  # noqa: BLE001 - a backend the device lacks is a row, not a stop
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        out.append(row)
    return {"rows": out}


def child_nanogpt(a) -> dict:
    """nanoGPT's model.py and train.py loop at our preset's shape, vocabulary and batch."""
    import numpy as np
    import torch

    from shared.run.config import PRESETS, load_run_config
    from worker.model import GPT as OurGPT
    spec = importlib.util.spec_from_file_location("nanogpt_model", Path(a.nanogpt) / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    cfg = load_run_config(Path(a.run_dir) / "run.json")
    shape, V, micro = PRESETS[a.preset], cfg.vocab_size, int(a.configs.split(":")[0])
    accum = cfg.batch_size // micro
    dev = torch.device(a.device)
    row = {"side": "nanogpt", "preset": a.preset, "micro": micro, "backend": "auto",
           "compiled": a.compile == "on"}
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model = mod.GPT(mod.GPTConfig(block_size=shape.block_size, vocab_size=V, n_layer=shape.n_layer,
                                  n_head=shape.n_head, n_embd=shape.n_embd, dropout=0.0, bias=True))
    model.to(dev)
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), dev.type)
    if a.compile == "on":
        model = torch.compile(model)
    ctx = (torch.autocast(dev.type, dtype=torch.bfloat16) if dev.type == "cuda"
           else contextlib.nullcontext())
    data = np.random.default_rng(0).integers(0, V, size=4_000_000, dtype=np.uint16)
    T = shape.block_size

    def get_batch():  # nanoGPT's get_batch, on an in-memory array
        ix = torch.randint(len(data) - T, (micro,))
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        if dev.type == "cuda":
            return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
        return x.to(dev), y.to(dev)

    X, Y = get_batch()

    def step():
        nonlocal X, Y
        for _ in range(accum):
            with ctx:
                _, loss = model(X, Y)
                loss = loss / accum
            X, Y = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    for _ in range(a.warmup):
        step()
    _sync(dev)
    row["warmup_s"] = time.perf_counter() - t
    row["step_s"] = []
    for _ in range(a.rounds):
        _sync(dev)
        t = time.perf_counter()
        for _ in range(a.steps):
            step()
        _sync(dev)
        row["step_s"].append((time.perf_counter() - t) / a.steps)
    ours = OurGPT(shape, V, init_weights=False)  # the FLOP formula of the same shape
    row.update(tokens_per_step=cfg.batch_size * T, flops_per_token=ours.flops_per_token(),
               peak_gib=_peak_memory(dev), accumulation=accum,
               n_params=sum(p.numel() for p in model.parameters()))
    return {"rows": [row]}


# ---------------------------------------------------------------------------------- parent
def create_runs(work: Path, presets: list[str], smoke: bool) -> dict[str, Path]:
    """A run directory per preset (the embedded default arms; one BPE tokenizer, trained for
    the first and reused by the others, so every preset has the same vocabulary)."""
    from proxy.commands.run_args import add_run_args, config_from_args
    from proxy.supervision.run_setup import create_run
    from shared.run.layout import RunLayout
    runs: dict[str, Path] = {}
    tokenizer = "bytes" if smoke else "bpe"
    for preset in presets:
        d = work / preset
        p = argparse.ArgumentParser()
        add_run_args(p)
        args = p.parse_args(["--run-dir", str(d), "--preset", preset, "--tokenizer", tokenizer,
                             "--batch-size", str(BATCH[preset]), "--max-steps", "100000",
                             "--checkpoint-every", "100"])
        create_run(RunLayout(d), config_from_args(args))
        tokenizer = str(d / "tokenizer.json")
        runs[preset] = d
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=("matmul", "ours", "nanogpt"), help=argparse.SUPPRESS)
    ap.add_argument("--configs", default="", help=argparse.SUPPRESS)
    ap.add_argument("--compile", default="off", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="andrea-120m", help=argparse.SUPPRESS)
    ap.add_argument("--presets", default="andrea-120m,andrea-12m")
    ap.add_argument("--nanogpt", default=str(ROOT / "third_party" / "nanoGPT"),
                    help="a checkout of karpathy/nanoGPT (its model.py); missing: no nanoGPT side")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=5, help="updates per timed window")
    ap.add_argument("--rounds", type=int, default=6, help="timed windows per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed updates first (compile)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds for the whole sweep; what would not fit is skipped, saying so")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, andrea-test, 2 updates per window: checks the plumbing in seconds")
    a = ap.parse_args()
    if a.child:
        fn = {"matmul": child_matmul, "ours": child_ours, "nanogpt": child_nanogpt}[a.child]
        print(json.dumps(fn(a)))
        return 0
    if a.smoke:
        a.device, a.presets, a.steps, a.warmup, a.budget_s = "cpu", "andrea-test", 2, 1, 600.0
    t_start = time.monotonic()
    presets = a.presets.split(",")
    base = ["scripts/bench_gpu.py", "--device", a.device, "--steps", str(a.steps),
            "--rounds", str(a.rounds), "--warmup", str(a.warmup)]
    peak = run_json([*base, "--child", "matmul"])
    print(f"device {peak['device']}, torch {peak['torch']}, bf16 matmul "
          f"{peak['matmul_flops'] / 1e12:.1f} TFLOP/s measured (table {TABLE_PEAK / 1e12:.0f})",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    runs = create_runs(work, presets, a.smoke)
    print(f"run directories created in {time.monotonic() - t_start:.0f} s", flush=True)
    have_nanogpt = (Path(a.nanogpt) / "model.py").is_file()
    rows: list[dict] = []
    skipped: list[str] = []

    def left() -> float:
        return a.budget_s - (time.monotonic() - t_start)

    def job(name: str, cost: float, args: list[str]) -> None:
        if left() < cost:
            skipped.append(f"{name} (needs ~{cost:.0f} s, {max(0.0, left()):.0f} s left)")
            return
        try:
            got = run_json([*base, *args], timeout=max(60.0, left() + 60))["rows"]
        except Exception as e:  # noqa: BLE001 - one configuration failing is reported, not fatal
            got = [{"side": name, "error": str(e).splitlines()[-1][:300]}]
        for r in got:
            print(_row_text(r, peak["matmul_flops"]), flush=True)
        rows.extend(got)

    first = presets[0]
    micros = MICROS[first]
    default_micro = micros[-1]  # the peers' 64 x 1024 per GPU
    c, e = (COST_S.get((first, "compiled"), 20), COST_S.get((first, "eager"), 5))
    job(f"ours {first} compiled m{default_micro} + checkpoint", c + 20,
        ["--child", "ours", "--run-dir", str(runs[first]), "--preset", first, "--compile", "on",
         "--configs", f"{default_micro}:auto", "--checkpoint"])
    if have_nanogpt:
        job(f"nanoGPT {first} compiled m{default_micro}", COST_S["nanogpt"],
            ["--child", "nanogpt", "--nanogpt", a.nanogpt, "--run-dir", str(runs[first]),
             "--preset", first, "--compile", "on", "--configs", f"{default_micro}:auto"])
    else:
        skipped.append(f"nanoGPT (no {a.nanogpt}/model.py: fetch karpathy/nanoGPT there)")
    job(f"ours {first} eager sweep", COST_S["start"] + e * len(micros) * len(BACKENDS),
        ["--child", "ours", "--run-dir", str(runs[first]), "--preset", first, "--compile", "off",
         "--configs", ",".join(f"{m}:{b}" for m in micros for b in BACKENDS)])
    for m in micros[:-1]:
        job(f"ours {first} compiled m{m}", c, ["--child", "ours", "--run-dir", str(runs[first]),
                                               "--preset", first, "--compile", "on",
                                               "--configs", f"{m}:auto"])
    for preset in presets[1:]:
        pm = MICROS[preset]
        job(f"ours {preset} eager sweep", COST_S["start"] + COST_S[(preset, "eager")] * len(pm),
            ["--child", "ours", "--run-dir", str(runs[preset]), "--preset", preset,
             "--compile", "off", "--configs", ",".join(f"{m}:auto" for m in pm)])
        for m in pm[::-1]:
            job(f"ours {preset} compiled m{m}", COST_S[(preset, "compiled")],
                ["--child", "ours", "--run-dir", str(runs[preset]), "--preset", preset,
                 "--compile", "on", "--configs", f"{m}:auto"])
    _summary(rows, skipped, peak["matmul_flops"], presets, default_micro, targets=not a.smoke)
    print(f"total {time.monotonic() - t_start:.0f} s (budget {a.budget_s:.0f} s)")
    return 0


def _mfu(r: dict, step_s: float, peak: float) -> float:
    return r["flops_per_token"] * r["tokens_per_step"] / step_s / peak


def _row_text(r: dict, measured: float) -> str:
    name = (f"{r.get('side')} {r.get('preset', '')} micro {r.get('micro', '?')} "
            f"{r.get('backend', '')} {'compiled' if r.get('compiled') else 'eager'}")
    if r.get("error"):
        return f"{name}: FAILED {r['error']}"
    s = statistics.median(r["step_s"])
    tok = r["tokens_per_step"] / s
    mem = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "-"
    ck = ""
    if r.get("ckpt_extra_s"):
        ck = (f", checkpoint +{statistics.median(r['ckpt_extra_s']) * 1e3:.0f} ms = "
              f"{statistics.median(r['ckpt_extra_s']) / (100 * s) * 100:.2f} % at cadence 100")
    return (f"| {name} | {tok:,.0f} tok/s | MFU {_mfu(r, s, TABLE_PEAK) * 100:.1f} % (table), "
            f"{_mfu(r, s, measured) * 100:.1f} % (measured) | step {s * 1e3:.1f} ms "
            f"({min(r['step_s']) * 1e3:.1f}..{max(r['step_s']) * 1e3:.1f}) | {mem} | warm-up "
            f"{r['warmup_s']:.1f} s{ck} |")


def _summary(rows: list[dict], skipped: list[str], measured: float, presets: list[str],
             default_micro: int, targets: bool = True) -> None:
    """The table, the skipped configurations and the RESULT lines (no targets on a smoke run:
    CPU figures say nothing of a GPU's)."""
    ok = [r for r in rows if not r.get("error") and r.get("step_s")]
    print("\n| configuration | tokens/s | MFU (table / measured peak) | step (min..max) | peak memory"
          " | warm-up |\n|---|---|---|---|---|---|")
    for r in ok:
        print(_row_text(r, measured))
    for r in rows:
        if r.get("error"):
            print(f"FAILED: {_row_text(r, measured)}")
    for s in skipped:
        print(f"skipped: {s}")
    goal: dict[str, float | None] = {presets[0]: 0.45}
    if len(presets) > 1:
        goal[presets[1]] = 0.30
    for preset, target in goal.items():
        target = target if targets else None
        mine = [r for r in ok if r["side"] == "ours" and r["preset"] == preset]
        if mine:
            best = min(mine, key=lambda r: statistics.median(r["step_s"]))
            print(f"{preset}: fastest is micro {best['micro']} {best['backend']} "
                  f"{'compiled' if best['compiled'] else 'eager'}")
            add_result(result_line(f"mfu_{preset}_best", [_mfu(best, s, TABLE_PEAK)
                                                          for s in best["step_s"]],
                                   target, lower_is_better=False))
    first = presets[0]
    ours = [r for r in ok if r["side"] == "ours" and r["preset"] == first and r["compiled"]
            and r["micro"] == default_micro]
    nano = [r for r in ok if r["side"] == "nanogpt" and r["preset"] == first]
    if ours and nano:
        ratios = [n / o for o, n in zip(ours[0]["step_s"], nano[0]["step_s"])]
        add_result(result_line(f"tokens_per_s_ours_over_nanogpt_{first}_m{default_micro}",
                               ratios, 1.1 if targets else None, lower_is_better=False))
    if ours and ours[0].get("ckpt_extra_s"):
        s = statistics.median(ours[0]["step_s"])
        add_result(result_line(f"checkpoint_cost_{first}_cadence_100",
                               [x / (100 * s) for x in ours[0]["ckpt_extra_s"]],
                               0.01 if targets else None))


if __name__ == "__main__":
    sys.exit(main())
