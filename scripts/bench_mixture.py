#!/usr/bin/env python3
"""Benchmark (docs/bandit.md#how-we-show-it-works): does the default mixture policy pay?

Same tiny model (andrea-test, or `--preset andrea-tiny`), same compute, same seeds, on arm sets
of different character, local files only, each in the box floors 0.1, caps 0.6 on every arm:
  A     the embedded default arms (docstrings / code / reference docs)           role: alike
  B     this Python's C headers, its test files and IDLE's English prose           role: alike
  C     the codecs' generated charmap tables, C headers, pydoc's topics            role: alike
  D     two real arms beside an unlearnable one (base64 of seeded random bytes)    mixing matters
  F     a small arm (the LICENSE) repeated many epochs within the run, two large    candidate
  G     two real arms beside pydoc's topics with each line's words shuffled         candidate
  H     two real arms beside boilerplate: one file header repeated with small changes  candidate
  I     two real arms beside pydoc's topics with each line's characters shuffled     candidate
  trap  A plus a repetitive, list-like arm ("- item 3: region region region")      role: trap
A set counts as "mixing matters" only where the smoothed oracle's gain within the limits is at
least three standard errors (else it is judged as alike). Policies (rows):
  static      the natural mixture (proportional to each arm's training tokens), projected into the box
  stratified  uniform within the box (Aioli's strong baseline; the reference of every ratio)
  odm         the bandit with reward train_loss (ODM, Albalak et al. 2023)
  probe       the bandit with the held-out probe's reward (heldout_progress), its probe charged
  default     the bandit as a run gets it: reward train_slope, lambda_rule gate, z = 3 (free: no
              probe; docs/bandit.md#the-default-policy)
  fixed[...]  the oracle: fixed mixtures over the box (`--oracle-design grid|sparse|mini`), smoothed
              by a quadratic fit; the default's captured share = (stratified - default) /
              (stratified - best fixed within the limits)
Runs in-process (no proxy): the worker's model, optimizer and sampler and the proxy's
MixtureController, with the same one-period policy lag as a real run. A policy that reads the
probe is charged for it: every row that does not probe trains extra steps whose FLOPs equal the
probe's forwards (a forward is 1/3 of a training step per token), with its learning-rate schedule
stretched to match, so all rows spend the same compute. For a given seed every policy starts from
the same initialisation.

What is scored: at the end, each arm's mean loss (nats/token) on a FIXED evaluation set from the
arm's held-out split (never trained on) that is DISJOINT from the probe windows, so the probe's
reward never sees the windows it is judged on. Per seed: the mean over the learnable arms (those
where stratified's loss is below the arm's unigram baseline, `unigram_loss`, so D's noise and I's
scrambled arm are left out; the mean over all arms is reported too) and the worst arm. Each row: n, the
paired (same-seed) difference to stratified with its standard deviation, 95 % interval and t;
the targets of docs/bandit.md#targets with Holm's correction over the sets in one invocation;
that no posted p ever left its box; the trap arm's p against its value after the warm-up; what
a target missed, by how much.

`--variant` adds rows of the default policy under other values of BanditConfig fields, e.g.
`--variant z1:confidence_z=1`. `--cache FILE...` keeps every run's result, keyed by what it is a
function of (the policy source's hash for bandit rows), so a rerun trains only what is missing;
`--cached-only` reports without training. `--quick` (sets A, D, F, trap; 150 steps; 2 seeds; no
oracle) is what the slow test runs. The last lines are one machine-readable `RESULT {...}` per
arm set.

    python scripts/bench_mixture.py [--sets A B C D F trap] [--steps 600] [--seeds 1 2 3 4 5]
        [--oracle-sets D F] [--oracle-design mini] [--oracle-seeds 3] [--no-oracle] [--quick]
        [--cache FILE ...] [--cached-only] [--policies ...] [--variant NAME:KEY=V,...]
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
from proxy.mixture.controller import MixtureController  # noqa: E402
from proxy.mixture.loss_trend import t_cdf, t_quantile  # noqa: E402
from proxy.mixture.rebuild import epoch_windows  # noqa: E402
from proxy.run_files.phases import Phase  # noqa: E402
from proxy.supervision.run_setup import create_run  # noqa: E402
from scripts.bench_stats import add_result, decide  # noqa: E402
from shared.data.token_files import read_arm_index  # noqa: E402
from shared.lr_schedule import learning_rate  # noqa: E402
from shared.run.config import DEFAULT_ARMS, PRESETS, ArmSpec, RunConfig, probe_plan  # noqa: E402
from shared.run.layout import RunLayout  # noqa: E402
from worker.data import ArmSampler  # noqa: E402
from worker.model import GPT  # noqa: E402
from worker.optim import FlatAdamW  # noqa: E402

FLOOR, CAP = 0.1, 0.6         # the box of every arm
TRAP = "list-trap"
NOISE = "noise-b64"           # set D's unlearnable arm: base64 of seeded random bytes
SMALL = "small-license"       # set F's small arm, repeated many epochs within the run
SHUFFLED = "topics-shuffled"  # set G's low-quality arm: pydoc's topics, words shuffled per line
BOILERPLATE = "boilerplate"   # set H's low-quality arm: one file header with small changes
SCRAMBLED = "topics-scrambled"  # set I's low-quality arm: pydoc's topics, characters shuffled per line
POLICIES = ("static", "stratified", "odm", "probe", "default")
WORST_LIMIT = 0.005   # the target's limit on the worst arm's loss against stratified, nats (docs/bandit.md)
T_LIMIT = -3.0        # the target's paired t against stratified, at most
CAPTURE_LIMIT = 0.5   # the target's share of the available gain, at least
VARIANT_KEYS = {"warmup": "bandit_warmup", "probe_every": "probe_every",
                "probe_sequences": "probe_sequences"}
BANDIT_KEYS = {f.name: f.type for f in dataclasses.fields(BanditConfig)} | {}
PROBING = ("odm", "probe", "default")   # the bandit rows
KIND_REWARD = {"odm": "train_loss", "probe": "heldout_progress", "default": "train_slope"}
PROBE_REWARDS = ("heldout_progress",)   # rewards that read the worker's probe
ROOT = Path(__file__).resolve().parent.parent
# the bandit rows' cache key includes the policy's code, so a cached row is what this code gives
POLICY_SOURCE = hashlib.sha256(b"".join(
    (ROOT / f).read_bytes() for f in ("proxy/mixture/bandit.py", "proxy/mixture/controller.py",
                                      "proxy/mixture/reward_scaler.py",
                                      "proxy/mixture/loss_trend.py",
                                      "proxy/mixture/box_projection.py", "shared/run/config.py",
                                      "scripts/bench_mixture.py", "worker/data.py"))).hexdigest()[:16]
PRESET_KEY: list[str] = []  # the model, in the cache keys of every model but andrea-test
# (policies run as the real system runs them: with the worker's probe)


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
    if name == "D":
        return [a for a in DEFAULT_ARMS if a.name in ("python-docs", "repo-code")] + [
            ArmSpec(NOISE, "text", str(write_noise(tmp / "noise.txt")))]
    if name == "G":
        return [a for a in DEFAULT_ARMS if a.name in ("python-docs", "repo-code")] + [
            ArmSpec(SHUFFLED, "text", str(write_shuffled(Path(lib) / "pydoc_data/topics.py",
                                                         tmp / "shuffled.txt")))]
    if name == "H":
        return [a for a in DEFAULT_ARMS if a.name in ("python-docs", "repo-code")] + [
            ArmSpec(BOILERPLATE, "text", str(write_boilerplate(tmp / "boilerplate.txt")))]
    if name == "I":
        return [a for a in DEFAULT_ARMS if a.name in ("python-docs", "repo-code")] + [
            ArmSpec(SCRAMBLED, "text", str(write_shuffled(Path(lib) / "pydoc_data/topics.py",
                                                          tmp / "scrambled.txt", unit="characters")))]
    if name == "F":
        return [ArmSpec("c-headers", "text", f"{inc}/**/*.h"),
                ArmSpec("py-tests", "text", f"{lib}/test/test_[a-c]*.py"),
                ArmSpec(SMALL, "text", f"{lib}/LICENSE.txt")]
    raise ValueError(f"unknown arm set {name!r}")


def write_noise(path: Path, n_bytes: int = 600_000, seed: int = 24) -> Path:
    """Base64 of `n_bytes` random bytes from a seeded generator, 76 characters a line (the
    shape of encoded blobs in real corpora): 6 bits of entropy per character, nothing a model
    can learn beyond the 64-letter alphabet, and it does not compress (ratio about 1.3), so the
    repetition guard does not see it."""
    import base64
    raw = np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8).tobytes()
    text = base64.b64encode(raw).decode()
    path.write_text("".join(text[i:i + 76] + "\n" for i in range(0, len(text), 76)))
    return path


def write_shuffled(src: Path, path: Path, seed: int = 7, unit: str = "words") -> Path:
    """`src` (real prose) with the words (`unit` "words") or the characters ("characters") of
    each line in a seeded random order. Words: a low-quality learnable arm, its words and
    spelling intact and their order gone (the kind of text that scrambled or machine-shuffled
    pages put into a corpus). Characters: scrambled text, its letter frequencies those of the
    prose and little more to learn beyond them (where lines break, how much of a line is
    indentation): andrea-test's loss on it is above its unigram baseline at 600 steps and just
    below it at 3,000."""
    rng = np.random.default_rng(seed)
    lines = []
    for line in src.read_text(encoding="utf-8").splitlines():
        parts = line.split() if unit == "words" else list(line)
        rng.shuffle(parts)
        lines.append((" " if unit == "words" else "").join(parts))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_boilerplate(path: Path, headers: int = 4000, seed: int = 11) -> Path:
    """`headers` generated-file headers from one template with small seeded changes (year, owner,
    licence, generator and its version, a file name): about 900 KB of the boilerplate that code
    corpora carry at the top of every file. Learnable (the template is fixed, the changes are
    drawn from short lists) and then of little more use: a low-quality learnable arm."""
    rng = np.random.default_rng(seed)
    owners = ["Acme Corp", "The Foo Authors", "Initech Ltd", "Globex Inc", "Example Org",
              "Umbrella Labs", "Hooli", "Vandelay Industries"]
    licences = ["Apache-2.0", "MIT", "BSD-3-Clause", "GPL-2.0-only", "MPL-2.0"]
    tools = ["protoc", "thrift", "swig", "cython", "bison", "flex", "sip"]
    stems = ["parser", "lexer", "types", "client", "server", "schema", "codec", "bindings"]
    out = []
    for _ in range(headers):
        year, minor = 1995 + int(rng.integers(30)), int(rng.integers(20))
        out.append(
            f"/*\n * Copyright (c) {year} {owners[rng.integers(len(owners))]}. All rights reserved.\n"
            f" * SPDX-License-Identifier: {licences[rng.integers(len(licences))]}\n"
            f" *\n * {stems[rng.integers(len(stems))]}_{rng.integers(100)}.h: generated by "
            f"{tools[rng.integers(len(tools))]} 3.{minor}.{rng.integers(10)}. DO NOT EDIT.\n"
            " * Changes to this file will be lost when the code is regenerated.\n */\n\n")
    path.write_text("".join(out))
    return path


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


def unigram_loss(sampler: ArmSampler, name: str, windows: torch.Tensor, vocab: int) -> float:
    """The held-out loss (nats/token) of arm `name`'s unigram model: the token frequencies of its
    training split (every token outside its held-out ranges), add-one smoothed over `vocab`,
    scored on the targets of `windows` (int64 (n, block+1), as `heldout` scores the model). An
    arm counts as learnable, and in the mean the targets judge, only where stratified's model
    beats this baseline: one that does not has taught nothing beyond its letters' frequencies
    (base64 noise at every horizon; set I's scrambled text at 600 steps, not at 3,000)."""
    toks = np.asarray(sampler.tokens[name], dtype=np.int64)
    counts = np.bincount(toks, minlength=vocab).astype(np.float64)
    for lo, hi in sampler.heldout[name]:
        counts -= np.bincount(toks[lo:hi], minlength=vocab)
    logq = np.log((counts + 1.0) / (counts.sum() + vocab))
    return float(-logq[windows[:, 1:].numpy()].mean())


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
    sampler = ArmSampler(layout.root, index, cfg.model.block_size, cfg.vocab_size)
    names = sampler.names
    floors, caps = box(names)
    plan = probe_plan(dataclasses.replace(cfg, reward="heldout_progress"), len(names))
    probes = {n: sampler.heldout_windows(n, plan.sequences) for n in names}
    model = GPT(cfg.model, cfg.vocab_size, 0.0, seed=seed)
    model.to(torch.device("cpu"))
    opt = FlatAdamW(model, cfg)
    mix = None
    if kind in PROBING:
        mix = MixtureController(names, Phase(0, "bench", 0, caps, floors),
                                (bandit_fields or {}).get("reward") or KIND_REWARD[kind],
                                cfg.bandit_warmup, cfg.probe_every,
                                compression={n: a.compression for n, a in index.items()},
                                epoch_size={n: epoch_windows(a, cfg.model.block_size)
                                            for n, a in index.items()})
        if bandit_fields:
            mix.bandit.config = dataclasses.replace(mix.bandit.config, **bandit_fields)
    in_box = True
    p_sum = {n: 0.0 for n in names}
    pmax = {n: 0.0 for n in names}
    pstart = None
    policy_s, lam_max, lam_first = 0.0, 0.0, None
    t_run = time.perf_counter()
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
            drawn = [(i, n) for i, n in enumerate(names) if (b.arm_index == i).any()]
            rec = {"step": k, "arms": b.counts, "p": dict(p), "phase": {"index": 0, "label": "bench"},
                   "arm_loss": {n: float(s[b.arm_index == i].mean()) for i, n in drawn},
                   "arm_unigram_loss": {n: float(b.unigram_loss[b.arm_index == i].mean())
                                        for i, n in drawn}}
            t_pol = time.perf_counter()   # the policy's own time: the probe (if any) and the fold
            if k % plan.every == 0 and mix.bandit.config.reward == "heldout_progress":
                rec["probe"] = heldout(model, probes)
            mix.observe(rec)
            policy_s += time.perf_counter() - t_pol
            lam_max = max(lam_max, mix.bandit.lam)
            if lam_first is None and mix.bandit.lam > 0:
                lam_first = k
    total_s = time.perf_counter() - t_run
    out = {"h": heldout(model, evals), "ok": in_box, "pmean": {n: v / steps for n, v in p_sum.items()},
           "pfinal": dict(p), "pmax": pmax, "pstart": pstart or dict(p),
           "policy_s": policy_s, "train_s": total_s}
    if mix:
        out |= {"lam_final": mix.bandit.lam, "lam_max": lam_max, "lam_first": lam_first,
                "repeated": dict(mix.bandit.repeated)}
    return out


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


def mix_label(p: dict, names, digits: int = 1) -> str:
    """fixed[0.6/0.3/0.1] in arm-name order."""
    return "fixed[" + "/".join(f"{p[n]:.{digits}f}" for n in names) + "]"


def run_set(set_name: str, a, root: Path, cache: dict) -> dict:
    """Every row of one arm set; prints its tables and returns its RESULT fields."""
    layout = RunLayout(root / f"bench-{set_name}")
    arms = arm_set(set_name, root)
    floors, caps = box([x.name for x in arms])
    cfg = RunConfig(preset=a.preset, model=PRESETS[a.preset], tokenizer="bytes",
                    batch_size=16, max_steps=a.steps, lr_decay_steps=a.steps, warmup_steps=20,
                    probe_every=a.probe_every, bandit_warmup=a.bandit_warmup,
                    probe_sequences=a.probe_sequences, arms=arms, caps=dict(caps), floors=dict(floors))
    t0 = time.perf_counter()
    cfg = create_run(layout, cfg)
    sampler = ArmSampler(layout.root, read_arm_index(layout), cfg.model.block_size)
    names = sampler.names
    K, B = len(names), cfg.batch_size
    # the bandit rows: (label, kind, run config, BanditConfig overrides)
    brows = [(p, p, dataclasses.replace(cfg, reward=KIND_REWARD[p]), {}) for p in PROBING if p in a.policies]
    for name, run_fields, bandit_fields in a.variant:
        vcfg = copy.deepcopy(cfg)
        for k, v in run_fields.items():
            setattr(vcfg, k, v)
        vcfg.validate()
        brows.append((f"default[{name}]", "default", vcfg, bandit_fields))
    if set_name == "trap" and "probe" in a.policies:  # the trap is real: without the guard
        brows.append(("probe[no guard]", "probe", dataclasses.replace(cfg, reward="heldout_progress"),
                      {"repetitive_ratio": 0.0}))
    plan = probe_plan(dataclasses.replace(cfg, reward="heldout_progress"), K)
    n_probes = a.steps // plan.every
    probing = [lab for lab, kind, _, bf in brows if (bf.get("reward") or KIND_REWARD[kind]) in PROBE_REWARDS]
    # training steps of equal FLOPs to the probes, trained by every row that does not probe;
    # none when no row probes (the default reads only the training losses: it costs nothing)
    extra = round(n_probes * K * plan.sequences / (3 * B)) if probing else 0
    base_cfg = copy.deepcopy(cfg)
    base_cfg.lr_decay_steps = a.steps + extra
    # fixed rows: (label, mixture)
    frows = []
    if "static" in a.policies:
        frows.append(("static", project_to_box({n: float(read_arm_index(layout)[n].heldout_start)
                                                for n in names}, floors, caps)))
    frows.append(("stratified", project_to_box({n: 1.0 for n in names}, floors, caps)))
    oracle = [] if (a.no_oracle or set_name == "trap"
                    or (a.oracle_sets and set_name not in a.oracle_sets)) else (
        sparse_design(names) if a.oracle_design == "sparse" else
        mini_design(names) if a.oracle_design == "mini" else grid(names, a.grid_step))
    frows += [(mix_label(p, names, 2), p) for p in oracle]
    # the scoring windows avoid every probe window a probing row could read; none to avoid when
    # no row probes (set F's small arm has only about 20 held-out windows in all)
    max_s = max([cfg.probe_sequences] + [c.probe_sequences for _, _, c, _ in brows]
                + [probe_plan(c, K).sequences for _, _, c, _ in brows]) if probing else 0
    evals, tiles = {}, {}
    for n in names:
        evals[n], tiles[n] = eval_windows(sampler, n, a.eval_windows, range(1, max_s + 1))
    sizes = ", ".join(f"{n} ({read_arm_index(layout)[n].n_tokens:,} tokens)" for n in names)
    print(f"\n=== arm set {set_name}: {sizes}; "
          f"run created in {time.perf_counter() - t0:.1f} s")
    print(f"{a.steps} steps x {B} sequences x {cfg.model.block_size} tokens per bandit policy and seed; "
          f"seeds {' '.join(map(str, a.seeds))}; box floors {FLOOR}, caps {CAP} on every arm")
    if probing:
        print(f"probe of {', '.join(probing)} (probe_plan): {plan.sequences} windows x {K} arms every "
              f"{plan.every} steps = {plan.cost:.2%} of training FLOPs; charged: policies that do not "
              f"probe train {a.steps} + {extra} steps (the probes' {n_probes} x {K * plan.sequences} "
              f"window forwards / 3 per token), lr schedule over {a.steps + extra}")
    else:
        print("no row probes: every row trains the same steps (the default's signal is the training "
              "loss the update computes anyway; its bookkeeping time is measured below)")
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

    def run_fixed(label, p):
        t1 = time.perf_counter()
        runs, hit, reused = [], 0, 0
        for si, seed in enumerate(a.seeds if not label.startswith("fixed[")
                                  else a.seeds[:a.oracle_seeds or len(a.seeds)]):
            key = json.dumps(["v1", set_name, seed, a.steps + extra, base_cfg.lr_decay_steps,
                              sorted(p.items()), a.eval_windows, max_s, cfg.batch_size] + PRESET_KEY)
            same = res.get("default", {}).get("runs")
            if key not in cache and label == "stratified" and not extra and same \
                    and same[si]["lam_max"] == 0.0 and same[si]["pfinal"] == p:
                # the default never moved off stratified in this seed: it drew the same batches
                # from the same initialisation, so its run IS stratified's, bit for bit
                cache[key] = dict(same[si], reused_from="default")
                reused += 1
            if key not in cache and a.cached_only and label.startswith("fixed["):
                return   # an oracle cell not run on every oracle seed: left out of the report
            if key not in cache:
                cache[key] = train("fixed", seed, base_cfg, layout, a.steps + extra, evals, fixed=p)
                if a.cache:
                    a.cache.write_text(json.dumps(cache))  # after every run: a stopped bench keeps its work
            else:
                hit += 1
            runs.append(cache[key])
        res[label] = {"runs": runs, "t": time.perf_counter() - t1, "cached": hit - reused, "reused": reused}
        if a.cache and hit - reused < len(runs):
            a.cache.write_text(json.dumps(cache))  # after every row: a stopped run keeps its work
        print(f"  ... {set_name} {label}: {res[label]['t']:.0f} s", file=sys.stderr, flush=True)

    def run_bandit(label, kind, c, bf):
        t1 = time.perf_counter()
        runs, hit = [], 0
        for seed in a.seeds:
            key = json.dumps(["v1", set_name, seed, kind, a.steps, c.bandit_warmup, c.probe_every,
                              c.probe_sequences, c.probe_budget, sorted(bf.items()), a.eval_windows,
                              max_s, c.batch_size, POLICY_SOURCE] + PRESET_KEY)
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
                if a.cache:
                    a.cache.write_text(json.dumps(cache))
            else:
                hit += 1
            runs.append(cache[key])
        res[label] = {"runs": runs, "t": time.perf_counter() - t1, "cached": hit}
        if a.cache and hit < len(a.seeds):
            a.cache.write_text(json.dumps(cache))
        print(f"  ... {set_name} {label}: {res[label]['t']:.0f} s", file=sys.stderr, flush=True)
    # the default first: where it never leaves stratified its runs are stratified's (no retraining)
    for row in brows:
        if row[0] == "default":
            run_bandit(*row)
    for label, p in frows:
        run_fixed(label, p)
    for row in brows:
        if row[0] != "default":
            run_bandit(*row)
    frows = [(lab, p) for lab, p in frows if lab in res]
    res = {k: res[k] for k in [lab for lab, _ in frows] + [b[0] for b in brows]}
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
    unigram = {n: unigram_loss(sampler, n, evals[n], cfg.vocab_size) for n in names}
    judged = [n for n in names if n != TRAP and ref["arm"][n] < unigram[n]]  # what the targets judge
    print("learnable (stratified's held-out loss below the arm's unigram baseline): " + ", ".join(
        f"{n} {ref['arm'][n]:.4f} vs {unigram[n]:.4f} "
        f"{'the trap' if n == TRAP else 'yes' if n in judged else 'NO'}" for n in names))
    if not judged:
        raise SystemExit(f"set {set_name}: stratified beats no arm's unigram baseline in {a.steps} "
                         f"steps, so no arm counts as learnable; train longer (--steps)")
    for r in res.values():
        r["lmeans"] = [_mean([x["h"][n] for n in judged]) for x in r["runs"]]
        r["lmean"] = _mean(r["lmeans"])
    fixed_labels = [lab for lab, _ in frows[:2] if lab in ("static", "stratified")]
    grid_rows = [(lab, p) for lab, p in frows if lab.startswith("fixed[")]
    grid_labels = sorted((lab for lab, _ in grid_rows), key=lambda x: res[x]["lmean"])
    best = grid_labels[0] if grid_labels else None
    labels = fixed_labels + ([best] if best else []) + [lab for lab, _, _, _ in brows]
    print_table(res, labels, ref, names, judged, a)
    if set(judged) != set(names):
        print(f"mean over the learnable arms ({', '.join(judged)}; {', '.join(sorted(set(names) - set(judged)))} "
              f"left out: not below its unigram baseline / the trap) is what the targets judge; the mean over "
              f"every arm is the table's 'mean held-out'")
    sm = None
    n_coef = 1 + (len(names) - 1) + (len(names) - 1) * len(names) // 2   # the quadratic's coefficients
    if grid_labels and len(grid_labels) < n_coef:
        print(f"\noracle: {len(grid_labels)} cells (with stratified) cannot fit the {n_coef} coefficients of "
              f"the quadratic surface: no smoothed oracle, so 'mixing matters' is not decided here")
    elif grid_labels and len(res[grid_labels[0]]["runs"]) > 2:
        sm = smoothed_oracle(res, grid_rows, names, judged, a.seeds[:len(res[grid_labels[0]]["runs"])])
        print(f"\noracle ({len(grid_labels)} fixed mixtures, {a.oracle_design}, seeds "
              f"{' '.join(map(str, a.seeds[:len(res[best]['runs'])]))}), best cell {best}: "
              f"{-paired_stats(res[best]['lmeans'], ref['lmeans'])['mean']:+.4f} below stratified (learnable mean, "
              f"paired over those seeds); noise alone "
              f"would give the best of {len(grid_labels)} cells about {sm['null_max']:.4f}")
        print(f"smoothed oracle (quadratic surfaces + seed offsets, residual sd {sm['resid_sd']:.4f}): "
              f"unconstrained gain {sm['gain']:.4f} at {mix_label(sm['mix'], names, 2)[5:]}; within the "
              f"limits (every learnable arm <= +{WORST_LIMIT} vs stratified on its surface) "
              f"{sm['gain_lim']:.4f} +- {sm['gain_lim_se']:.4f} (bootstrap over seeds) at "
              f"{mix_label(sm['mix_lim'], names, 2)[5:]}: "
              f"{sm['gain_lim'] / sm['gain_lim_se'] if sm['gain_lim_se'] > 0 else float('inf'):.1f} "
              f"standard errors -> {'MIXING MATTERS' if sm['matters'] else 'mixing does not matter measurably'} here")
    out = {}
    for lab, _kind, _, _ in brows:
        r = res[lab]
        st = paired_stats(r["lmeans"], ref["lmeans"])
        per_arm = {n: _mean([x["h"][n] - y["h"][n] for x, y in zip(r["runs"], ref["runs"])]) for n in judged}
        pol = [x.get("policy_s", 0.0) for x in r["runs"]]
        tot = [x.get("train_s", 0.0) for x in r["runs"]]
        s = {"set": set_name, "policy": lab, "n_seeds": st["n"], "delta_mean": round(st["mean"], 5),
             "sd": round(st["sd"], 5), "se": round(st["se"], 5), "ci95_low": round(st["lo"], 5),
             "ci95_high": round(st["hi"], 5), "t": round(st["t"], 2) if math.isfinite(st["t"]) else st["t"],
             "delta_mean_all_arms": round(_paired(r["means"], ref["means"])[0], 5),
             "worst_delta": round(max(per_arm.values()), 5), "worst_arm": max(per_arm, key=per_arm.get),
             "box_ok": r["ok"], "captured": None,
             "policy_time_share": round(sum(pol) / sum(tot), 5) if sum(tot) > 0 else None,
             "lambda_final": round(_mean([x.get("lam_final", 0.0) for x in r["runs"]]), 3),
             "lambda_first_step": [x.get("lam_first") for x in r["runs"]],
             "p_final": {n: round(r["pfinal"][n], 3) for n in names},
             "role": SET_ROLE.get(set_name, "alike")}
        if sm:
            s |= {"oracle_gain_in_limits": round(sm["gain_lim"], 5), "oracle_gain_se": round(sm["gain_lim_se"], 5),
                  "oracle_gain_unconstrained": round(sm["gain"], 5), "mixing_matters": sm["matters"],
                  "captured": (round((ref["lmean"] - r["lmean"]) / sm["gain_lim"], 3)
                               if sm["gain_lim"] > 0 else None)}
            s["role"] = "matters" if sm["matters"] else "alike"
        if TRAP in names:
            s |= {"trap_p_start": round(r["pstart_all"][TRAP], 4),
                  "trap_p_max_after_warmup": round(r["pmax_all"][TRAP], 4),
                  "trap_raised": r["pmax_all"][TRAP] > r["pstart_all"][TRAP] + 1e-9}
        if "repeated" in r["runs"][0]:
            s["repeated_at"] = {n: [x["repeated"].get(n) for x in r["runs"]] for n in names
                                if any(n in x["repeated"] for x in r["runs"])}
        print(f"{lab} vs stratified (learnable mean): {s['delta_mean']:+.5f}, 95% CI [{s['ci95_low']:+.5f}, "
              f"{s['ci95_high']:+.5f}], n {s['n_seeds']}, paired sd {s['sd']:.5f}, t {s['t']}; worst arm "
              f"{s['worst_arm']} {s['worst_delta']:+.5f}; captured {s['captured']}; in box {s['box_ok']}; "
              f"lambda at the end {s['lambda_final']}; policy bookkeeping {s['policy_time_share']:.3%} of the "
              f"run's wall time" if s["policy_time_share"] is not None else "")
        if TRAP in names:
            print(f"  {TRAP}: p {s['trap_p_start']:.3f} after the warm-up, at most "
                  f"{s['trap_p_max_after_warmup']:.3f} later (raised: {s['trap_raised']})")
        out[lab] = s
    return out


SET_ROLE = {"A": "alike", "B": "alike", "C": "alike", "trap": "trap", "D": "candidate", "F": "candidate",
            "G": "candidate", "H": "candidate", "I": "candidate"}
MATERIAL_GAIN = 0.005  # an oracle gain below this (nats) does not make a "mixing matters" set
NI_MARGIN = 0.001   # non-inferiority margin, nats of mean held-out loss (docs/bandit.md#targets)


def paired_stats(xs, ys) -> dict:
    """Paired differences xs - ys over seeds: n, mean, sd, se, t, the two-sided 95 % interval
    (Student t, n - 1 df). With zero spread (identical runs) the interval is the mean itself."""
    d = [x - y for x, y in zip(xs, ys)]
    n = len(d)
    m = _mean(d)
    sd = statistics.stdev(d) if n > 1 else float("nan")
    se = sd / math.sqrt(n) if n > 1 else float("nan")
    if n > 1 and se > 0:
        q = t_quantile(0.975, n - 1)
        t = m / se
    else:
        q, t = 0.0, (0.0 if m == 0 else math.copysign(math.inf, m))
    half = 0.0 if math.isnan(se) else q * se
    return {"n": n, "mean": m, "sd": sd, "se": se, "t": t, "lo": m - half, "hi": m + half}


def holm(pvals: dict) -> dict:
    """Holm's step-down adjusted p-values {key: p_adj} (Holm 1979): sort ascending, p_(i) times
    (m - i), running maximum, at most 1."""
    keys = sorted(pvals, key=pvals.get)
    m, out, run = len(keys), {}, 0.0
    for i, k in enumerate(keys):
        run = max(run, min(1.0, (m - i) * pvals[k]))
        out[k] = run
    return out


def apply_targets(results: list[dict], t_limit: float = T_LIMIT) -> None:
    """The targets of docs/bandit.md#targets, with Holm's correction over the sets, written into
    each RESULT dict ("p_one_sided", "p_holm", "target_met", "target_misses").

    alike (A, B, C) and trap: non-inferiority, H0 delta >= NI_MARGIN, one-sided p of
    (delta - margin) / se; met when ci95_high <= NI_MARGIN and the Holm-adjusted p <= 0.025.
    matters (sets whose smoothed oracle gain within the limits is >= 3 standard errors):
    superiority, one-sided p of t; met when t <= t_limit AND the Holm-adjusted p is at most the
    one-sided p that t = t_limit itself has (the correction can only make it harder), captured
    >= CAPTURE_LIMIT of the oracle's gain within limits and no learnable arm worse than
    stratified by more than WORST_LIMIT. trap also: the trap arm's p never above its value at
    the end of the warm-up. Every set: every posted p inside its box."""
    ps = {}
    for i, s in enumerate(results):
        n, se = s["n_seeds"], s["se"]
        if s["role"] == "matters":
            p = t_cdf(s["t"], n - 1) if n > 1 and not math.isnan(se) else 1.0
        else:
            if n > 1 and se > 0:
                p = t_cdf((s["delta_mean"] - NI_MARGIN) / se, n - 1)
            else:
                p = 0.0 if s["delta_mean"] < NI_MARGIN else 1.0
        s["p_one_sided"] = p
        ps[i] = p
    adj = holm(ps)
    for i, s in enumerate(results):
        s["p_holm"] = adj[i]
        miss = []
        if not s["box_ok"]:
            miss.append("a posted p left its box")
        n = s["n_seeds"]
        if s["role"] == "matters":
            p_lim = t_cdf(t_limit, n - 1) if n > 1 else 0.0
            if not (s["t"] <= t_limit):
                miss.append(f"t {s['t']} > {t_limit}")
            if not adj[i] <= p_lim:
                miss.append(f"Holm-adjusted p {adj[i]:.2g} > {p_lim:.2g} (the p of t = {t_limit})")
            if s["captured"] is None or s["captured"] < CAPTURE_LIMIT:
                miss.append(f"captured {s['captured']} < {CAPTURE_LIMIT}")
            if not s["worst_delta"] <= WORST_LIMIT:
                miss.append(f"learnable arm {s['worst_arm']} {s['worst_delta']:+.4f} > +{WORST_LIMIT}")
        else:
            if not s["ci95_high"] <= NI_MARGIN:
                miss.append(f"ci95_high {s['ci95_high']:+.5f} > +{NI_MARGIN}")
            if not adj[i] <= 0.025:
                miss.append(f"Holm-adjusted non-inferiority p {adj[i]:.2g} > 0.025")
            if s["role"] == "trap" and s.get("trap_raised"):
                miss.append("the trap arm's p rose above its end-of-warm-up value")
        s["target_met"] = not miss
        s["target_misses"] = miss


def _finite(x):
    """`x` with every non-finite float (NaN, inf from one seed or no spread) as None: strict
    JSON for the RESULT line."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


MIN_SEEDS = 3   # fewer paired seeds (or no spread between them) cannot estimate the spread


def result_fields(s: dict) -> dict:
    """The RESULT line's common fields for one set (scripts/bench_stats.py): the figure is the
    default's mean held-out loss minus stratified's, nats, paired over seeds (lower is better),
    low/high its two-sided 95 % interval, the target NI_MARGIN (alike, trap: non-inferiority)
    or 0 (matters: superiority). `met` is the set's verdict against docs/bandit.md#targets
    ("target_met", with Holm's correction and the other limits) where the interval agrees with
    it, and null (cannot decide) where it does not, with fewer than MIN_SEEDS seeds, or when the
    seeds' differences have no spread (every seed the same, as when the default never left
    stratified: no evidence about other seeds)."""
    target = 0.0 if s["role"] == "matters" else NI_MARGIN
    se = s.get("se")
    spread = se is not None and not (isinstance(se, float) and math.isnan(se)) and se > 0
    met = None
    if s["n_seeds"] >= MIN_SEEDS and spread:
        by_interval = decide(s["ci95_low"], s["ci95_high"], target)
        met = s["target_met"] if by_interval == s["target_met"] else None
    return {"figure": f"mixture_{s['set']}_default_minus_stratified_nats",
            "ratio": s["delta_mean"], "low": s["ci95_low"], "high": s["ci95_high"],
            "target": target, "met": met, "rounds": s["n_seeds"]}


def mini_design(names) -> list[dict]:
    """The nine cells of `sparse_design` that the permutations of (0.6, 0.2, 0.2), (0.4, 0.4,
    0.2) and (0.1, 0.45, 0.45) give: with stratified, ten points for the six coefficients of
    the quadratic surface, at three fifths of the sparse design's cost."""
    keep = {tuple(sorted(c)) for c in ((0.6, 0.2, 0.2), (0.4, 0.4, 0.2), (0.1, 0.45, 0.45))}
    return [c for c in sparse_design(names) if tuple(sorted(c.values())) in keep]


def sparse_design(names) -> list[dict]:
    """A 15-cell design for the quadratic oracle surface of three arms in the box floors 0.1,
    caps 0.6: the six permutations of (0.6, 0.3, 0.1), and the three of each of (0.6, 0.2, 0.2),
    (0.4, 0.4, 0.2), (0.1, 0.45, 0.45); with stratified (the centre) enough for the six
    coefficients and their curvature at a fifth of the full grid's cost."""
    if len(names) != 3:
        raise ValueError("the sparse oracle design is for three arms; use --oracle-design grid")
    cells = set()
    for base in ((0.6, 0.3, 0.1), (0.6, 0.2, 0.2), (0.4, 0.4, 0.2), (0.1, 0.45, 0.45)):
        cells |= set(itertools.permutations(base))
    return [dict(zip(names, c)) for c in sorted(cells)]


def smoothed_oracle(res: dict, grid_rows: list, names, judged, seeds, boots: int = 200) -> dict:
    """The oracle without the winner's curse: least-squares quadratic surfaces in the mixture
    (features 1, p_i, p_i p_j over the first K-1 arms) with one offset per seed, fitted to every
    (cell, seed), one for the mean over the `judged` arms and one per judged arm, minimised over
    a 0.01 (K=3; 0.02 for K>3) lattice of the box: "gain" without constraint, "gain_lim" within
    the limits (every judged arm's surface at most WORST_LIMIT above its value at stratified).
    "gain_lim_se": the standard deviation of gain_lim over `boots` bootstrap resamples of the
    seeds (fixed generator, so reproducible); "matters": gain_lim >= 3 gain_lim_se and at least
    MATERIAL_GAIN (a gain pinned next to stratified has a bootstrap spread near 0, which alone
    would make a trivial gain "significant"). Also
    "resid_sd", "cell_se" (median standard error of a cell's paired difference to stratified)
    and "null_max" (what the best of that many cells gains from noise alone)."""
    K = len(names)

    def feats(p):
        x = [p[n] for n in names[:-1]]
        return [1.0] + x + [x[i] * x[j] for i in range(len(x)) for j in range(i, len(x))]
    mixes = [m for _, m in grid_rows] + [res["stratified"]["pfinal"]]
    labs = [lab for lab, _ in grid_rows] + ["stratified"]
    F = np.array([feats(m) for m in mixes])                     # (cells, nf)
    Y = {t: np.array([[(_mean([run["h"][n] for n in judged]) if t == "mean" else run["h"][t])
                       for run in res[lab]["runs"][:len(seeds)]] for lab in labs]) for t in ["mean"] + list(judged)}
    lattice = grid(names, 0.01 if K == 3 else 0.02)
    L = np.array([feats(m) for m in lattice])
    strat = np.array(feats({n: 1.0 / K for n in names}))
    nf = F.shape[1]

    def fit_all(cols):
        out = {}
        for t, y in Y.items():
            ys = y[:, cols]                                     # (cells, seeds)
            rows = [np.concatenate([F[c], np.eye(len(cols))[j]]) for c in range(len(labs)) for j in range(len(cols))]
            X = np.array(rows)
            X = np.concatenate([X[:, :nf], X[:, nf + 1:]], axis=1) if len(cols) > 1 else X[:, :nf]
            coef, *_ = np.linalg.lstsq(X, ys.reshape(-1), rcond=None)
            out[t] = (coef[:nf], float(np.std(ys.reshape(-1) - X @ coef)))
        surf = {t: L @ c for t, (c, _) in out.items()}
        at = {t: float(strat @ c) for t, (c, _) in out.items()}
        ok = np.ones(len(lattice), dtype=bool)
        for n in judged:
            ok &= surf[n] - at[n] <= WORST_LIMIT
        i_all = int(np.argmin(surf["mean"]))
        i_lim = int(np.argmin(np.where(ok, surf["mean"], np.inf))) if ok.any() else None
        g_lim = at["mean"] - float(surf["mean"][i_lim]) if i_lim is not None else 0.0
        return {"gain": at["mean"] - float(surf["mean"][i_all]), "mix": lattice[i_all],
                "gain_lim": max(0.0, g_lim), "mix_lim": lattice[i_lim] if i_lim is not None else
                {n: 1.0 / K for n in names}, "resid_sd": out["mean"][1]}
    n = len(seeds)
    base = fit_all(list(range(n)))
    rng = np.random.default_rng(0)
    bs = [fit_all(sorted(rng.integers(0, n, n).tolist()))["gain_lim"] for _ in range(boots)]
    se = float(np.std(bs, ddof=1))
    ses = [statistics.stdev(_paired(res[lab]["lmeans"], res["stratified"]["lmeans"])[2]) / math.sqrt(n)
           for lab, _ in grid_rows]
    cell_se = float(np.median(ses)) if ses else float("nan")
    m = len(grid_rows)  # E[max of m standard normals], by Blom's approximation
    emax = float(statistics.NormalDist().inv_cdf((m - 0.375) / (m + 0.25)))
    return base | {"gain_lim_se": se,
                   "matters": base["gain_lim"] >= 3 * se and base["gain_lim"] >= MATERIAL_GAIN,
                   "cell_se": cell_se, "null_max": cell_se * emax}


def print_table(res: dict, labels: list, ref: dict, names, judged, a) -> None:
    """The main table (learnable mean: n, paired difference, sd, 95 % interval, t) and the
    per-arm table of one set."""
    wl = max(11, max(map(len, labels)) + 1)
    print(f"\n{'policy':<{wl}} {'mean all':>9} {'learnable':>9} {'n':>3} {'- strat':>9} {'sd':>8} "
          f"{'95% CI':>21} {'t':>6}  in box  time")
    for label in labels:
        r = res[label]
        if r is ref:
            cols = f"{len(r['lmeans']):3d} {'reference':>9}"
        else:
            st = paired_stats(r["lmeans"], ref["lmeans"])
            cols = (f"{st['n']:3d} {st['mean']:+9.5f} {st['sd']:8.5f} [{st['lo']:+.5f}, {st['hi']:+.5f}] "
                    f"{st['t']:+6.1f}")
        print(f"{label:<{wl}} {r['mean']:9.4f} {r['lmean']:9.4f} {cols}  {str(r['ok']):<6} {r['t']:4.0f} s"
              + (f" ({r['cached']} cached)" if r["cached"] else "")
              + (f" ({r['reused']} = the default's runs, which never left stratified)" if r.get("reused") else ""))
    short = {n: n.replace("repo-", "") for n in names}
    print("\nper arm: held-out loss (seed mean) | mixture p, time-averaged -> final (seed mean)")
    print(f"{'policy':<{wl}} " + " ".join(f"{short[n]:>13}" for n in names) + "  | "
          + "  ".join(f"{short[n]:>14}" for n in names))
    for label in labels:
        r = res[label]
        print(f"{label:<{wl}} " + " ".join(f"{r['arm'][n]:13.4f}" for n in names) + "  | "
              + "  ".join(f"{r['pmean'][n]:6.3f} -> {r['pfinal'][n]:.3f}" for n in names))


QUICK = {"sets": ["A", "D", "F", "trap"], "steps": 150, "seeds": [1, 2], "no_oracle": True,
         "bandit_warmup": 30, "probe_every": 10}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", nargs="+", choices=("A", "B", "C", "D", "F", "G", "H", "I", "trap"), default=["A", "B"],
                    help="arm sets (A: the embedded defaults; B: C headers, test files, prose; C: charmap "
                         "tables, C headers, reference prose; D: two real arms and base64 noise; F: two "
                         "large arms and a small one that repeats; G: two real arms and pydoc's topics with the "
                         "words of each line shuffled; H: two real arms and generated-file boilerplate; I: two "
                         "real arms and pydoc's topics with the characters of each line shuffled; trap: A "
                         "plus the repetitive arm)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run (sets A D F trap, 150 steps, seeds 1 2, no oracle): the pipeline "
                         "and the RESULT lines, not evidence; a few minutes")
    ap.add_argument("--cached-only", action="store_true",
                    help="report from the cache: oracle cells missing a seed there are left out "
                         "instead of trained (the other rows are trained as usual when missing)")
    ap.add_argument("--oracle-sets", nargs="+", default=None, metavar="SET",
                    help="run the oracle on these sets only (default: every set but the trap)")
    ap.add_argument("--oracle-seeds", type=int, default=0, metavar="N",
                    help="run the oracle's cells on the first N seeds only (default: all)")
    ap.add_argument("--oracle-design", choices=("grid", "sparse", "mini"), default="grid",
                    help="oracle cells: the full grid (--grid-step), the 15-cell sparse design or "
                         "its 9-cell subset")
    ap.add_argument("--policy-source", default=None, metavar="HASH",
                    help="key the cached bandit rows by this policy-source hash instead of the "
                         "current files' (to report runs of an earlier commit whose policy code is "
                         "unchanged; say so when you do)")
    ap.add_argument("--trap", action="store_true",
                    help="also run the collapse trap: set A plus a repetitive list-like arm")
    ap.add_argument("--steps", type=int, default=600,
                    help="training steps of every row (default 600; docs/bandit.md#how-we-show-it-works)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--preset", choices=("andrea-test", "andrea-tiny"), default="andrea-test",
                    help="model of every row (default andrea-test: 43K parameters, block 32; andrea-tiny: "
                         "3 layers, 128 wide, block 128)")
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
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=["stratified", "default"],
                    help="policies to run (stratified always runs: it is the reference)")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="extra row: the default policy with other knobs, NAME:KEY=VALUE,... with KEY "
                         "warmup, probe_every, probe_sequences or a BanditConfig field (repeatable)")
    a = ap.parse_args()
    global POLICY_SOURCE, PRESET_KEY
    if a.policy_source:
        POLICY_SOURCE = a.policy_source
    PRESET_KEY = [] if a.preset == "andrea-test" else [a.preset]  # old keys stay valid
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
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
            results += list(out.values())
    print(f"\nall posted p inside the box: {all(s['box_ok'] for s in results)}; "
          f"total wall time {time.perf_counter() - t_all:.0f} s")
    default = [s for s in results if s["policy"] == "default"]
    apply_targets(default)
    print(f"targets (docs/bandit.md#targets), Holm's correction over the {len(default)} sets:")
    for s in default:
        print(f"  {s['set']} ({s['role']}): delta {s['delta_mean']:+.5f} [{s['ci95_low']:+.5f}, "
              f"{s['ci95_high']:+.5f}], t {s['t']}, p one-sided {s['p_one_sided']:.2g}, Holm {s['p_holm']:.2g}: "
              + ("met" if s["target_met"] else "missed: " + "; ".join(s["target_misses"])))
    keys = ("set", "n_seeds", "delta_mean", "ci95_high", "t", "captured", "worst_delta", "box_ok", "target_met")
    for s in default:
        fields = result_fields(s)
        if fields["met"] is None and s["target_met"]:
            # the set's rules passed on evidence that cannot decide (too few seeds, no
            # spread, or its interval disagreeing): not a verdict
            s["target_met"] = None
            print(f"  {s['set']}: its rules passed, but the line cannot decide "
                  f"({s['n_seeds']} seeds, s.e. {s['se']}): target_met null")
        add_result("RESULT " + json.dumps(_finite(fields | {k: s[k] for k in keys}
                                                  | {k: v for k, v in s.items() if k not in keys})))


if __name__ == "__main__":
    main()
