#!/usr/bin/env python3
"""Benchmark (docs/bandit.md#how-we-show-it-works): does the default mixture policy pay?

Same tiny model (andrea-test), same compute, same seeds, on two arm sets of different character
(A: the embedded default arms, docstrings / code / reference docs; B: the standard library's C
headers, its test files and IDLE's English prose; local files only), each in the box floors 0.1,
caps 0.6 on every arm:
  static      the natural mixture (proportional to each arm's training tokens), projected into the box
  stratified  uniform within the box (Aioli's strong baseline; the reference of every ratio)
  odm         the bandit with reward train_loss (ODM, Albalak et al. 2023)
  default     the bandit with its default configuration (reward heldout_progress)
  fixed[...]  the oracle: every fixed mixture of a grid over the box (step --grid-step, 0.1),
              best one per set = the "available gain" (stratified - best fixed); the default's
              captured share = (stratified - default) / (stratified - best fixed)
Runs in-process (no proxy): the worker's model, optimizer, sampler and the proxy's
MixtureController, with the same one-period policy lag as a real run, and the probe the worker
runs (shared/config.py `probe_plan`: its size from the config, <= probe_budget of training FLOPs).
The comparison charges the bandit for its probes: every policy that does not probe (static,
stratified, fixed) trains extra steps whose training FLOPs equal the default's probe forwards
(a forward is 1/3 of a training step per token), with its learning-rate schedule stretched to
match; so all rows spend the same compute. For a given seed every policy starts from the same
initialisation.

What is scored: at the end, each arm's mean loss (nats/token) on a FIXED evaluation set from the
arm's held-out split (never trained on) that is DISJOINT from the bandit's probe windows
(`ArmSampler.heldout_windows(name, probe_sequences)`, for every probe size in use), so the
heldout_progress reward never sees the windows it is judged on. The evaluation windows are the
non-overlapping block+1 tiles of the held-out split minus every tile that overlaps a probe window:
all of them by default, or `--eval-windows N` evenly spaced among them. Per seed: the mean over
arms and the worst arm. The table averages over seeds, gives ratios to stratified, and the paired
(same-seed) difference to stratified with its standard error over seeds. It also checks that no
posted p ever left its box.

`--trap` adds the collapse trap: set A plus an arm of repetitive, list-like text ("- item 3:
region region region"); the default must never raise that arm's probability above the prior it
holds after the warm-up (the repetition guard, docs/bandit.md#the-repetition-guard), and the odm
row and a `default[no guard]` row (the default with the guard off) show whether the trap is real.

The run configuration's bandit knobs (bandit_warmup, probe_every, probe_sequences) are options;
`--variant` adds rows of the default policy under other values of them or of BanditConfig
fields, e.g. `--variant fast:warmup=0,probe_every=5,eta=0.5`. `--cache FILE` keeps the fixed
mixtures' results (they do not depend on the bandit) so a rerun only trains the bandit rows.
The last lines are one machine-readable `RESULT {...}` per arm set.

    python scripts/bench_mixture.py [--sets A B] [--steps 300] [--seeds 1 2 3 4 5] [--trap]
        [--grid-step 0.1 | --no-oracle] [--cache FILE] [--eval-windows 0] [--bandit-warmup 50]
        [--probe-every 10] [--probe-sequences 8] [--policies ...] [--variant NAME:KEY=V,...]
"""
import argparse
import copy
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from proxy.mixture.bandit import BanditConfig, project_to_box  # noqa: E402
from proxy.mixture.controller import MixtureController
from proxy.run_files.phases import Phase
from proxy.supervision.run_setup import create_run  # noqa: E402
from shared.arm_data import read_arm_index  # noqa: E402
from shared.config import DEFAULT_ARMS, PRESETS, ArmSpec, RunConfig, probe_plan  # noqa: E402
from shared.run_layout import RunLayout  # noqa: E402
from worker.data import ArmSampler  # noqa: E402
from worker.model import GPT  # noqa: E402
from worker.optim import FlatAdamW, learning_rate  # noqa: E402

FLOOR, CAP = 0.1, 0.6         # the box of every arm
TRAP = "list-trap"
POLICIES = ("static", "stratified", "odm", "default")
WORST_LIMIT = 0.005   # the target's limit on the worst arm's loss against stratified, nats (docs/bandit.md)
T_LIMIT = -3.0        # the target's paired t against stratified, at most
CAPTURE_LIMIT = 0.5   # the target's share of the available gain, at least
VARIANT_KEYS = {"warmup": "bandit_warmup", "probe_every": "probe_every",
                "probe_sequences": "probe_sequences"}
