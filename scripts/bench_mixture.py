#!/usr/bin/env python3
"""Benchmark (docs/bandit.md#how-we-show-it-works): does the default mixture policy pay?

Same tiny model (andrea-test), same token budget, same seeds, four policies:
  static      the natural mixture (proportional to each arm's training tokens), projected into the box
  stratified  uniform within the box (Aioli's strong baseline; the reference of every ratio)
  odm         the bandit with reward train_loss (ODM, Albalak et al. 2023)
  default     the bandit with reward heldout_progress (ours)
Runs in-process (no proxy): the worker's model, optimizer, sampler and the proxy's
MixtureController, with the same one-period policy lag as a real run. For a given seed every
policy starts from the same initialisation and trains for the same steps x sequences x tokens;
probes are forward passes only and cost no training tokens.

What is scored: at the end, each arm's mean loss (nats/token) on a FIXED evaluation set from the
arm's held-out split (never trained on) that is DISJOINT from the bandit's probe windows
(`ArmSampler.heldout_windows(name, probe_sequences)`, for every probe_sequences in use), so the
heldout_progress reward never sees the windows it is judged on. The evaluation windows are the
non-overlapping block+1 tiles of the held-out split minus every tile that overlaps a probe window:
all of them by default (about 650 to 3,000 per arm), or `--eval-windows N` evenly spaced among
them. Per seed: the mean over arms and the worst arm. The table averages over seeds, gives ratios
to stratified, and the paired (same-seed) difference to stratified with its standard error over
seeds. It also checks that no posted p ever left its box.

The bandit knobs a run's configuration sets (bandit_warmup, probe_every, probe_sequences) are
options; `--variant` adds rows of the default policy under other values of them, e.g.
`--variant fast:warmup=0,probe_every=1,probe_sequences=32`.

    python scripts/bench_mixture.py [--steps 300] [--seeds 1 2 3 4 5] [--eval-windows 0]
        [--bandit-warmup 50] [--probe-every 10] [--probe-sequences 8] [--policies ...]
        [--variant NAME:warmup=W,probe_every=P,probe_sequences=S ...]
"""
import argparse
import copy
import logging
import math
import statistics
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
POLICIES = ("static", "stratified", "odm", "default")
VARIANT_KEYS = {"warmup": "bandit_warmup", "probe_every": "probe_every",
                "probe_sequences": "probe_sequences"}


def seq_losses(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                           reduction="none").view(y.shape).mean(dim=1)


@torch.no_grad()
def heldout(model, windows, chunk: int = 256):
    """Mean loss per arm over `windows` {arm: int64 (n, block+1)}, evaluated in chunks."""
    model.eval()
    out = {}
    for n, w in windows.items():
        parts = [seq_losses(model, c[:, :-1], c[:, 1:]) for c in torch.split(w, chunk)]
        out[n] = float(torch.cat(parts).mean())
    model.train()
    return out


def probe_starts(sampler: ArmSampler, name: str, n: int) -> list[int]:
    """Token offsets of the windows `ArmSampler.heldout_windows(name, n)` returns (same
    arithmetic; `eval_windows` checks it against the real windows)."""
    start, end = sampler.train_end[name], len(sampler.tokens[name])
    span = (end - start - sampler.block - 1) // max(1, n)
    return [start + i * span for i in range(n)]


def eval_windows(sampler: ArmSampler, name: str, n: int, probe_counts) -> tuple[torch.Tensor, int]:
    """The fixed evaluation set of arm `name`: int64 (n, block+1) windows of its held-out split,
    pairwise non-overlapping and disjoint from the probe windows of every count in `probe_counts`;
    n = 0 takes every such tile. Returns (windows, number of candidate tiles); raises ValueError
    when the held-out split has fewer than n such tiles."""
    toks, w = sampler.tokens[name], sampler.block + 1
    start, end = sampler.train_end[name], len(toks)
    probes = []
    for k in sorted(set(probe_counts)):
        starts = probe_starts(sampler, name, k)
        mine = torch.from_numpy(np.stack([np.asarray(toks[s:s + w], dtype=np.int64) for s in starts]))
        assert torch.equal(sampler.heldout_windows(name, k), mine), \
            f"{name}: probe window arithmetic out of step with ArmSampler.heldout_windows"
        probes += starts
    tiles = [s for s in range(start, end - w + 1, w)
             if all(s + w <= p or s >= p + w for p in probes)]
    n = n or len(tiles)
    if len(tiles) < n:
        raise ValueError(f"arm {name!r}: only {len(tiles)} held-out tiles of {w} tokens clear of the "
                         f"probes; ask for --eval-windows <= {len(tiles)}")
    pick = [tiles[i] for i in np.linspace(0, len(tiles) - 1, n).round().astype(int)]
    assert len(set(pick)) == n
    for s in pick:  # inside the held-out split and disjoint from every probe window
        assert start <= s and s + w <= end and all(s + w <= p or s >= p + w for p in probes)
    return torch.from_numpy(np.stack([np.asarray(toks[s:s + w], dtype=np.int64) for s in pick])), len(tiles)


