#!/usr/bin/env python3
"""Benchmark (BANDIT.md "How we show it works", issue 5): does the default mixture policy pay?

Same tiny model (andrea-test), same token budget, two seeds, four policies:
  static      the natural mixture (proportional to each arm's training tokens), projected into the box
  stratified  uniform within the box (Aioli's strong baseline)
  odm         the bandit with reward train_loss (ODM, Albalak et al. 2023)
  default     the bandit with reward heldout_progress (ours)
Runs in-process (no proxy): the worker's model, optimizer, sampler and the proxy's
MixtureController, with the same one-period policy lag as a real run. Prints, per policy, the
mean and the worst per-arm held-out loss at the end (on windows of the held-out split; note the
probe windows are among them), averaged over seeds, and checks that no posted p ever left its box.

    python scripts/bench_mixture.py [--steps 300] [--seeds 1 2]
"""
import argparse
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from proxy.bandit import project_to_box  # noqa: E402
from proxy.mixture import MixtureController, Phase  # noqa: E402
from proxy.run_setup import create_run  # noqa: E402
from shared.arm_data import read_arm_index  # noqa: E402
from shared.config import PRESETS, RunConfig  # noqa: E402
from shared.run_layout import RunLayout  # noqa: E402
from worker.data import ArmSampler  # noqa: E402
from worker.model import GPT  # noqa: E402
from worker.optim import FlatAdamW, learning_rate  # noqa: E402

CAPS = {"repo-code": 0.6, "repo-docstrings": 0.6, "python-docs": 0.6}
FLOORS = {"repo-code": 0.1, "repo-docstrings": 0.1, "python-docs": 0.1}


def seq_losses(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                           reduction="none").view(y.shape).mean(dim=1)


@torch.no_grad()
def heldout(model, windows):
    model.eval()
    out = {n: float(seq_losses(model, w[:, :-1], w[:, 1:]).mean()) for n, w in windows.items()}
    model.train()
    return out


def train(policy: str, seed: int, cfg: RunConfig, layout: RunLayout, steps: int) -> tuple[dict, bool]:
    torch.manual_seed(seed)
    cfg.seed = seed
    index = read_arm_index(layout)
    sampler = ArmSampler(layout.root, index, cfg.model.block_size)
    names = sampler.names
    probes = {n: sampler.heldout_windows(n, cfg.probe_sequences) for n in names}
    evals = {n: sampler.heldout_windows(n, 48) for n in names}
    model = GPT(cfg.model, cfg.vocab_size, 0.0, seed=seed)
    model.to_device(torch.device("cpu"))
    opt = FlatAdamW(model, cfg)
    mix = None
    if policy in ("odm", "default"):
        mix = MixtureController(names, Phase(0, "bench", 0, CAPS, FLOORS),
                                "train_loss" if policy == "odm" else "heldout_progress",
                                cfg.bandit_warmup, cfg.probe_every)
    elif policy == "static":
        fixed = project_to_box({n: float(index[n].heldout_start) for n in names}, FLOORS, CAPS)
    else:
        fixed = project_to_box({n: 1.0 for n in names}, FLOORS, CAPS)
    in_box = True
    for k in range(1, steps + 1):
        p = mix.policies[(k - 1) // cfg.probe_every] if mix else fixed
        in_box &= all(FLOORS[n] - 1e-12 <= p.get(n, 0) <= CAPS[n] + 1e-12 for n in names)
        b = sampler.draw(seed, k, p, cfg.batch_size)
        seq = seq_losses(model, b.x, b.y)
        loss = seq.mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step(learning_rate(k, cfg))
        if mix:
            s = seq.detach().numpy()
            rec = {"step": k, "arms": b.counts, "p": dict(p), "phase": {"index": 0, "label": "bench"},
                   "arm_loss": {n: float(s[b.arm_index == i].mean()) for i, n in enumerate(names)
                                if (b.arm_index == i).any()}}
            if k % cfg.probe_every == 0:
                rec["probe"] = heldout(model, probes)
            mix.observe(rec)
    return heldout(model, evals), in_box


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        layout = RunLayout(Path(d) / "bench")
        cfg = RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], tokenizer="bytes",
                        batch_size=16, max_steps=a.steps, lr_decay_steps=a.steps, warmup_steps=20,
                        probe_every=10, bandit_warmup=50, caps=dict(CAPS), floors=dict(FLOORS))
        t0 = time.perf_counter()
        cfg = create_run(layout, cfg)
        print(f"run created in {time.perf_counter() - t0:.1f} s; {a.steps} steps x {cfg.batch_size} "
              f"sequences x {cfg.model.block_size} tokens per policy and seed; box floors 0.1, caps 0.6")
        rows = []
        for policy in ("static", "stratified", "odm", "default"):
            per_seed, ok = [], True
            t0 = time.perf_counter()
            for seed in a.seeds:
                h, in_box = train(policy, seed, cfg, layout, a.steps)
                per_seed.append(h)
                ok &= in_box
            means = [sum(h.values()) / len(h) for h in per_seed]
            worsts = [max(h.values()) for h in per_seed]
            rows.append((policy, sum(means) / len(means), sum(worsts) / len(worsts), means, ok,
                         time.perf_counter() - t0))
    print(f"\n{'policy':<11} {'mean held-out':>13} {'worst arm':>10}   per seed (mean)        in box   time")
    for policy, m, w, ms, ok, t in rows:
        print(f"{policy:<11} {m:13.4f} {w:10.4f}   {' '.join(f'{x:.4f}' for x in ms):<22} {str(ok):<6} {t:5.1f} s")
    strat = dict((r[0], r[1]) for r in rows)
    verdict = "PASS" if strat["default"] <= strat["stratified"] else "FAIL"
    print(f"\ndefault vs stratified, mean held-out loss: {strat['default']:.4f} vs "
          f"{strat['stratified']:.4f} -> {verdict} (ratio {strat['default'] / strat['stratified']:.4f})")


if __name__ == "__main__":
    main()