BANDIT_KEYS = {f.name: f.type for f in dataclasses.fields(BanditConfig)} | {}
PROBING = ("odm", "default")
KIND_REWARD = {"odm": "train_loss", "default": "heldout_progress"}
PROBE_REWARDS = ("heldout_progress",)   # rewards that read the worker's probe
ROOT = Path(__file__).resolve().parent.parent
# the bandit rows' cache key includes the policy's code, so a cached row is what this code gives
POLICY_SOURCE = hashlib.sha256(b"".join(
    (ROOT / f).read_bytes() for f in ("proxy/mixture/bandit.py", "proxy/mixture/controller.py", "proxy/mixture/reward_scaler.py",
                                      "proxy/mixture/box_projection.py", "shared/config.py",
                                      "scripts/bench_mixture.py"))).hexdigest()[:16]  # policies run as the real system runs them: with the worker's probe


def arm_set(name: str, tmp: Path) -> list[ArmSpec]:
    """The arms of set `name`: "A" (the embedded defaults), "B" (C headers, test files, English
    prose of this Python installation), "C" (the codecs' generated charmap tables, a source that
    is learnt early and then adds little, beside C headers and the reference prose of pydoc's
    topics) or "trap" (A plus the repetitive list-like arm)."""
    lib, inc = sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["include"]
    if name == "A":
        return list(DEFAULT_ARMS)
    if name == "B":
        return [ArmSpec("c-headers", "text", f"{inc}/**/*.h"),
                ArmSpec("py-tests", "text", f"{lib}/test/test_[a-c]*.py"),
                ArmSpec("prose", "text", f"{lib}/idlelib/*.txt")]
    if name == "C":
        return [ArmSpec("charmaps", "text", f"{lib}/encodings/cp*.py"),
                ArmSpec("c-headers", "text", f"{inc}/**/*.h"),
                ArmSpec("topics", "text", f"{lib}/pydoc_data/topics.py")]
    if name == "trap":
        return list(DEFAULT_ARMS) + [ArmSpec(TRAP, "text", str(write_trap(tmp / "trap.txt")))]
    raise ValueError(f"unknown arm set {name!r}")


def write_trap(path: Path, lines: int = 12000) -> Path:
    """Repetitive, list-like text ("- item 3: region region region"): trivially predictable,
    the kind of source that lowered the predecessor's cross-entropy and collapsed its run."""
    words = ["region", "value", "entry", "table", "field", "option"]
    path.write_text("".join(f"- item {i % 50}: " + " ".join([words[i % len(words)]] * 3) + "\n"
                            for i in range(lines)))
    return path


def box(names) -> tuple[dict, dict]:
    """(floors, caps) of the benchmark box for `names`."""
    return {n: FLOOR for n in names}, {n: CAP for n in names}


def grid(names, step: float) -> list[dict]:
    """Every mixture on the grid of `step` inside the box (floors and caps included)."""
    units = round(1 / step)
    lo, hi = round(FLOOR / step), round(CAP / step)
    out = []
    for c in itertools.product(range(lo, hi + 1), repeat=len(names) - 1):
        last = units - sum(c)
        if lo <= last <= hi:
            out.append({n: round(v * step, 10) for n, v in zip(names, (*c, last))})
    return out


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


def eval_windows(sampler: ArmSampler, name: str, n: int, probe_counts) -> tuple[torch.Tensor, int]:
    """The fixed evaluation set of arm `name`: int64 (n, block+1) windows of its held-out ranges,
    pairwise non-overlapping and disjoint from the probe windows (`ArmSampler.heldout_starts`) of
    every count in `probe_counts`; n = 0 takes every such tile. Returns (windows, number of
    candidate tiles); raises ValueError when the held-out ranges have fewer than n such tiles."""
    toks, w = sampler.tokens[name], sampler.block + 1
    probes = sorted({s for k in set(probe_counts) for s in sampler.heldout_starts(name, k)})
    tiles = [s for a, b in sampler.heldout[name] for s in range(a, b - w + 1, w)
             if all(s + w <= p or s >= p + w for p in probes)]
    n = n or len(tiles)
    if len(tiles) < n:
        raise ValueError(f"arm {name!r}: only {len(tiles)} held-out tiles of {w} tokens clear of the "
                         f"probes; ask for --eval-windows <= {len(tiles)}")
    pick = [tiles[i] for i in np.linspace(0, len(tiles) - 1, n).round().astype(int)]
    assert len(set(pick)) == n
    for s in pick:  # inside one held-out range and disjoint from every probe window
        assert any(a <= s and s + w <= b for a, b in sampler.heldout[name])
        assert all(s + w <= p or s >= p + w for p in probes)
    return torch.from_numpy(np.stack([np.asarray(toks[s:s + w], dtype=np.int64) for s in pick])), len(tiles)