def train(policy: str, seed: int, cfg: RunConfig, layout: RunLayout, steps: int,
          evals: dict[str, torch.Tensor]) -> tuple[dict, bool, dict, dict]:
    """Train one policy for one seed; returns (eval loss per arm, in box, time-mean p, final p)."""
    torch.manual_seed(seed)
    cfg.seed = seed
    index = read_arm_index(layout)
    sampler = ArmSampler(layout.root, index, cfg.model.block_size)
    names = sampler.names
    probes = {n: sampler.heldout_windows(n, cfg.probe_sequences) for n in names}
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
    p_sum = {n: 0.0 for n in names}
    for k in range(1, steps + 1):
        p = mix.policies[(k - 1) // cfg.probe_every] if mix else fixed
        in_box &= all(FLOORS[n] - 1e-12 <= p.get(n, 0) <= CAPS[n] + 1e-12 for n in names)
        for n in names:
            p_sum[n] += p.get(n, 0.0)
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
    return heldout(model, evals), in_box, {n: v / steps for n, v in p_sum.items()}, dict(p)


def parse_variant(text: str) -> tuple[str, dict]:
    """'NAME:warmup=W,probe_every=P,probe_sequences=S' (any subset) -> (NAME, {config field: int})."""
    name, _, spec = text.partition(":")
    if not name or not spec:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME:warmup=W,probe_every=P,...")
    fields = {}
    for item in spec.split(","):
        key, _, val = item.partition("=")
        if key not in VARIANT_KEYS or not val.isdigit():
            raise argparse.ArgumentTypeError(
                f"--variant {text!r}: {item!r} is not KEY=INT with KEY one of {', '.join(VARIANT_KEYS)}")
        fields[VARIANT_KEYS[key]] = int(val)
    return name, fields


def _mean(xs):
    return sum(xs) / len(xs)


def _paired(xs, ys) -> tuple[float, float, list[float]]:
    """Mean and standard error (over seeds) of the paired differences xs - ys."""
    d = [x - y for x, y in zip(xs, ys)]
    return _mean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")), d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--eval-windows", type=int, default=0,
                    help="held-out evaluation windows per arm, disjoint from the probes; 0 (default) = "
                         "every non-overlapping window of the held-out split clear of the probes")
    ap.add_argument("--bandit-warmup", type=int, default=50,
                    help="run config bandit_warmup: steps on the prior before the first update (default 50)")
    ap.add_argument("--probe-every", type=int, default=10,
                    help="run config probe_every: probe cadence = policy period and lag, steps (default 10)")
    ap.add_argument("--probe-sequences", type=int, default=8,
                    help="run config probe_sequences: probe windows per arm (default 8)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                    help="policies to run (stratified always runs: it is the reference)")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="extra row: the default policy with other bandit knobs, "
                         "NAME:warmup=W,probe_every=P,probe_sequences=S (any subset; repeatable)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        layout = RunLayout(Path(d) / "bench")
        cfg = RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], tokenizer="bytes",
                        batch_size=16, max_steps=a.steps, lr_decay_steps=a.steps, warmup_steps=20,
                        probe_every=a.probe_every, bandit_warmup=a.bandit_warmup,
                        probe_sequences=a.probe_sequences, caps=dict(CAPS), floors=dict(FLOORS))
        t0 = time.perf_counter()
        cfg = create_run(layout, cfg)
        rows = [(p, p, cfg) for p in POLICIES if p in a.policies or p == "stratified"]
        for name, fields in a.variant:
            vcfg = copy.deepcopy(cfg)
            for k, v in fields.items():
                setattr(vcfg, k, v)
            vcfg.validate()
            rows.append((f"default[{name}]", "default", vcfg))
        sampler = ArmSampler(layout.root, read_arm_index(layout), cfg.model.block_size)
        names = sampler.names
        probe_counts = sorted({c.probe_sequences for _, pol, c in rows if pol in ("odm", "default")}
                              | {cfg.probe_sequences})
        evals, tiles = {}, {}
        for n in names:
            evals[n], tiles[n] = eval_windows(sampler, n, a.eval_windows, probe_counts)
        print(f"run created in {time.perf_counter() - t0:.1f} s; {a.steps} steps x {cfg.batch_size} "
              f"sequences x {cfg.model.block_size} tokens = {a.steps * cfg.batch_size * cfg.model.block_size:,} "
              f"training tokens per policy and seed; seeds {' '.join(map(str, a.seeds))}; "
              f"box floors 0.1, caps 0.6 on every arm")
        for label, pol, c in rows:
            if pol in ("odm", "default"):
                upd = (a.steps - c.bandit_warmup) // c.probe_every if pol == "default" \
                    else a.steps - c.bandit_warmup
                print(f"  {label}: bandit_warmup {c.bandit_warmup}, probe_every {c.probe_every} (= policy "
                      f"period and lag), probe_sequences {c.probe_sequences}; about {max(0, upd)} "
                      f"bandit updates")
        print(f"scored on: fixed, non-overlapping {cfg.model.block_size + 1}-token windows of each arm's "
              f"held-out split (never trained on) and DISJOINT from the bandit's probe windows "
              f"(probe_sequences {', '.join(map(str, probe_counts))}): "
              f"{', '.join(f'{n} {len(evals[n])}' for n in names)} windows "
              f"(of {', '.join(str(tiles[n]) for n in names)} clear of the probes).\n"
              f"score per seed = mean over arms of the arm's mean loss (nats/token), and the worst arm; "
              f"averaged over seeds")
        res = {}
        for label, policy, c in rows:
            t0 = time.perf_counter()
            runs = [train(policy, seed, c, layout, a.steps, evals) for seed in a.seeds]
            r = res[label] = {"h": [x[0] for x in runs], "ok": all(x[1] for x in runs),
                              "pmean": {n: _mean([x[2][n] for x in runs]) for n in names},
                              "pfinal": {n: _mean([x[3][n] for x in runs]) for n in names},
                              "t": time.perf_counter() - t0}
            r["means"] = [_mean(list(h.values())) for h in r["h"]]
            r["worsts"] = [max(h.values()) for h in r["h"]]
            r["mean"], r["worst"] = _mean(r["means"]), _mean(r["worsts"])
            r["arm"] = {n: _mean([h[n] for h in r["h"]]) for n in names}
    ref = res["stratified"]
    labels = [r[0] for r in rows]
    wl = max(11, max(map(len, labels)) + 1)
    ws = 7 * len(a.seeds) + 2
    print(f"\n{'policy':<{wl}} {'mean held-out':>13} {'/strat':>7} {'worst arm':>10} {'/strat':>7}  "
          f"{'- strat (paired)':>18}  {'per seed (mean)':<{ws}} in box  time")
    for label in labels:
        r = res[label]
        dm, se, _ = _paired(r["means"], ref["means"])
        pair = "reference" if label == "stratified" else f"{dm:+.4f} +- {se:.4f}"
        print(f"{label:<{wl}} {r['mean']:13.4f} {r['mean'] / ref['mean']:7.4f} {r['worst']:10.4f} "
              f"{r['worst'] / ref['worst']:7.4f}  {pair:>18}  "
              f"{' '.join(f'{x:.4f}' for x in r['means']):<{ws}} {str(r['ok']):<6} {r['t']:4.0f} s")
    short = {n: n.replace("repo-", "") for n in names}
    print(f"\nper arm: held-out loss (seed mean) | mixture p, time-averaged -> final (seed mean)")
    print(f"{'policy':<{wl}} " + " ".join(f"{short[n]:>11}" for n in names) + "  | "
          + "  ".join(f"{short[n]:>14}" for n in names))
    for label in labels:
        r = res[label]
        print(f"{label:<{wl}} " + " ".join(f"{r['arm'][n]:11.4f}" for n in names) + "  | "
              + "  ".join(f"{r['pmean'][n]:6.3f} -> {r['pfinal'][n]:.3f}" for n in names))
    if "default" in res:
        r = res["default"]
        dm, se, _ = _paired(r["means"], ref["means"])
        drift = max(abs(r["pmean"][n] - ref["pmean"][n]) for n in names)
        verdict = "PASS" if r["mean"] <= ref["mean"] else "FAIL"
        print(f"\ndefault vs stratified, mean held-out loss: {r['mean']:.4f} vs {ref['mean']:.4f} -> {verdict} "
              f"(ratio {r['mean'] / ref['mean']:.4f}; paired difference {dm:+.4f} +- {se:.4f} s.e. over "
              f"{len(a.seeds)} seeds, t = {dm / se if se > 0 else float('nan'):+.1f}); the default's "
              f"time-averaged p stays within {drift:.3f} of stratified's")
    print(f"all posted p inside the box: {all(r['ok'] for r in res.values())}; "
          f"total wall time {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
