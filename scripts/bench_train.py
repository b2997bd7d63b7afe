"""Training-step speed of andrea-12m: our worker's step vs a plain reference loop.

    .venv/bin/python scripts/bench_train.py [--batch 2] [--steps 3] [--rounds 8] [--device cpu]

Builds a real run directory (andrea-12m, BPE tokenizer with the default 2305-token vocabulary
trained on two standard-library files, so creation takes seconds), then times
  ours       `worker.trainer.Trainer.train_step`: the worker's own update (batch drawn from the
             arms, per-arm losses, grad clip, flat-buffer AdamW, the step record), and
  reference  a plain nanoGPT-style loop written below: the same architecture with ordinary
             nn.Parameters, torch.optim.AdamW with its defaults, the same clip and weight decay,
             on the same batch shape (random tokens),
interleaved in rounds (ours then reference, reference then ours, ...: scripts/bench_stats.py) so a
busy machine slows both alike; the median of the per-round paired ratios counts, with its spread.
It prints tokens/s side by side, the ratio, and the achieved FLOP/s (6N +
attention per token, nanoGPT's estimate) against the peak the worker measures at start (an fp32
1024^3 matmul on CPU) or the device table on CUDA.

With `--micro M` it instead times our update with gradient accumulation (the batch as
batch/M micro-batches of M) against our update of the same batch in one pass, interleaved the
same way (target: accumulation >= 0.95x the one-pass tokens/s):

    .venv/bin/python scripts/bench_train.py --batch 4 --micro 1

Targets on CPU: ours >= 1.0x the reference, achieved >= 0.75 of the matmul peak.
This is a measurement, not a test: it prints numbers and never fails on them.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from scripts.bench_stats import add_result, interleaved, result_line  # noqa: E402
from shared.run.config import PRESETS, ArmSpec, RunConfig  # noqa: E402
from shared.run.layout import RunLayout  # noqa: E402


# ---------------------------------------------------------------- the plain reference model
class RefAttention(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class RefBlock(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), RefAttention(d, h)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, d: int, h: int, layers: int, block: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList([RefBlock(d, h) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def make_run_fresh(tmp: Path, batch: int) -> Path:
    """`make_run` in a child process, so that the process that times training never ran
    `create_run` (which pins glibc's mmap threshold: every large tensor allocation after it
    goes to mmap, 25 % slower steps on both sides)."""
    import subprocess
    code = ("import sys; from pathlib import Path; from scripts.bench_train import make_run; "
            "print(make_run(Path(sys.argv[1]), int(sys.argv[2])))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp), str(batch)], cwd=ROOT,
                         env=dict(__import__("os").environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def make_run(tmp: Path, batch: int) -> Path:
    from proxy.supervision.run_setup import create_run
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    cfg = RunConfig(preset="andrea-12m", model=PRESETS["andrea-12m"], tokenizer="bpe",
                    batch_size=batch, probe_every=10**6, sample_every=10**6,
                    checkpoint_every=10**6, max_steps=10**6, lr_decay_steps=10**6,
                    arms=[ArmSpec("argparse", "text", str(stdlib / "argparse.py")),
                          ArmSpec("typing", "text", str(stdlib / "typing.py"))])
    layout = RunLayout(tmp / "run")
    layout.root.mkdir(parents=True)
    cfg = create_run(layout, cfg)
    return layout.root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2, help="sequences of 1024 tokens per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=8, help="paired rounds (at least 6 to decide)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro", type=int, default=None,
                    help="compare accumulation (micro-batches of M) with one pass of --batch")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from worker.perf import device_peak_flops
    from worker.signals import SignalFlags
    from worker.trainer import Trainer, WorkerOptions

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = make_run_fresh(Path(tmp), a.batch)
        tr = Trainer(WorkerOptions(run_dir=run, device=a.device), SignalFlags())
        cfg = tr.cfg
        print(f"andrea-12m: {tr.model.n_params:,} parameters, vocabulary {cfg.vocab_size}, "
              f"batch {a.batch} x {cfg.model.block_size} tokens, {torch.get_num_threads()} threads, "
              f"device {tr.device} (set-up {time.perf_counter() - t0:.1f} s)")
        probs = {n: 1.0 / len(tr.sampler.names) for n in tr.sampler.names}
        if a.micro:
            return _bench_accumulation(a, run, tr, probs)
        s = cfg.model
        dev = tr.device
        torch.manual_seed(0)
        ref = RefGPT(cfg.vocab_size, s.n_embd, s.n_head, s.n_layer, s.block_size).to(dev)
        decay = [p for p in ref.parameters() if p.dim() >= 2]
        rest = [p for p in ref.parameters() if p.dim() < 2]
        ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                     {"params": rest, "weight_decay": 0.0}], lr=cfg.lr,
                                    betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        assert sum(p.numel() for p in ref.parameters()) == tr.model.n_params
        use_amp = dev.type == "cuda"

        def ref_step():
            x = torch.randint(0, cfg.vocab_size, (a.batch, s.block_size + 1), device=dev)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_amp):
                logits = ref(x[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
            ref_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.grad_clip)
            ref_opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize()

        k = [0]

        def our_step():
            k[0] += 1
            tr.train_step(k[0], probs)

        def timed(fn) -> float:
            t = time.perf_counter()
            for _ in range(a.steps):
                fn()
            return (time.perf_counter() - t) / a.steps

        our_step(), ref_step()  # warm-up (allocator, thread pool)
        peak, peak_src = device_peak_flops(dev)
        pr = interleaved(lambda: timed(our_step), lambda: timed(ref_step), a.rounds,
                         lambda o, r: r / o,  # > 1: ours is faster
                         lambda i, o, r, x: print(f"  round {i}: ours {o:.3f} s/step, reference "
                                                  f"{r:.3f} s/step, ratio {x:.3f}", flush=True))
        tokens = a.batch * s.block_size
        fpt = tr.model.flops_per_token()
        t_ours, t_ref = statistics.median(pr.a), statistics.median(pr.b)
        print(f"\n{'':<12}{'s/step':>10}{'tokens/s':>12}{'GFLOP/s':>10}{'of peak':>9}")
        for name, t in (("ours", t_ours), ("reference", t_ref)):
            tps = tokens / t
            print(f"{name:<12}{t:>10.3f}{tps:>12,.0f}{fpt * tps / 1e9:>10.1f}"
                  + (f"{fpt * tps / peak:>9.1%}" if peak else f"{'n/a':>9}"))
        print("\n" + pr.report("train_ours_over_reference_tokens_per_s", 1.0,
                                lower_is_better=False))
        if peak:
            print(f"achieved / peak  = {fpt * tokens / t_ours / peak:.3f}      (target >= 0.75; "
                  f"peak {peak / 1e9:.1f} GFLOP/s, {peak_src}; load average "
                  f"{__import__('os').getloadavg()[0]:.2f})")
            add_result(result_line("train_mfu", [fpt * tokens / t / peak for t in pr.a], 0.75,
                                   lower_is_better=False))
        print(f"FLOPs per token  = {fpt / 1e6:.1f} M (6N + 12*L*d*T)")
    return 0


def _bench_accumulation(a, run: Path, one_pass, probs) -> int:
    """Our update of --batch sequences as --micro micro-batches vs in one pass, interleaved."""
    from worker.signals import SignalFlags
    from worker.trainer import Trainer, WorkerOptions
    acc = Trainer(WorkerOptions(run_dir=run, device=a.device, micro_batch_size=a.micro),
                  SignalFlags())
    k = {id(one_pass): 0, id(acc): 0}

    def timed(tr) -> float:
        t = time.perf_counter()
        for _ in range(a.steps):
            k[id(tr)] += 1
            tr.train_step(k[id(tr)], probs)
        return (time.perf_counter() - t) / a.steps

    timed(one_pass), timed(acc)  # warm-up
    pr = interleaved(lambda: timed(acc), lambda: timed(one_pass), a.rounds,
                     lambda t4, t1: t1 / t4,   # tokens/s of accumulation over one pass
                     lambda i, t4, t1, x: print(f"  round {i}: one pass {t1:.3f} s/update, "
                                                f"{acc.accum} micro-batches {t4:.3f} s/update, "
                                                f"ratio {x:.3f}", flush=True))
    tokens = a.batch * acc.cfg.model.block_size
    print(f"\n{'':<24}{'s/update':>10}{'tokens/s':>12}")
    for name, t in (("one pass", statistics.median(pr.b)),
                    (f"{acc.accum} x {a.micro} micro-batches", statistics.median(pr.a))):
        print(f"{name:<24}{t:>10.3f}{tokens / t:>12,.0f}")
    print(pr.report("train_accumulation_over_one_pass_tokens_per_s", 0.95, lower_is_better=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