def train(kind: str, seed: int, cfg: RunConfig, layout: RunLayout, steps: int,
          evals: dict[str, torch.Tensor], fixed: dict | None = None,
          bandit_fields: dict | None = None) -> dict:
    """Train one policy for one seed for `steps` updates (cfg.lr_decay_steps sets the schedule).

    `kind`: "fixed" (the mixture `fixed`), "odm" or "default" (the bandit with the worker's probe
    of `probe_plan(cfg)`; `bandit_fields` override BanditConfig fields). Returns {"h": eval loss
    per arm, "ok": every posted p in the box, "pmean": time-mean p, "pfinal": final p, "pmax":
    largest p posted after the warm-up, "pstart": p in force at the first step after it}."""
    torch.manual_seed(seed)
    cfg.seed = seed
    index = read_arm_index(layout)
    sampler = ArmSampler(layout.root, index, cfg.model.block_size)
    names = sampler.names
    floors, caps = box(names)
    plan = probe_plan(cfg, len(names))
    probes = {n: sampler.heldout_windows(n, plan.sequences) for n in names}
    model = GPT(cfg.model, cfg.vocab_size, 0.0, seed=seed)
    model.to_device(torch.device("cpu"))
    opt = FlatAdamW(model, cfg)
    mix = None
    if kind in PROBING:
        mix = MixtureController(names, Phase(0, "bench", 0, caps, floors),
                                (bandit_fields or {}).get("reward") or KIND_REWARD[kind],
                                cfg.bandit_warmup, cfg.probe_every,
                                compression={n: a.compression for n, a in index.items()})
        if bandit_fields:
            mix.bandit.config = dataclasses.replace(mix.bandit.config, **bandit_fields)
    in_box = True
    p_sum = {n: 0.0 for n in names}
    pmax = {n: 0.0 for n in names}
    pstart = None
    for k in range(1, steps + 1):
        p = mix.policies[(k - 1) // cfg.probe_every] if mix else fixed
        in_box &= all(floors[n] - 1e-12 <= p.get(n, 0) <= caps[n] + 1e-12 for n in names)
        for n in names:
            p_sum[n] += p.get(n, 0.0)
            if k > cfg.bandit_warmup:
                pmax[n] = max(pmax[n], p.get(n, 0.0))
        if k == cfg.bandit_warmup + 1:
            pstart = dict(p)
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
            if k % plan.every == 0 and mix.bandit.config.reward == "heldout_progress":
                rec["probe"] = heldout(model, probes)
            mix.observe(rec)
    return {"h": heldout(model, evals), "ok": in_box, "pmean": {n: v / steps for n, v in p_sum.items()},
            "pfinal": dict(p), "pmax": pmax, "pstart": pstart or dict(p)}


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """'NAME:KEY=V,...' -> (NAME, {run config field: int}, {BanditConfig field: value}); KEY is
    warmup, probe_every, probe_sequences (run config) or a BanditConfig field (eta, share, ...)."""
    name, _, spec = text.partition(":")
    if not name or not spec:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME:warmup=W,probe_every=P,...")
    run_fields, bandit_fields = {}, {}
    for item in spec.split(","):
        key, _, val = item.partition("=")
        if key in VARIANT_KEYS and val.isdigit():
            run_fields[VARIANT_KEYS[key]] = int(val)
        elif key in BANDIT_KEYS and key not in ("warmup_steps", "reward"):
            try:
                bandit_fields[key] = json.loads(val)
            except ValueError:
                bandit_fields[key] = val
        else:
            raise argparse.ArgumentTypeError(
                f"--variant {text!r}: {item!r} is not KEY=VALUE with KEY one of "
                f"{', '.join(list(VARIANT_KEYS) + sorted(BANDIT_KEYS))}")
    try:
        BanditConfig(**bandit_fields)
    except Exception as e:  # BanditConfigError, TypeError
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {e}") from None
    return name, run_fields, bandit_fields


def _mean(xs):
    return sum(xs) / len(xs)


def _paired(xs, ys) -> tuple[float, float, list[float]]:
    """Mean and standard error (over seeds) of the paired differences xs - ys."""
    d = [x - y for x, y in zip(xs, ys)]
    return _mean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")), d


def _tval(dm: float, se: float) -> float:
    return dm / se if se > 0 else float("nan")


def target_verdict(s: dict) -> dict:
    """The target of docs/bandit.md#how-we-show-it-works applied to one RESULT row.

    `s` carries delta_mean and t (paired against stratified), captured (None without an oracle),
    worst_delta (nats) and box_ok, and optionally t_best_fixed_in_limits. Returns
    {"target_met": bool, "target_misses": [reason, ...]} and, when the oracle ran,
    "oracle_in_limits_meets_t": whether the best fixed mixture that keeps the worst arm within
    WORST_LIMIT itself reaches t <= T_LIMIT (a fixed mixture chosen with hindsight and paying no
    probe: when it does not, no policy held to the limits can be expected to).
    """
    miss = []
    if not (s.get("t") is not None and s["t"] == s["t"] and s["t"] <= T_LIMIT):
        miss.append(f"t {s.get('t')} > {T_LIMIT}")
    if s.get("captured") is None:
        miss.append("captured unknown (no oracle)")
    elif s["captured"] < CAPTURE_LIMIT:
        miss.append(f"captured {s['captured']} < {CAPTURE_LIMIT}")
    if not s.get("worst_delta", math.inf) <= WORST_LIMIT:
        miss.append(f"worst arm {s.get('worst_delta')} > +{WORST_LIMIT}")
    if not s.get("box_ok"):
        miss.append("a posted p left its box")
    out = {"target_met": not miss, "target_misses": miss}
    tf = s.get("t_best_fixed_in_limits")
    if tf is not None:
        out["oracle_in_limits_meets_t"] = tf == tf and tf <= T_LIMIT
    return out


def mix_label(p: dict, names, digits: int = 1) -> str:
    """fixed[0.6/0.3/0.1] in arm-name order."""
    return "fixed[" + "/".join(f"{p[n]:.{digits}f}" for n in names) + "]"


def run_set(set_name: str, a, root: Path, cache: dict) -> dict:
    """Every row of one arm set; prints its tables and returns its RESULT fields."""
    layout = RunLayout(root / f"bench-{set_name}")
    arms = arm_set(set_name, root)
    floors, caps = box([x.name for x in arms])
    cfg = RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], tokenizer="bytes",
                    batch_size=16, max_steps=a.steps, lr_decay_steps=a.steps, warmup_steps=20,
                    probe_every=a.probe_every, bandit_warmup=a.bandit_warmup,
                    probe_sequences=a.probe_sequences, arms=arms, caps=dict(caps), floors=dict(floors))
    t0 = time.perf_counter()
    cfg = create_run(layout, cfg)
    sampler = ArmSampler(layout.root, read_arm_index(layout), cfg.model.block_size)
    names = sampler.names
    K, B = len(names), cfg.batch_size
    # the bandit rows: (label, kind, run config, BanditConfig overrides)
    brows = [(p, p, cfg, {}) for p in PROBING if p in a.policies]
    for name, run_fields, bandit_fields in a.variant:
        vcfg = copy.deepcopy(cfg)
        for k, v in run_fields.items():
            setattr(vcfg, k, v)
        vcfg.validate()
        brows.append((f"default[{name}]", "default", vcfg, bandit_fields))
    if set_name == "trap" and "default" in a.policies:  # the trap is real: without the guard
        brows.append(("default[no guard]", "default", cfg, {"repetitive_ratio": 0.0}))
    plan = probe_plan(cfg, K)
    n_probes = a.steps // plan.every
    extra = round(n_probes * K * plan.sequences / (3 * B))   # training steps of equal FLOPs
    base_cfg = copy.deepcopy(cfg)
    base_cfg.lr_decay_steps = a.steps + extra
    # fixed rows: (label, mixture)
    frows = []
    if "static" in a.policies:
        frows.append(("static", project_to_box({n: float(read_arm_index(layout)[n].heldout_start)
                                                for n in names}, floors, caps)))
    frows.append(("stratified", project_to_box({n: 1.0 for n in names}, floors, caps)))
    oracle = [] if (a.no_oracle or set_name == "trap") else grid(names, a.grid_step)
    frows += [(mix_label(p, names), p) for p in oracle]
    max_s = max([cfg.probe_sequences] + [c.probe_sequences for _, _, c, _ in brows]
                + [probe_plan(c, K).sequences for _, _, c, _ in brows])
    evals, tiles = {}, {}
    for n in names:
        evals[n], tiles[n] = eval_windows(sampler, n, a.eval_windows, range(1, max_s + 1))
    print(f"\n=== arm set {set_name}: {', '.join(f'{n} ({read_arm_index(layout)[n].n_tokens:,} tokens)' for n in names)}; "
          f"run created in {time.perf_counter() - t0:.1f} s")
    print(f"{a.steps} steps x {B} sequences x {cfg.model.block_size} tokens per bandit policy and seed; "
          f"seeds {' '.join(map(str, a.seeds))}; box floors {FLOOR}, caps {CAP} on every arm")
    print(f"probe (probe_plan): {plan.sequences} windows x {K} arms every {plan.every} steps = "
          f"{plan.cost:.2%} of training FLOPs; charged: policies that do not probe train "
          f"{a.steps} + {extra} steps (the probes' {n_probes} x {K * plan.sequences} window forwards "
          f"/ 3 per token), lr schedule over {a.steps + extra}")
    for label, kind, c, bf in brows:
        pp = probe_plan(c, K)
        upd = a.steps - c.bandit_warmup if kind == "odm" else (a.steps - c.bandit_warmup) // pp.every
        print(f"  {label}: bandit_warmup {c.bandit_warmup}, probe_every {c.probe_every} (policy period), "
              f"probe {pp.sequences} windows every {pp.every} ({pp.cost:.2%}); about {max(0, upd)} "
              f"updates{'; ' + ', '.join(f'{k}={v}' for k, v in bf.items()) if bf else ''}")
    print(f"scored on: fixed, non-overlapping {cfg.model.block_size + 1}-token windows of each arm's "
          f"held-out split, DISJOINT from every probe window of 1..{max_s} sequences: "
          f"{', '.join(f'{n} {len(evals[n])}' for n in names)} windows")
    res = {}
    for label, p in frows:
        t1 = time.perf_counter()
        runs, hit = [], 0
        for seed in a.seeds:
            key = json.dumps(["v1", set_name, seed, a.steps + extra, base_cfg.lr_decay_steps,
                              sorted(p.items()), a.eval_windows, max_s, cfg.batch_size])
            if key not in cache:
                cache[key] = train("fixed", seed, base_cfg, layout, a.steps + extra, evals, fixed=p)
            else:
                hit += 1
            runs.append(cache[key])
        res[label] = {"runs": runs, "t": time.perf_counter() - t1, "cached": hit}
        if a.cache and hit < len(a.seeds):
            a.cache.write_text(json.dumps(cache))  # after every row: a stopped run keeps its work
        print(f"  ... {set_name} {label}: {res[label]['t']:.0f} s", file=sys.stderr, flush=True)
    for label, kind, c, bf in brows:
        t1 = time.perf_counter()
        runs, hit = [], 0
        for seed in a.seeds:
            key = json.dumps(["v1", set_name, seed, kind, a.steps, c.bandit_warmup, c.probe_every,
                              c.probe_sequences, c.probe_budget, sorted(bf.items()), a.eval_windows,
                              max_s, c.batch_size, POLICY_SOURCE])
            reward = bf.get("reward") or KIND_REWARD[kind]
            free = reward not in PROBE_REWARDS  # reads no probe: trains the steps the probes would cost
            if free:
                key = key.replace('"v1"', '"v1-free"', 1)
            if key not in cache:
                rc = copy.deepcopy(c)
                if free:
                    rc.lr_decay_steps = a.steps + extra
                cache[key] = train(kind, seed, rc, layout, a.steps + extra if free else a.steps, evals,
                                   bandit_fields=bf)
            else:
                hit += 1
            runs.append(cache[key])
        res[label] = {"runs": runs, "t": time.perf_counter() - t1, "cached": hit}
        if a.cache and hit < len(a.seeds):
            a.cache.write_text(json.dumps(cache))
        print(f"  ... {set_name} {label}: {res[label]['t']:.0f} s", file=sys.stderr, flush=True)
    for r in res.values():
        runs = r["runs"]
        r["ok"] = all(x["ok"] for x in runs)
        for f in ("pmean", "pfinal", "pmax", "pstart"):
            r[f] = {n: _mean([x[f][n] for x in runs]) for n in names}
        r["pmax_all"] = {n: max(x["pmax"][n] for x in runs) for n in names}
        r["pstart_all"] = {n: min(x["pstart"][n] for x in runs) for n in names}
        r["means"] = [_mean(list(x["h"].values())) for x in runs]
        r["worsts"] = [max(x["h"].values()) for x in runs]
        r["mean"], r["worst"] = _mean(r["means"]), _mean(r["worsts"])
        r["arm"] = {n: _mean([x["h"][n] for x in runs]) for n in names}
    ref = res["stratified"]
    fixed_labels = [lab for lab, _ in frows[:2] if lab in ("static", "stratified")]
    grid_labels = sorted((lab for lab, _ in frows if lab.startswith("fixed[")), key=lambda x: res[x]["mean"])
    best = grid_labels[0] if grid_labels else None
    labels = fixed_labels + ([best] if best else []) + [lab for lab, _, _, _ in brows]
    print_table(res, labels, ref, names, a)
    if grid_labels:
        print(f"\noracle grid ({len(grid_labels)} fixed mixtures, step {a.grid_step}, arms "
              f"{'/'.join(names)}), by mean held-out loss (seed mean); - strat paired:")
        for i in range(0, len(grid_labels), 3):
            print("  " + "   ".join(f"{lab:<{9 + 4 * K}} {res[lab]['mean']:.4f} "
                                    f"{_paired(res[lab]['means'], ref['means'])[0]:+.4f}"
                                    for lab in grid_labels[i:i + 3]))
    sm = None
    if grid_labels and len(a.seeds) > 1:
        sm = smoothed_oracle(res, [(lab, p) for lab, p in frows if lab.startswith("fixed[")], names,
                             a.seeds, ref["mean"])
        print(f"best cell {best}: {ref['mean'] - res[best]['mean']:+.4f} below stratified; but a cell's "
              f"paired difference to stratified has a standard error of {sm['cell_se']:.4f} over "
              f"{len(a.seeds)} seeds, so among {len(grid_labels)} cells with NO real difference the best "
              f"would look about {sm['null_max']:.4f} better from noise alone")
        print(f"smoothed oracle (quadratic surface + seed offsets over every cell and seed, residual sd "
              f"{sm['resid_sd']:.4f}): minimum {sm['fit_min']:.4f} at {mix_label(sm['mix'], names, 2).replace('fixed', '')}"
              f" (step 0.01), stratified on the surface {sm['fit_strat']:.4f}: smoothed available gain "
              f"{sm['gain']:.4f}")
    # the target's own limits applied to the oracle: the best cell whose worst arm is within
    # WORST_LIMIT of stratified's, and its paired t (could ANY fixed mixture meet point 3?)
    fair = [lab for lab in grid_labels if res[lab]["worst"] - ref["worst"] <= WORST_LIMIT]
    fair_best = fair[0] if fair else None
    if fair_best:
        fdm, fse, _ = _paired(res[fair_best]["means"], ref["means"])
        print(f"best cell within the worst-arm limit (+{WORST_LIMIT}): {fair_best} "
              f"{-fdm:+.4f} below stratified (t = {_tval(fdm, fse):+.1f}, worst arm "
              f"{res[fair_best]['worst'] - ref['worst']:+.4f}): the most a policy held to the "
              f"target's limits can find in this box")
    out = {}
    for lab, kind, _, _ in brows:
        r = res[lab]
        dm, se, _ = _paired(r["means"], ref["means"])
        gain = ref["mean"] - res[best]["mean"] if best else float("nan")
        s = {"set": set_name, "policy": lab, "delta_mean": round(dm, 5), "t": round(_tval(dm, se), 2),
             "captured": (round((ref["mean"] - r["mean"]) / gain, 3) if best and gain > 0 else None),
             "available_gain": round(gain, 5) if best else None, "best_fixed": best,
             "worst_delta": round(r["worst"] - ref["worst"], 5), "box_ok": r["ok"]}
        if fair_best:
            fdm, fse, _ = _paired(res[fair_best]["means"], ref["means"])
            s |= {"best_fixed_in_limits": fair_best, "available_gain_in_limits": round(-fdm, 5),
                  "t_best_fixed_in_limits": round(_tval(fdm, fse), 2)}
        if sm:
            s |= {"available_gain_smoothed": round(sm["gain"], 5),
                  "captured_smoothed": (round((ref["mean"] - r["mean"]) / sm["gain"], 3)
                                        if sm["gain"] > 0 else None),
                  "noise_best_cell": round(sm["null_max"], 5)}
        s |= target_verdict(s)
        if TRAP in names:
            s |= {"trap_p_start": round(r["pstart_all"][TRAP], 4),
                  "trap_p_max_after_warmup": round(r["pmax_all"][TRAP], 4),
                  "trap_raised": r["pmax_all"][TRAP] > r["pstart_all"][TRAP] + 1e-9}
        print(f"{lab} vs stratified: delta mean {s['delta_mean']:+.4f} (t = {s['t']:+.1f}), captured "
              f"{s['captured']} of the available gain {s['available_gain']} ({best}), worst arm "
              f"{s['worst_delta']:+.4f}, in box {s['box_ok']}"
              + (f"; {TRAP}: p {s['trap_p_start']:.3f} after the warm-up, at most "
                 f"{s['trap_p_max_after_warmup']:.3f} later (raised: {s['trap_raised']})"
                 if TRAP in names else ""))
        print(f"  target (t <= {T_LIMIT}, captured >= {CAPTURE_LIMIT}, worst arm <= +{WORST_LIMIT}, in box): "
              + ("met" if s["target_met"] else "missed: " + "; ".join(s["target_misses"]))
              + ("" if "oracle_in_limits_meets_t" not in s else
                 f"; the best fixed mixture within the worst-arm limit "
                 f"{'reaches' if s['oracle_in_limits_meets_t'] else 'does not reach'} t <= {T_LIMIT} itself"))
        out[lab] = s
    return out


def smoothed_oracle(res: dict, grid_rows: list, names, seeds, ref_mean: float) -> dict:
    """The oracle without the winner's curse: a least-squares quadratic surface in the mixture
    (features 1, p_i, p_i p_j over the first K-1 arms) with one offset per seed, fitted to
    every (grid mixture, seed) mean held-out loss, minimised over a 0.01 (K=3; 0.02 for K>3)
    lattice of the box. Returns {"mix", "fit_min", "fit_strat", "gain" (fit at stratified - fit
    minimum), "resid_sd", "cell_se" (median standard error over seeds of a cell's paired
    difference to stratified), "null_max" (the best-cell gain that pure noise of that size
    gives among this many cells: cell_se x the expected maximum of that many standard normals)}."""
    K = len(names)

    def feats(p):
        x = [p[n] for n in names[:-1]]
        return [1.0] + x + [x[i] * x[j] for i in range(len(x)) for j in range(i, len(x))]
    rows, y = [], []
    for lab, mix in grid_rows:
        for si, run in enumerate(res[lab]["runs"]):
            rows.append(feats(mix) + [1.0 if si == j else 0.0 for j in range(1, len(seeds))])
            y.append(_mean(list(run["h"].values())))
    X, y = np.array(rows), np.array(y)
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    resid = float(np.std(y - X @ coef, ddof=min(len(y) - 1, X.shape[1])))
    offset = float(np.mean([0.0] + list(coef[X.shape[1] - len(seeds) + 1:])))  # mean seed effect
    nf = X.shape[1] - len(seeds) + 1

    def fit(p):
        return float(np.dot(feats(p), coef[:nf])) + offset
    step = 0.01 if K == 3 else 0.02
    best = None
    for mix in grid(names, step):
        v = fit(mix)
        if best is None or v < best[0]:
            best = (v, mix)
    strat = {n: 1.0 / K for n in names}
    ses = [statistics.stdev(_paired(res[lab]["means"], res["stratified"]["means"])[2]) / math.sqrt(len(seeds))
           for lab, _ in grid_rows if len(seeds) > 1]
    cell_se = float(np.median(ses)) if ses else float("nan")
    n = len(grid_rows)  # E[max of n standard normals], by Blom's approximation
    emax = float(statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25)))
    return {"mix": best[1], "fit_min": best[0], "fit_strat": fit(strat), "gain": fit(strat) - best[0],
            "resid_sd": resid, "cell_se": cell_se, "null_max": cell_se * emax}


def print_table(res: dict, labels: list, ref: dict, names, a) -> None:
    """The main table and the per-arm table of one set."""
    wl = max(11, max(map(len, labels)) + 1)
    ws = 7 * len(a.seeds) + 2
    print(f"\n{'policy':<{wl}} {'mean held-out':>13} {'/strat':>7} {'worst arm':>10} {'/strat':>7}  "
          f"{'- strat (paired)':>18} {'t':>5}  {'per seed (mean)':<{ws}} in box  time")
    for label in labels:
        r = res[label]
        dm, se, _ = _paired(r["means"], ref["means"])
        pair = "reference" if r is ref else f"{dm:+.4f} +- {se:.4f}"
        tv = "" if r is ref else f"{_tval(dm, se):+.1f}"
        print(f"{label:<{wl}} {r['mean']:13.4f} {r['mean'] / ref['mean']:7.4f} {r['worst']:10.4f} "
              f"{r['worst'] / ref['worst']:7.4f}  {pair:>18} {tv:>5}  "
              f"{' '.join(f'{x:.4f}' for x in r['means']):<{ws}} {str(r['ok']):<6} {r['t']:4.0f} s"
              + (f" ({r['cached']} cached)" if r["cached"] else ""))
    short = {n: n.replace("repo-", "") for n in names}
    print(f"\nper arm: held-out loss (seed mean) | mixture p, time-averaged -> final (seed mean)")
    print(f"{'policy':<{wl}} " + " ".join(f"{short[n]:>11}" for n in names) + "  | "
          + "  ".join(f"{short[n]:>14}" for n in names))
    for label in labels:
        r = res[label]
        print(f"{label:<{wl}} " + " ".join(f"{r['arm'][n]:11.4f}" for n in names) + "  | "
              + "  ".join(f"{r['pmean'][n]:6.3f} -> {r['pfinal'][n]:.3f}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", choices=("A", "B", "C", "trap"), default=["A", "B"],
                    help="arm sets (A: the embedded defaults; B: C headers, test files, prose; C: charmap "
                         "tables, C headers, reference prose; trap: A plus the repetitive arm)")
    ap.add_argument("--trap", action="store_true",
                    help="also run the collapse trap: set A plus a repetitive list-like arm")
    ap.add_argument("--steps", type=int, default=300, help="training steps of the bandit rows (e.g. 1000)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--grid-step", type=float, default=0.1, help="oracle grid step (default 0.1)")
    ap.add_argument("--no-oracle", action="store_true", help="skip the grid of fixed mixtures")
    ap.add_argument("--cache", type=Path, nargs="+",
                    help="JSON file keeping the rows' results (written; fixed mixtures by set, seed, "
                         "mixture and steps; bandit rows also by the policy's source hash); more files "
                         "are read too")
    ap.add_argument("--eval-windows", type=int, default=0,
                    help="held-out evaluation windows per arm, disjoint from the probes; 0 (default) = "
                         "every non-overlapping window of the held-out split clear of the probes")
    ap.add_argument("--bandit-warmup", type=int, default=50,
                    help="run config bandit_warmup: steps on the prior before the first update (default 50)")
    ap.add_argument("--probe-every", type=int, default=10,
                    help="run config probe_every: the policy period and lag, steps (default 10)")
    ap.add_argument("--probe-sequences", type=int, default=8,
                    help="run config probe_sequences: at most this many probe windows per arm (default 8)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                    help="policies to run (stratified always runs: it is the reference)")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="extra row: the default policy with other knobs, NAME:KEY=VALUE,... with KEY "
                         "warmup, probe_every, probe_sequences or a BanditConfig field (repeatable)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    t_all = time.perf_counter()
    cache = {}
    for f in reversed(a.cache or []):
        if f.exists():
            cache.update(json.loads(f.read_text()))
    a.cache = a.cache[0] if a.cache else None
    results = []
    with tempfile.TemporaryDirectory() as d:
        for set_name in list(dict.fromkeys(list(a.sets) + (["trap"] if a.trap else []))):
            out = run_set(set_name, a, Path(d), cache)
            if a.cache:
                a.cache.write_text(json.dumps(cache))
            results += [s for s in out.values() if s["policy"] == "default" or set_name == "trap"]
    print(f"\nall posted p inside the box: {all(s['box_ok'] for s in results)}; "
          f"total wall time {time.perf_counter() - t_all:.0f} s")
    for s in results:
        if s["policy"] == "default":
            print("RESULT " + json.dumps(s))


if __name__ == "__main__":
    main()
