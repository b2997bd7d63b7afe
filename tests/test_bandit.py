"""Tests for proxy/mixture/bandit.py: projection, config errors, rewards, determinism, pivots, retirement."""
import dataclasses
import json
import math
import random
from statistics import NormalDist

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from proxy.mixture.bandit import (
    Bandit,
    BanditConfig,
    BanditConfigError,
    QuantileScaler,
    parse_arm_values,
    project_to_box,
    resolve_bounds,
)
from proxy.mixture.controller import MixtureController
from proxy.run_files.phases import Phase

ARMS = ["python-docs", "repo-code", "repo-docstrings"]


def kl(p, q):
    return sum(p[a] * math.log(p[a] / q[a]) for a in p if p[a] > 0)


# ----------------------------------------------------------------------------- projection

def test_worked_example_from_bandit_md():
    names = ["a", "b", "c", "d"]
    q = dict(zip(names, [.90, .05, .03, .02]))
    floors = dict(zip(names, [.05, .05, .10, .05]))
    caps = dict(zip(names, [.5, .6, .6, .6]))
    p = project_to_box(q, floors, caps)
    assert [p[n] for n in names] == pytest.approx([.50, .25, .15, .10], abs=1e-12)
    assert math.fsum(p.values()) == pytest.approx(1.0, abs=1e-12)


def test_projection_inside_box_is_identity():
    q = {"a": .2, "b": .3, "c": .5}
    p = project_to_box(q, {"a": .1}, {"c": .6})
    assert p == pytest.approx(q, abs=1e-15)


def test_zero_weights_stay_at_floor_unless_caps_force_them_up():
    p = project_to_box({"a": 1.0, "b": 0.0, "c": 0.0}, {"b": .1}, {})
    assert p == pytest.approx({"a": .9, "b": .1, "c": 0.0})
    p = project_to_box({"a": 1.0, "b": 0.0, "c": 0.0}, {"b": .1}, {"a": .5})
    assert p == pytest.approx({"a": .5, "b": .25, "c": .25})
    p = project_to_box({"a": 0.0, "b": 0.0}, {}, {"a": .3})
    assert p == pytest.approx({"a": .3, "b": .7})


@st.composite
def boxes(draw):
    k = draw(st.integers(1, 8))
    names = [f"arm{i}" for i in range(k)]
    unit = st.floats(0.0, 1.0, allow_nan=False)
    lo = [draw(unit) for _ in names]
    scale = draw(st.floats(0.0, 1.0))
    s = sum(lo)
    floors = [x * scale / s if s > 1 else x * scale for x in lo]
    caps = [f + (1 - f) * draw(unit) for f in floors]
    if sum(caps) < 1:
        t = (1 - sum(caps)) / max(1e-300, sum(1 - c for c in caps))
        caps = [min(1.0, c + t * (1 - c)) for c in caps]
    caps = [max(c, f) for c, f in zip(caps, floors)]
    assume(sum(floors) <= 1 + 1e-9 and sum(caps) >= 1 - 1e-9)
    weight = st.one_of(st.just(0.0), st.floats(1e-12, 1.0), st.floats(0.0, 1e3),
                       st.floats(0.0, 1e300, allow_subnormal=True))
    q = [draw(weight) for _ in names]
    return dict(zip(names, q)), dict(zip(names, floors)), dict(zip(names, caps))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(boxes())
def test_projection_always_inside_box_and_sums_to_one(box):
    q, floors, caps = box
    p = project_to_box(q, floors, caps)
    assert sorted(p) == sorted(q)
    for a in p:
        assert floors[a] <= p[a] <= caps[a]
    assert abs(math.fsum(p.values()) - 1.0) <= 1e-9


def test_projection_is_the_kl_minimiser_against_feasible_perturbations():
    rng = random.Random(1234)
    checked = 0
    for _ in range(200):
        k = rng.randint(2, 6)
        names = [f"a{i}" for i in range(k)]
        qv = [rng.random() ** 3 + 1e-6 for _ in names]
        s = sum(qv)
        q = {n: v / s for n, v in zip(names, qv)}
        floors = {n: rng.uniform(0, 0.8 / k) for n in names}
        caps = {n: max(floors[n], rng.uniform(1.2 / k, 1.0)) for n in names}
        p = project_to_box(q, floors, caps)
        base = kl(p, q)
        for _ in range(20):
            d = [rng.gauss(0, 1) for _ in names]
            mean = sum(d) / k
            d = {n: x - mean for n, x in zip(names, d)}
            # largest step that keeps p + t d inside the box
            t = min([(caps[n] - p[n]) / d[n] for n in names if d[n] > 0]
                    + [(floors[n] - p[n]) / d[n] for n in names if d[n] < 0])
            if t <= 1e-9:
                continue
            for frac in (0.1, 0.5, 1.0):
                pp = {n: p[n] + frac * t * d[n] for n in names}
                if all(floors[n] - 1e-12 <= pp[n] <= caps[n] + 1e-12 for n in names):
                    assert kl(pp, q) >= base - 1e-12
                    checked += 1
    assert checked > 500


def test_projection_refuses_negative_or_nan_weights():
    with pytest.raises(ValueError):
        project_to_box({"a": -1.0, "b": 1.0}, {}, {})
    with pytest.raises(ValueError):
        project_to_box({"a": math.nan, "b": 1.0}, {}, {})


# ----------------------------------------------------------------------------- config errors

def test_parse_arm_values_reads_operator_text():
    assert parse_arm_values("repo-code=0.5, python-docs=0.2", ARMS, "--caps") == {
        "repo-code": 0.5, "python-docs": 0.2}
    assert parse_arm_values("", ARMS, "--caps") == {}
    assert parse_arm_values("   ", ARMS, "--caps") == {}


def test_parse_unknown_arm_lists_known_ones():
    with pytest.raises(BanditConfigError, match=r"unknown arm 'repo-tests'.*python-docs, repo-code, repo-docstrings"):
        parse_arm_values("repo-tests=0.1", ARMS, "--floors")


@pytest.mark.parametrize("text,pattern", [
    ("repo-code=abc", "not a number"),
    ("repo-code=nan", "NaN"),
    ("repo-code=1.5", r"outside \[0, 1\]"),
    ("repo-code=-0.1", r"outside \[0, 1\]"),
    ("repo-code=inf", r"outside \[0, 1\]"),
    ("repo-code=0.1,repo-code=0.2", "given twice"),
    ("repo-code", "not ARM=VALUE"),
])
def test_parse_refuses_bad_values_naming_arm_and_rule(text, pattern):
    with pytest.raises(BanditConfigError, match=pattern) as e:
        parse_arm_values(text, ARMS, "--caps")
    assert "--caps" in str(e.value)


def test_resolve_bounds_defaults_and_order():
    caps, floors = resolve_bounds(ARMS, {"repo-code": 0.5}, {"python-docs": 0.1})
    assert caps == {"python-docs": 1.0, "repo-code": 0.5, "repo-docstrings": 1.0}
    assert floors == {"python-docs": 0.1, "repo-code": 0.0, "repo-docstrings": 0.0}


def test_resolve_bounds_refuses_unknown_arm():
    with pytest.raises(BanditConfigError, match="unknown arm 'nope'"):
        resolve_bounds(ARMS, {"nope": 0.5}, {})


def test_resolve_bounds_refuses_floor_above_cap_naming_arm():
    with pytest.raises(BanditConfigError, match=r"repo-code \(floor 0.4 > cap 0.3\)"):
        resolve_bounds(ARMS, {"repo-code": 0.3}, {"repo-code": 0.4})


def test_resolve_bounds_refuses_floors_summing_above_one():
    with pytest.raises(BanditConfigError, match=r"sum of floors = 1.2 > 1"):
        resolve_bounds(ARMS, {}, {"repo-code": 0.6, "python-docs": 0.6})


def test_resolve_bounds_refuses_caps_summing_below_one():
    with pytest.raises(BanditConfigError, match=r"sum of caps = 0.9 < 1"):
        resolve_bounds(ARMS, {a: 0.3 for a in ARMS}, {})


def test_resolve_bounds_refuses_values_outside_unit_interval():
    with pytest.raises(BanditConfigError, match="not a probability"):
        resolve_bounds(ARMS, {"repo-code": 1.5}, {})
    with pytest.raises(BanditConfigError, match="not a probability"):
        resolve_bounds(ARMS, {}, {"repo-code": math.nan})


def test_resolve_bounds_accepts_exact_sums_with_slack():
    caps, floors = resolve_bounds(["a", "b", "c"], {"a": 0.1, "b": 0.2, "c": 0.7}, {"a": 0.1, "b": 0.2, "c": 0.7})
    assert caps == floors


def test_bad_config_values_are_refused():
    with pytest.raises(BanditConfigError, match="reward"):
        BanditConfig(reward="ucb")
    with pytest.raises(BanditConfigError, match="share"):
        BanditConfig(share=1.0)
    with pytest.raises(BanditConfigError, match="discount"):
        BanditConfig(discount=0.0)
    with pytest.raises(BanditConfigError, match="eta"):
        BanditConfig(eta=math.nan)
    with pytest.raises(BanditConfigError, match="lambda_rule.*'ratio', 'max_bound' or 'gate'"):
        BanditConfig(lambda_rule="ucb")


# ----------------------------------------------------------------------------- scaler

def test_quantile_scaler_maps_to_unit_interval():
    s = QuantileScaler()
    assert s.scale(3.0) == 0.0
    s.add(1.0)
    assert (s.scale(0.5), s.scale(1.0), s.scale(2.0)) == (-1.0, 0.0, 1.0)
    for v in range(101):
        s.add(float(v))
    q20, q80 = s.quantile(0.2), s.quantile(0.8)
    assert s.scale(q20 - 1) == -1.0 and s.scale(q80 + 1) == 1.0
    assert s.scale((q20 + q80) / 2) == pytest.approx(0.0)


def test_quantile_scaler_keeps_last_thousand_and_round_trips():
    s = QuantileScaler()
    for v in range(2500):
        s.add(float(v % 997) * 0.5)
    assert len(s) == 1000
    t = QuantileScaler.from_dict(json.loads(json.dumps(s.to_dict())))
    assert t.to_dict() == s.to_dict()
    assert t.quantile(0.2) == s.quantile(0.2) and t.quantile(0.8) == s.quantile(0.8)


# ----------------------------------------------------------------------------- records

def synthetic_records(n_steps, arms=ARMS, batch=16, probe_every=25, seed=0, drops=None,
                      phase_index=0, start=0):
    """Per-step records; probe loss of arm a falls by drops[a] per probe (plus noise)."""
    rng = random.Random(seed)
    drops = drops or {a: 0.01 for a in arms}
    probe = {a: 4.0 for a in arms}
    out = []
    for step in range(start + 1, start + n_steps + 1):
        p = {a: 1.0 / len(arms) for a in arms}
        counts = {a: 0 for a in arms}
        for _ in range(batch):
            counts[rng.choice(arms)] += 1
        rec = {"step": step, "phase_index": phase_index, "arms": counts, "p": p,
               "arm_loss": {a: 3.0 + rng.random() for a in arms if counts[a]},
               "probe": None, "batch_size": batch}
        if step % probe_every == 0:
            for a in arms:
                probe[a] -= drops[a] + rng.gauss(0, 0.002)
            rec["probe"] = dict(probe)
        out.append(rec)
    return out


def make(config=None, floors=None, caps=None, **kw):
    return Bandit(ARMS, floors or {}, caps or {}, config or BanditConfig(reward="heldout_progress"), **kw)


def replay(arms, floors, caps, config, records, phase_index, label, start, upto_step=None):
    """A Bandit of one phase with `records` folded in order (Bandit.observe, as the mixture
    controller does), those past `upto_step` skipped."""
    b = Bandit(arms, floors, caps, config, phase_label=label, phase_index=phase_index,
               phase_start_step=start)
    for r in records:
        if upto_step is None or r["step"] <= upto_step:
            b.observe(r)
    return b


def as_loss_record(r):
    """A synthetic bandit record as the `.loss.json` record the mixture controller folds."""
    return {"step": r["step"], "phase": {"index": r["phase_index"], "label": "?"},
            "arms": r["arms"], "p": r["p"], "arm_loss": r["arm_loss"], "probe": r["probe"]}


@pytest.mark.parametrize("reward", ["train_slope", "heldout_progress", "train_loss"])
def test_replay_of_two_thousand_records_is_deterministic_and_round_trips(reward):
    cfg = BanditConfig(reward=reward)
    recs = synthetic_records(2000, drops={"python-docs": 0.01, "repo-code": 0.03, "repo-docstrings": 0.0})
    floors, caps = {"python-docs": 0.1, "repo-code": 0.1, "repo-docstrings": 0.05}, {"repo-code": 0.6}
    a = replay(ARMS, floors, caps, cfg, recs, 0, "initial", 0)
    b = replay(ARMS, floors, caps, cfg, json.loads(json.dumps(recs)), 0, "initial", 0)
    da = a.to_dict()
    assert da == b.to_dict()
    assert da["step"] == 2000 and da["phase"]["updates"] > 0
    text = json.dumps(da, allow_nan=False)
    back = Bandit.from_dict(json.loads(text))
    assert back.to_dict() == da
    # the restored bandit continues exactly like the original
    more = synthetic_records(300, seed=7, start=2000)
    for r in more:
        assert a.observe(r) == back.observe(r)
    assert a.to_dict() == back.to_dict()


def test_replay_upto_step_matches_prefix():
    recs = synthetic_records(600)
    full = replay(ARMS, {}, {}, BanditConfig(reward="heldout_progress"), recs, 0, "initial", 0, upto_step=400)
    prefix = replay(ARMS, {}, {}, BanditConfig(reward="heldout_progress"), recs[:400], 0, "initial", 0)
    assert full.to_dict() == prefix.to_dict()


def test_records_of_other_phases_and_old_steps_are_ignored():
    b = make()
    recs = synthetic_records(10)
    for r in recs:
        b.observe(r)
    before = b.to_dict()
    assert b.observe(recs[3]) is False
    other = dict(synthetic_records(11)[-1], phase_index=1)
    assert b.observe(other) is False
    assert b.to_dict() == before


def test_repetitive_arm_whose_probe_drops_fastest_never_passes_cap_and_loses_once_easy():
    cfg = BanditConfig(reward="heldout_progress", easy_arm_ratio=0.8)
    caps = {"repo-docstrings": 0.5}
    floors = {a: 0.1 for a in ARMS}
    b = make(cfg, floors, caps)
    recs = synthetic_records(3000, drops={"python-docs": 0.005, "repo-code": 0.005, "repo-docstrings": 0.05})
    p0 = b.probabilities()
    changed_before_warmup, top = False, 0.0
    for r in recs:
        changed = b.observe(r)
        if r["step"] <= cfg.warmup_steps:
            changed_before_warmup |= changed
            assert b.probabilities() == p0
        p = b.probabilities()
        top = max(top, p["repo-docstrings"])
        for a in ARMS:
            assert floors[a] - 1e-12 <= p[a] <= caps.get(a, 1.0) + 1e-12
    assert not changed_before_warmup
    p = b.probabilities()
    # it gained while its loss was ordinary, up to its cap; once its probe loss fell below
    # easy_arm_ratio x the others' it is an easy arm and can only lose (docs/bandit.md#the-easy-arm-guard)
    assert top == pytest.approx(0.5)
    assert b.easy_arms() == ["repo-docstrings"]
    assert p["repo-docstrings"] < 0.5 - 0.1
    off = make(dataclasses.replace(cfg, easy_arm_ratio=0.0), floors, caps)
    for r in recs:
        off.observe(r)
    assert off.probabilities()["repo-docstrings"] == pytest.approx(0.5)   # the guard's negative control


def test_heldout_progress_ignores_train_loss():
    recs = synthetic_records(800)
    other = json.loads(json.dumps(recs))
    rng = random.Random(5)
    for r in other:
        r["arm_loss"] = {a: rng.uniform(0.01, 9.0) for a in ARMS}
    a = replay(ARMS, {}, {}, BanditConfig(reward="heldout_progress"), recs, 0, "x", 0)
    b = replay(ARMS, {}, {}, BanditConfig(reward="heldout_progress"), other, 0, "x", 0)
    assert a.to_dict() == b.to_dict()
    assert a.updates > 0


def test_first_probe_only_sets_baseline():
    cfg = BanditConfig(reward="heldout_progress", warmup_steps=0)
    b = make(cfg)
    rec = {"step": 1, "phase_index": 0, "arms": {"repo-code": 4}, "p": {}, "probe": {a: 3.0 for a in ARMS},
           "batch_size": 4}
    assert b.observe(rec) is False
    assert len(b.scaler) == 0 and b.last_probe["repo-code"] == 3.0
    rec2 = dict(rec, step=2, probe={a: 2.5 for a in ARMS})
    assert b.observe(rec2) is True
    assert len(b.scaler) == 3


def test_train_loss_divides_by_the_recorded_p():
    cfg = BanditConfig(reward="train_loss", warmup_steps=0, share=0.0, discount=1.0, eta=0.1)
    recorded_p = {"python-docs": 0.5, "repo-code": 0.25, "repo-docstrings": 0.25}
    counts = {"python-docs": 3, "repo-code": 1, "repo-docstrings": 0}
    losses = {"python-docs": 2.0, "repo-code": 4.0}
    rec = {"step": 1, "phase_index": 0, "arms": counts, "p": recorded_p, "arm_loss": losses,
           "probe": None, "batch_size": 4}
    b = make(cfg, prior={"python-docs": 0.2, "repo-code": 0.3, "repo-docstrings": 0.5})
    assert b.probabilities() != pytest.approx(recorded_p)
    start = dict(b.logw)
    assert b.observe(rec) is True
    ref = QuantileScaler()
    for a in ("python-docs", "repo-code"):
        ref.add(losses[a])
    g = {a: counts[a] * ref.scale(losses[a]) / (4 * recorded_p[a]) for a in losses}
    g["repo-docstrings"] = 0.0
    raw = {a: start[a] + 0.1 * g[a] for a in ARMS}
    top = max(raw.values())
    assert b.logw == pytest.approx({a: raw[a] - top for a in ARMS}, abs=1e-12)
    assert g["repo-code"] == pytest.approx(1.0) and g["python-docs"] == pytest.approx(-1.5)


def test_pulls_counted_every_record_including_warmup():
    b = make()
    recs = synthetic_records(50)
    for r in recs:
        b.observe(r)
    for a in ARMS:
        assert b.pulls[a] == sum(r["arms"][a] for r in recs) == b.pulls_lifetime[a]
    assert b.step == 50 and b.to_dict()["arms"]["repo-code"]["pulls"] == b.pulls["repo-code"]


def test_exp3s_share_keeps_every_log_weight_finite_from_zero_prior():
    cfg = BanditConfig(reward="heldout_progress", warmup_steps=0)
    b = make(cfg, prior={"repo-code": 1.0})
    assert b.logw["python-docs"] == -math.inf
    d = json.loads(json.dumps(b.to_dict(), allow_nan=False))
    assert Bandit.from_dict(d).to_dict() == d
    for r in synthetic_records(100):
        b.observe(r)
    assert all(math.isfinite(v) for v in b.logw.values())
    assert max(b.logw.values()) == 0.0


# ----------------------------------------------------------------------------- pivot and retire

def test_pivot_resets_pulls_and_ema_but_keeps_lifetime_pulls():
    """MixtureController.next_phase + a controller of that phase: what the proxy runs at a pivot
    and at every resume after it (proxy/supervision/resume_planning.py, proxy/mixture/rebuild.py)."""
    old = MixtureController(ARMS, Phase(0, "initial", 0, floors={a: 0.05 for a in ARMS}),
                            "heldout_progress", 200, 25)
    for r in synthetic_records(1000, drops={"python-docs": 0.0, "repo-code": 0.04, "repo-docstrings": 0.0}):
        old.observe(as_loss_record(r))
    b = old.bandit
    old_p = b.probabilities()
    new_floors, new_caps = {"python-docs": 0.3}, {"repo-code": 0.4}
    phase = old.next_phase("v3", new_caps, new_floors, 1000)
    assert (phase.index, phase.label, phase.start_step, phase.prior) == (1, "v3", 1000, old_p)
    assert phase.lifetime_pulls == b.pulls_lifetime
    phase = Phase(**json.loads(json.dumps(dataclasses.asdict(phase))))  # through phases.json
    nb = MixtureController(ARMS, phase, "heldout_progress", 200, 25).bandit
    d = nb.to_dict()
    assert d["phase"] == {"label": "v3", "index": 1, "started_at_step": 1000, "updates": 0, "steps": 0}
    assert d["version"] == 0 and d["step"] == 1000 and d["scaler"]["values"] == []
    for a in ARMS:
        assert d["arms"][a]["pulls"] == 0 and d["arms"][a]["ema_n"] == 0
        assert d["arms"][a]["ema_reward"] == 0.0 and d["arms"][a]["last_probe"] is None
        assert d["arms"][a]["pulls_lifetime"] == b.pulls_lifetime[a] > 0
    expected = project_to_box(old_p, {"python-docs": 0.3}, {"repo-code": 0.4})
    assert nb.probabilities() == pytest.approx(expected, abs=1e-12)
    # the new phase learns inside the new box and ignores old-phase records
    assert nb.observe(synthetic_records(1001)[-1]) is False
    recs = synthetic_records(1000, seed=3, phase_index=1, start=1000,
                             drops={"python-docs": 0.0, "repo-code": 0.05, "repo-docstrings": 0.0})
    for r in recs:
        nb.observe(r)
        p = nb.probabilities()
        assert p["python-docs"] >= 0.3 - 1e-12 and p["repo-code"] <= 0.4 + 1e-12
    assert nb.updates > 0
    rebuilt = MixtureController(ARMS, phase, "heldout_progress", 200, 25)
    for r in recs:
        rebuilt.observe(as_loss_record(r))
    assert rebuilt.bandit.to_dict() == nb.to_dict()


def test_retire_moves_arm_out_and_reprojects():
    b = make(floors={"python-docs": 0.2, "repo-docstrings": 0.3}, caps={"repo-code": 0.6})
    recs = synthetic_records(300)
    for r in recs:
        b.observe(r)
    v = b.version
    b.retire("repo-docstrings", "source changed (fingerprint mismatch)")
    assert b.arms == ["python-docs", "repo-code"]
    assert b.version == v + 1
    p = b.probabilities()
    assert set(p) == {"python-docs", "repo-code"}
    assert math.fsum(p.values()) == pytest.approx(1.0) and p["repo-code"] <= 0.6 + 1e-12
    d = b.to_dict()
    assert d["retired"]["repo-docstrings"]["reason"].startswith("source changed")
    assert d["retired"]["repo-docstrings"]["pulls"] > 0
    assert "repo-docstrings" not in d["arms"] and "repo-docstrings" not in d["floors"]
    # never pulled again: records still naming it add nothing
    for r in synthetic_records(100, seed=9, start=300):
        b.observe(r)
    assert "repo-docstrings" not in b.pulls
    assert Bandit.from_dict(json.loads(json.dumps(b.to_dict()))).to_dict() == b.to_dict()
    # the retired arm's lifetime pulls carry into the next phase
    mix = MixtureController(ARMS, Phase(0, "initial", 0), "heldout_progress", 200, 25)
    mix.bandit = b
    assert (mix.next_phase("v2", {}, {}, 400).lifetime_pulls["repo-docstrings"]
            == d["retired"]["repo-docstrings"]["pulls_lifetime"])


def test_retire_refuses_infeasible_remaining_bounds_and_unknown_arms():
    b = make(caps={"python-docs": 0.4, "repo-code": 0.4})
    before = b.to_dict()
    with pytest.raises(BanditConfigError, match="sum of caps"):
        b.retire("repo-docstrings", "gone")
    assert b.to_dict() == before
    with pytest.raises(BanditConfigError, match="unknown arm"):
        b.retire("nope", "gone")


def test_bandit_keyed_by_name_not_position():
    cfg = BanditConfig(reward="heldout_progress", warmup_steps=0)
    recs = synthetic_records(200)
    a = replay(ARMS, {}, {}, cfg, recs, 0, "x", 0)
    b = replay(list(reversed(ARMS)), {}, {}, cfg, recs, 0, "x", 0)
    assert a.to_dict() == b.to_dict()


def test_centred_progress_ignores_a_trend_common_to_every_arm():
    """heldout_progress with center_progress (default): adding the same amount to every arm's
    probe loss at a probe changes nothing -- not the weights, the scaler or the EMAs -- while
    the arms' differences still move the policy. Without centring the shared trend drives the
    percentile scaler and the state differs (the negative control)."""
    import random as _random
    rng = _random.Random(5)
    base = {"a": 3.0, "b": 3.2, "c": 3.4}
    rate = {"a": 0.004, "b": 0.002, "c": 0.001}            # a improves fastest
    recs, shifted = [], []
    for k in range(1, 201):
        rec = {"step": k, "phase_index": 0, "arms": {"a": 3, "b": 3, "c": 2}}
        if k % 5 == 0:
            probe = {x: base[x] - rate[x] * k + rng.random() * 1e-3 for x in base}
            trend = 2.0 / k                                  # fast at first, slower later
            recs.append(rec | {"probe": probe})
            shifted.append(rec | {"probe": {x: v + trend for x, v in probe.items()}})
        else:
            recs.append(rec)
            shifted.append(rec)
    for centre in (True, False):
        cfg = BanditConfig(reward="heldout_progress", warmup_steps=0, center_progress=centre)
        x, y = Bandit(["a", "b", "c"], None, None, cfg), Bandit(["a", "b", "c"], None, None, cfg)
        for r, s in zip(recs, shifted):
            x.observe(r)
            y.observe(s)
        same = all(abs(x.probabilities()[a] - y.probabilities()[a]) < 1e-9
                   and abs(x.ema_reward[a] - y.ema_reward[a]) < 1e-9 for a in base)
        if centre:                                          # equal up to float rounding
            assert same and x.updates > 30
            p = x.probabilities()
            assert p["a"] > p["b"] > p["c"], p
        else:
            assert not same


# ------------------------------------------------------ the mixture benchmark and the collapse trap

TRAP_ARMS = ARMS + ["list-trap"]


def trap_records(n_steps, batch=16, probe_every=10, seed=3, p=None, drops=None, noise=0.5):
    """Records where arm `list-trap` (repetitive, list-like text) has a training loss that falls
    fast (3.0 -> 0.2) while its held-out probe says nothing beyond the shared trend: it falls by
    less than the others' (the trivial gain is made in the first steps, then stops). `drops`
    {arm: probe fall per period} and `noise` (relative) override that."""
    rng = random.Random(seed)
    probe = {a: 4.0 for a in TRAP_ARMS}
    drops = drops or {"python-docs": 0.012, "repo-code": 0.010, "repo-docstrings": 0.008,
                      "list-trap": 0.004}
    p = p or {a: 0.25 for a in TRAP_ARMS}
    out = []
    for step in range(1, n_steps + 1):
        counts = {a: 0 for a in TRAP_ARMS}
        for _ in range(batch):
            counts[rng.choices(TRAP_ARMS, weights=[p[a] for a in TRAP_ARMS])[0]] += 1
        loss = {a: 3.0 + 0.3 * rng.random() for a in ARMS} | {"list-trap": 0.2 + 2.8 * math.exp(-step / 20)}
        rec = {"step": step, "phase_index": 0, "arms": counts, "p": dict(p),
               "arm_loss": {a: v for a, v in loss.items() if counts[a]}, "probe": None,
               "batch_size": batch}
        if step % probe_every == 0:
            for a in TRAP_ARMS:
                probe[a] -= drops[a] * (1 + noise * rng.gauss(0, 1))
            rec["probe"] = dict(probe)
        out.append(rec)
    return out


def test_collapse_trap_default_never_raises_the_repetitive_arm_after_warmup():
    """point 4, the synthetic case: when the repetitive arm's held-out progress says
    nothing beyond the trend, the default bandit (heldout_progress) never lifts its probability
    above where it stands when the warm-up ends, although its train loss falls fastest (the
    bench's real trap, whose held-out loss falls fastest too, is held by the repetition guard
    instead: docs/bandit.md#the-repetition-guard); the ODM baseline (train_loss) reacts to the
    train loss instead (here it lowers it: a raw-loss reward prefers hard arms, the trap's danger
    is to a loss-DECREASE reward)."""
    floors, caps = {a: 0.1 for a in TRAP_ARMS}, {a: 0.6 for a in TRAP_ARMS}
    cfg = BanditConfig(reward="heldout_progress", warmup_steps=50)
    b = Bandit(TRAP_ARMS, floors, caps, cfg)
    start, top = None, 0.0
    for r in trap_records(1500):
        b.observe(r)
        if r["step"] == cfg.warmup_steps:
            start = b.probabilities()["list-trap"]
        elif r["step"] > cfg.warmup_steps:
            top = max(top, b.probabilities()["list-trap"])
    assert b.updates > 100
    assert top <= start + 1e-12, (start, top)
    assert b.probabilities()["list-trap"] == pytest.approx(0.1)
    # the negative control: a reward on the arm's own train-loss DECREASE would favour it
    odm = Bandit(TRAP_ARMS, floors, caps, BanditConfig(reward="train_loss", warmup_steps=50))
    for r in trap_records(1500):
        odm.observe(r)
    assert odm.probabilities()["list-trap"] <= 0.25


def test_stated_speeds_of_adaptation():
    """docs/bandit.md#update, the stated speeds: with the defaults (eta 0.05, share 0.01,
    discount 0.999) a steady gap of 0.2 in scaled reward moves two arms' log-odds by about 0.2
    nat in 25 updates and 0.5 in 100, and the share bounds it near 0.6 (the original design's "about
    1 nat every 100 updates" does not hold). With eta 0.3 it is 0.55 nat in 10 updates, 1.2 in 25,
    bounded near 2.3; in the box floors 0.1 / caps 0.6 the favoured arm then reaches its cap
    within 25 updates and a reversed gap brings it back below uniform within 20."""
    arms = ["a0", "a1", "a2"]

    def odds(cfg, n):
        b = Bandit(arms, None, None, cfg)
        out = {}
        for t in range(1, n + 1):
            b._update({"a0": 0.1, "a1": -0.1, "a2": -0.1})
            out[t] = b.logw["a0"] - b.logw["a1"]
        return out
    slow = odds(BanditConfig(reward="heldout_progress", warmup_steps=0), 400)
    assert slow[25] == pytest.approx(0.205, abs=0.01) and slow[100] == pytest.approx(0.505, abs=0.01)
    assert 0.55 < slow[400] < 0.7
    fast = odds(BanditConfig(reward="heldout_progress", warmup_steps=0, eta=0.3), 200)
    assert fast[10] == pytest.approx(0.55, abs=0.02) and fast[25] == pytest.approx(1.23, abs=0.03)
    assert 2.2 < fast[200] < 2.4 and fast[200] - fast[100] < 0.05
    boxed = Bandit(arms, {a: 0.1 for a in arms}, {a: 0.6 for a in arms},
                   BanditConfig(reward="heldout_progress", warmup_steps=0, eta=0.3))
    for _ in range(25):
        boxed._update({"a0": 0.1, "a1": -0.1, "a2": -0.1})
    assert boxed.probabilities()["a0"] == pytest.approx(0.6, abs=1e-12)
    for _ in range(20):
        boxed._update({"a0": -0.1, "a1": 0.1, "a2": 0.1})
    assert boxed.probabilities()["a0"] < 1 / 3


def test_progress_per_p_divides_progress_by_the_mean_recorded_p():
    """progress_per_p: an arm drawn half as often that made the same progress scores twice the
    raw reward (its data moved its loss twice as far per sequence)."""
    cfg = BanditConfig(reward="heldout_progress", warmup_steps=0, progress_per_p=True, center_progress=False)
    b = Bandit(["a", "b"], None, None, cfg)
    p = {"a": 0.25, "b": 0.75}
    b.observe({"step": 1, "phase_index": 0, "arms": {"a": 1, "b": 3}, "p": p, "probe": {"a": 3.0, "b": 3.0}})
    b.observe({"step": 2, "phase_index": 0, "arms": {"a": 1, "b": 3}, "p": p})
    b.observe({"step": 3, "phase_index": 0, "arms": {"a": 1, "b": 3}, "p": p, "probe": {"a": 2.9, "b": 2.9}})
    assert sorted(b.scaler.to_dict()["values"]) == pytest.approx(sorted([0.1 / 0.25, 0.1 / 0.75]))
    assert b.probabilities()["a"] > 0.5
    plain = Bandit(["a", "b"], None, None,
                   BanditConfig(reward="heldout_progress", warmup_steps=0, center_progress=False))
    for r in ({"step": 1, "phase_index": 0, "arms": {}, "p": p, "probe": {"a": 3.0, "b": 3.0}},
              {"step": 3, "phase_index": 0, "arms": {}, "p": p, "probe": {"a": 2.9, "b": 2.9}}):
        plain.observe(r)
    assert plain.scaler.to_dict()["values"] == pytest.approx([0.1, 0.1])


@pytest.mark.parametrize("per_p", [False, True])
def test_state_round_trip_mid_probe_interval(per_p):
    """The p accumulated since the last probe is part of the state: a bandit restored between
    two probes continues exactly like the original (resume bit-exact)."""
    cfg = BanditConfig(reward="heldout_progress", progress_per_p=per_p, warmup_steps=20)
    recs = synthetic_records(437, probe_every=10, drops={"python-docs": 0.02, "repo-code": 0.01,
                                                         "repo-docstrings": 0.0})
    a = replay(ARMS, {}, {}, cfg, recs[:433], 0, "x", 0)
    back = Bandit.from_dict(json.loads(json.dumps(a.to_dict())))
    for r in recs[433:] + synthetic_records(100, probe_every=10, seed=4, start=437):
        a.observe(r)
        back.observe(r)
    assert a.to_dict() == back.to_dict()


def test_probe_plan_costs_at_most_the_budget_at_every_preset_and_batch():
    """shared/run/config.py probe_plan (docs/bandit.md#probe-cost): the probe's forward FLOPs stay
    within probe_budget of training FLOPs for every preset, batch and arm count; the plan is a
    pure function of the config; at batch 16 with probe_every 25 it is 6 windows (1.5 %). With
    the default reward (train_slope) no probe runs and it costs nothing."""
    from shared.run.config import PRESETS, RunConfig, probe_plan
    free = probe_plan(RunConfig(batch_size=16))
    assert not free.active and free.cost == 0.0
    for preset, shape in PRESETS.items():
        for batch in (1, 2, 3, 4, 8, 16, 64, 512):
            for k in (1, 2, 3, 4, 16):
                cfg = RunConfig(preset=preset, model=shape, batch_size=batch, reward="heldout_progress")
                pp = probe_plan(cfg, k)
                cost = k * pp.sequences * shape.block_size / (3 * pp.every * batch * shape.block_size)
                assert pp.cost == pytest.approx(cost)
                assert cost <= cfg.probe_budget + 1e-12, (preset, batch, k, pp)
                assert 1 <= pp.sequences <= cfg.probe_sequences and pp.every % cfg.probe_every == 0
                assert probe_plan(cfg, k) == pp
    cfg = RunConfig(batch_size=16, reward="heldout_progress")
    assert probe_plan(cfg) == probe_plan(cfg, 3) and probe_plan(cfg).sequences == 6
    assert probe_plan(cfg).every == 25
    small = RunConfig(batch_size=2, reward="heldout_progress")
    assert probe_plan(small).sequences == 1 and probe_plan(small).every == 50
    assert probe_plan(RunConfig(batch_size=1, reward="heldout_progress")).every == 75


def test_collapse_trap_whose_probe_falls_fastest_is_held_by_the_easy_arm_guard():
    """The bench's trap (scripts/bench_mixture.py --sets trap): the repetitive arm's held-out
    probe falls FASTEST and far below the others'. With eta 0.3 and no guard (easy_arm_ratio 0)
    the bandit raises it far; with the guard (0.8) it is never raised above its p after the
    warm-up (synthetic: here its level drops below 0.8 of the others' before the first update)."""
    floors, caps = {a: 0.1 for a in TRAP_ARMS}, {a: 0.6 for a in TRAP_ARMS}
    rng = random.Random(11)
    probe = {a: 5.5 for a in TRAP_ARMS}
    recs = []
    for step in range(1, 301):
        rec = {"step": step, "phase_index": 0, "arms": {a: 4 for a in TRAP_ARMS}, "p": {a: 0.25 for a in TRAP_ARMS}}
        if step % 10 == 0:
            for a in ARMS:
                probe[a] -= 2.0 / step + 0.003 * rng.random()
            probe["list-trap"] = 0.5 + 5.0 * math.exp(-step / 15) - 0.001 * step * rng.random()
            rec["probe"] = dict(probe)
        recs.append(rec)
    tops = {}
    for ratio in (0.8, 0.0):
        b = Bandit(TRAP_ARMS, floors, caps, BanditConfig(reward="heldout_progress", warmup_steps=10,
                                                         easy_arm_ratio=ratio, eta=0.3))
        start, top = None, 0.0
        for r in recs:
            b.observe(r)
            if r["step"] == 10:
                start = b.probabilities()["list-trap"]
            elif r["step"] > 10:
                top = max(top, b.probabilities()["list-trap"])
        tops[ratio] = (start, top)
    assert tops[0.8][1] <= tops[0.8][0] + 1e-12, tops
    assert tops[0.0][1] > tops[0.0][0] + 0.1, tops      # the trap is real without the guard


# ----------------------------------------------------------------------------- the repetition guard

# the real trap's case (docs/bandit.md#the-collapse-trap): its held-out probe falls fastest of all
TRAP_FASTEST = {"python-docs": 0.004, "repo-code": 0.004, "repo-docstrings": 0.004, "list-trap": 0.03}


def test_repetition_guard_holds_a_compressible_arm_at_its_post_warmup_share():
    """docs/bandit.md#the-repetition-guard: an arm whose compression ratio reaches
    repetitive_ratio never gets more probability than it had when the warm-up ended, even
    when its reward is the best every period; with the guard off the same records lift it to
    its cap (the negative control: the records do favour it). The hold survives JSON."""
    floors, caps = {a: 0.1 for a in TRAP_ARMS}, {a: 0.6 for a in TRAP_ARMS}
    ratios = {"python-docs": 2.6, "repo-code": 3.5, "repo-docstrings": 2.9, "list-trap": 183.0}
    for ratio, held in ((20.0, True), (0.0, False)):
        b = Bandit(TRAP_ARMS, floors, caps, BanditConfig(reward="heldout_progress", warmup_steps=50, eta=0.3,
                                                         repetitive_ratio=ratio), compression=ratios)
        start, top = None, 0.0
        for r in trap_records(600, seed=5, noise=0.3, drops=TRAP_FASTEST):
            b.observe(r)
            p = b.probabilities()
            assert all(floors[a] - 1e-12 <= p[a] <= caps[a] + 1e-12 for a in TRAP_ARMS)
            if r["step"] == 50:
                start = p["list-trap"]
            elif r["step"] > 50:
                top = max(top, p["list-trap"])
            if r["step"] == 300:
                again = Bandit.from_dict(json.loads(json.dumps(b.to_dict())))
                assert again.to_dict() == b.to_dict() and again.probabilities() == p
        assert b.updates > 40
        if held:
            assert b.held == {"list-trap": start} and b.repetitive_arms() == ["list-trap"]
            assert top <= start + 1e-12, (start, top)
        else:
            assert b.held == {} and top == pytest.approx(0.6), top


def test_repetition_guard_is_redecided_per_phase_and_released_when_a_retirement_needs_room():
    arms = ["a", "b", "c"]
    b = Bandit(arms, {"a": 0.0, "b": 0.0, "c": 0.0}, {"a": 1.0, "b": 0.45, "c": 1.0},
               BanditConfig(reward="heldout_progress", warmup_steps=0), compression={"a": 50.0, "b": 2.0, "c": 3.0})
    b.observe({"step": 1, "phase_index": 0, "arms": {"a": 1}, "p": {}, "probe": None})
    assert b.hold_decided and b.held == {"a": pytest.approx(1 / 3)}
    assert b.effective_caps() == {"a": pytest.approx(1 / 3), "b": 0.45, "c": 1.0}
    b.retire("c", "gone")  # a <= 1/3 and b <= 0.45 cannot hold a batch: the hold goes
    assert b.held == {} and b.probabilities()["a"] == pytest.approx(0.55)
    with pytest.raises(BanditConfigError, match="repetitive_ratio"):
        BanditConfig(repetitive_ratio=0.5)


def test_compression_ratio_separates_list_like_text_from_prose_and_code(tmp_path):
    """shared/data/redundancy.py on real text: the benchmark's trap arm compresses an order of
    magnitude better than this repository's prose and code, bytes- and BPE-tokenized alike."""
    from pathlib import Path

    import numpy as np

    from shared.data.redundancy import compression_ratio
    root = Path(__file__).resolve().parent.parent
    words = ["region", "value", "entry", "table", "field", "option"]
    trap = "".join(f"- item {i % 50}: " + " ".join([words[i % 6]] * 3) + "\n" for i in range(12000))
    prose = "\n".join(p.read_text() for p in sorted((root / "docs").glob("*.md")))
    code = "\n".join(p.read_text() for p in sorted((root / "proxy").rglob("*.py")))
    as_bytes = {k: np.frombuffer(v.encode(), dtype=np.uint8).astype(np.uint16)
                for k, v in (("trap", trap), ("prose", prose), ("code", code))}
    r = {k: compression_ratio(v) for k, v in as_bytes.items()}
    assert r["trap"] > 50 and r["prose"] < 6 and r["code"] < 6, r
    assert compression_ratio(as_bytes["code"]) == r["code"]  # deterministic
    assert compression_ratio(np.memmap(_write(tmp_path / "t.u16", as_bytes["trap"]),
                                       dtype=np.uint16, mode="r")) == r["trap"]
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([prose, code, trap], trainers.BpeTrainer(vocab_size=2000))
    bpe = {k: compression_ratio(np.array(tok.encode(v).ids, dtype=np.uint16))
           for k, v in (("trap", trap), ("prose", prose), ("code", code))}
    assert bpe["trap"] > 50 and bpe["prose"] < 6 and bpe["code"] < 6, bpe
    with pytest.raises(ValueError):
        compression_ratio(np.zeros(0, dtype=np.uint16))


def _write(path, arr):
    arr.tofile(path)
    return path


def test_default_audit_cadence_keeps_audits_within_their_budget_at_every_preset_and_batch():
    """shared/run/config.py default_sample_every / audit_cost (docs/bandit.md#probe-cost): with no
    --sample-every the audits cost at most AUDIT_BUDGET (0.5 %) of training FLOPs at every preset,
    batch and arm count, on a multiple of the checkpoint cadence, and the checkpoint cadence
    itself wherever that is already cheap enough; the cost formula counts every context token."""
    import dataclasses

    from shared.run.config import (
        AUDIT_BUDGET,
        AUDIT_PROMPT_TOKENS,
        AUDIT_TOKENS,
        PRESETS,
        RunConfig,
        audit_cost,
        default_sample_every,
    )
    for preset, shape in PRESETS.items():
        for batch in (1, 2, 4, 16, 64):
            for k in (1, 3, 8):
                cfg = RunConfig(preset=preset, model=shape, batch_size=batch)
                cfg.arms = cfg.arms[:1] * k
                every = default_sample_every(cfg)
                assert every % cfg.checkpoint_every == 0
                assert audit_cost(dataclasses.replace(cfg, sample_every=every)) <= AUDIT_BUDGET + 1e-12
                if every > cfg.checkpoint_every:  # the smallest multiple that fits
                    less = dataclasses.replace(cfg, sample_every=every - cfg.checkpoint_every)
                    assert audit_cost(less) > AUDIT_BUDGET
    cfg = RunConfig(preset="andrea-12m", model=PRESETS["andrea-12m"], batch_size=2)
    assert default_sample_every(cfg) == 200  # 3 arms x 48 tokens: 0.93 % every 100 steps, 0.47 % every 200
    ctx = sum(AUDIT_PROMPT_TOKENS + j for j in range(AUDIT_TOKENS))
    assert audit_cost(cfg) == pytest.approx(3 * ctx / (3 * 2 * 1024 * 100))


def test_probe_and_audits_together_cost_at_most_the_policy_budget_by_default():
    """docs/bandit.md#probe-cost: with the default probe_budget and sample
    cadence, probe + audits (shared/run/config.py policy_cost) stay within POLICY_BUDGET (2 %) of
    training FLOPs at every preset, batch and arm count (with the probe of heldout_progress; the
    default train_slope pays only the audits); the start-up table states the sum."""
    from shared.run.config import (
        POLICY_BUDGET,
        PRESETS,
        RunConfig,
        audit_cost,
        default_sample_every,
        policy_cost,
    )
    assert POLICY_BUDGET == 0.02
    free = RunConfig(batch_size=16)
    free.sample_every = default_sample_every(free)
    assert policy_cost(free) == audit_cost(free) <= 0.005
    worst = 0.0
    for preset, shape in PRESETS.items():
        for batch in (1, 2, 3, 4, 8, 16, 64, 512):
            for k in (1, 2, 3, 4, 16):
                cfg = RunConfig(preset=preset, model=shape, batch_size=batch, reward="heldout_progress")
                cfg.arms = cfg.arms[:1] * k
                cfg.sample_every = default_sample_every(cfg)
                worst = max(worst, policy_cost(cfg))
                assert policy_cost(cfg) <= POLICY_BUDGET + 1e-12, (preset, batch, k)
    assert worst > 0.019                             # the budget is used, not a loose bound


def test_batched_generation_with_one_generator_per_row_matches_each_row_alone():
    """worker/sampling.py generate_batched: the sample audit generates its arms as one batch,
    each row with its own generator, and each row's text is what that row alone would give."""
    import torch

    from shared.run.config import PRESETS
    from worker.model import GPT
    from worker.sampling import generate_batched
    m = GPT(PRESETS["andrea-test"], 64, seed=3).eval()
    idx = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(3)]  # noqa: E731
    together = generate_batched(m, idx, 20, 0.8, 40, gens())
    alone = [generate_batched(m, idx[i:i + 1], 20, 0.8, 40, [g])[0] for i, g in enumerate(gens())]
    assert together.shape == (3, 36)
    for i in range(3):
        assert torch.equal(together[i], alone[i])
    assert not torch.equal(together[0, 16:], together[1, 16:])
    with pytest.raises(ValueError, match="2 generators for 3 rows"):
        generate_batched(m, idx, 4, 0.8, 40, gens()[:2])


# ----------------------------------------------------------------------------- the default policy

def trend_records(n_steps, slopes, level=None, sigma=0.03, period=10, batch=16, seed=0, p=None):
    """Records whose per-arm training loss follows a - b ln(step) plus Gaussian noise of sd
    `sigma` per sequence (each arm's mean over its n rows then has sd sigma / sqrt(n))."""
    rng = random.Random(seed)
    arms = sorted(slopes)
    level = level or {a: 4.0 for a in arms}
    out = []
    for step in range(1, n_steps + 1):
        counts = {a: 0 for a in arms}
        for _ in range(batch):
            counts[arms[rng.randrange(len(arms))]] += 1
        loss = {a: level[a] - slopes[a] * math.log(step) + rng.gauss(0, sigma / math.sqrt(counts[a]))
                for a in arms if counts[a]}
        out.append({"step": step, "phase_index": 0, "arms": counts, "p": p or {a: 1 / len(arms) for a in arms},
                    "arm_loss": loss, "probe": None, "batch_size": batch})
    return out


def test_default_reward_is_the_free_training_loss_slope_and_reads_no_probe():
    """docs/bandit.md#the-default-policy: the default reads the training losses the update
    computes anyway; a probe in the record changes nothing."""
    from shared.run.config import RunConfig, probe_plan
    assert BanditConfig().reward == "train_slope" and RunConfig().reward == "train_slope"
    assert not probe_plan(RunConfig()).active and probe_plan(RunConfig()).cost == 0.0
    recs = trend_records(300, {"a": 0.2, "b": 0.2, "noise": 0.0})
    with_probe = [dict(r, probe={"a": 9.0, "b": 1.0, "noise": 5.0 + r["step"]}) for r in recs]
    cfg = BanditConfig(warmup_steps=50)
    x, y = (replay(["a", "b", "noise"], {}, {}, cfg, rr, 0, "i", 0) for rr in (recs, with_probe))
    x2, y2 = x.to_dict(), y.to_dict()
    assert x2 == y2


def test_default_policy_posts_stratified_until_a_lower_confidence_bound_says_the_move_pays():
    """The default (lambda_rule gate): exactly stratified during the warm-up and the first
    min_periods periods and wherever the lower confidence bound G - z SE of the target's gain
    is not positive; the target pi itself (lam = 1, the unlearnable arm at its floor) wherever
    it is; every p inside the box."""
    arms = ["a", "b", "noise"]
    floors, caps = {n: 0.1 for n in arms}, {n: 0.6 for n in arms}
    b = Bandit(arms, floors, caps, BanditConfig(warmup_steps=50), period_steps=10)
    strat = b.stratified()
    assert strat == pytest.approx({n: 1 / 3 for n in arms})
    lams = []
    for r in trend_records(400, {"a": 0.2, "b": 0.2, "noise": 0.0}):
        b.observe(r)
        p = b.probabilities()
        assert all(floors[n] - 1e-12 <= p[n] <= caps[n] + 1e-12 for n in arms)
        assert math.fsum(p.values()) == pytest.approx(1.0, abs=1e-12)
        if r["step"] <= 50 + 10 * 3:    # warm-up, then fewer than min_periods (4) points per arm
            assert p == strat and b.lam == 0.0
        lams.append(b.lam)
        assert b.lam in (0.0, 1.0) and (b.lam > 0) == (b.gain - b.config.confidence_z * b.gain_se > 0)
        if b.lam > 0:
            want = {n: (1 - b.lam) * strat[n] + b.lam * b.target[n] for n in arms}
            assert p == pytest.approx(want, abs=1e-12)
    assert b.target["noise"] == pytest.approx(0.1) and b.target["a"] == pytest.approx(0.45, abs=0.05)
    assert lams[-1] == 1 and b.gain > 0
    z, se, g = b.config.confidence_z, b.gain_se, b.gain
    assert g - z * se > 0     # the bound at the target is positive: the move is allowed
    assert b.probabilities() == pytest.approx(b.target, abs=1e-12)
    assert b.probabilities()["noise"] < 0.2
    # rule max_bound on the same records: the mixture on the segment with the best lower bound
    mb = Bandit(arms, floors, caps, BanditConfig(warmup_steps=50, lambda_rule="max_bound"), period_steps=10)
    for r in trend_records(400, {"a": 0.2, "b": 0.2, "noise": 0.0}):
        mb.observe(r)
    bounds = {j / 100: segment_bound(mb, j / 100) for j in range(101)}
    assert mb.lam > 0 and bounds[mb.lam] == max(bounds.values())


def segment_bound(b, lam):
    """The lower confidence bound G(lam) - z SE(lam) of p(lam) = (1 - lam) s + lam pi over s
    (docs/bandit.md#the-default-policy), from the bandit's slopes and target."""
    s, k, z = b.stratified(), len(b.arms), b.config.confidence_z
    sl = b.slopes()
    logs = {a: math.log(((1 - lam) * s[a] + lam * b.target[a]) / s[a]) for a in sl}
    g = math.fsum(sl[a][0] * logs[a] for a in sl) / k
    se = math.sqrt(math.fsum((logs[a] * sl[a][1]) ** 2 for a in sl)) / k
    return g - z * se


@pytest.mark.parametrize("rule", ["gate", "max_bound"])
def test_default_policy_moves_when_the_ratio_rule_would_and_further(rule):
    """The default (lambda_rule gate), the max_bound rule and the ratio rule decide on the same
    evidence when to leave stratified (the lower bound at the target positive); once moving,
    gate posts the target and max_bound the mixture on the segment with the best lower bound:
    on an unlearnable arm each lowers that arm at least as far as the ratio rule at every step,
    and further on average."""
    arms = ["a", "b", "noise"]
    box = {n: 0.1 for n in arms}, {n: 0.6 for n in arms}
    recs = trend_records(300, {"a": 0.2, "b": 0.2, "noise": 0.0}, sigma=0.3, seed=3)
    # the rules alone: the noisy noise arm's slope (0 +- 0.03) is not yet surely unlearnable
    new, old = (Bandit(arms, *box, BanditConfig(warmup_steps=50, lambda_rule=r, learnable_ratio=0),
                       period_steps=10) for r in (rule, "ratio"))
    assert BanditConfig().lambda_rule == "gate"
    gap, further = [], 0
    for r in recs:
        new.observe(r)
        old.observe(r)
        assert (new.lam > 0) == (old.lam > 0), r["step"]
        pn, po = new.probabilities(), old.probabilities()
        assert pn["noise"] <= po["noise"] + 1e-12, r["step"]
        gap.append(po["noise"] - pn["noise"])
        further += new.lam > old.lam > 0
    assert sum(gap) / len(gap) > 0.01 and further >= 20


def test_default_policy_stays_at_stratified_when_the_arms_learn_alike():
    """Alike arms (equal true slopes, noisy losses): the estimated gain of any move is within
    its noise, so lam stays 0 and the posted mixture is exactly stratified (non-inferior by
    construction, docs/bandit.md#the-default-policy)."""
    arms = ["a", "b", "c"]
    for seed in range(5):
        b = Bandit(arms, {n: 0.1 for n in arms}, {n: 0.6 for n in arms},
                   BanditConfig(warmup_steps=50), period_steps=10)
        moved = 0
        for r in trend_records(300, {n: 0.2 for n in arms}, sigma=0.3, seed=seed):
            b.observe(r)
            moved += b.lam > 0
        assert moved <= 20, (seed, moved)   # at most a couple of periods, if any
        assert b.lam < 0.3


def test_default_policy_stays_at_stratified_when_the_gain_is_below_the_margin_over_a_long_run():
    """Slopes 0.22 / 0.20 / 0.18 (the model's best move gains 0.0007 nats of mean loss, below
    the 0.001 margin of docs/bandit.md#targets) over 600 steps with noisy losses: the default
    (z = 3) never leaves stratified. The target is picked from the same slopes it is judged
    on, so the bound along its direction is biased upward; at z = 2 this moved in 3 of 10
    seeds, as it did on the bench's alike set B at 600 steps (docs/bandit.md#where-it-stands)."""
    arms = ["a", "b", "c"]
    assert BanditConfig().confidence_z == 3.0
    for seed in range(10):
        b = Bandit(arms, {n: 0.1 for n in arms}, {n: 0.6 for n in arms},
                   BanditConfig(warmup_steps=50), period_steps=10)
        for r in trend_records(600, {"a": 0.22, "b": 0.20, "c": 0.18}, sigma=0.3, seed=seed):
            b.observe(r)
            assert b.lam == 0 and b.probabilities() == pytest.approx({n: 1 / 3 for n in arms}), (seed, r["step"])


def test_default_policy_never_moves_share_between_learnable_arms_over_a_long_run():
    """docs/bandit.md#learnable-arms-keep-their-share: slopes 0.5 / 0.3 / 0.2 (every arm within
    a quarter of the fastest) over 3,000 steps: the default never leaves stratified, however sure
    the fits become; the unprotected target (learnable_ratio 0) moves on the same records."""
    arms = ["a", "b", "c"]
    box = {n: 0.1 for n in arms}, {n: 0.6 for n in arms}
    moved_unprotected = 0
    for seed in range(3):
        b, old = (Bandit(arms, *box, BanditConfig(warmup_steps=50, learnable_ratio=r), period_steps=10)
                  for r in (0.25, 0.0))
        assert b.config.learnable_ratio == BanditConfig().learnable_ratio == 0.25
        for r in trend_records(3000, {"a": 0.5, "b": 0.3, "c": 0.2}, sigma=0.3, seed=seed):
            b.observe(r)
            old.observe(r)
            assert b.lam == 0 and b.probabilities() == pytest.approx({n: 1 / 3 for n in arms}), (seed, r["step"])
        assert b.target == pytest.approx(b.stratified(), abs=1e-12) and b.gain == 0
        moved_unprotected += old.lam > 0 and old.probabilities()["c"] < 0.3
    assert moved_unprotected == 3


def three_fits():
    """ArmFits of arms a, b, c with slopes 0.3, 0.1, 0.0 over six points of small alternating noise."""
    from proxy.mixture.loss_trend import ArmFit
    fits = {}
    for name, slope in (("a", 0.3), ("b", 0.1), ("c", 0.0)):
        f = ArmFit()
        for i, x in enumerate([4.0, 4.2, 4.4, 4.6, 4.8, 5.0]):
            f.add(100, x, 3.0 - slope * x + (0.01 if i % 2 else -0.01))  # one block of steps
        fits[name] = f
    return fits


def test_conservative_mixture_keeps_learnable_arms_at_their_stratified_share():
    """An arm is learnable when b + t se >= learnable_ratio * max b; its floor in the target is its
    stratified share, so only the others (here c, slope 0) give share, to the learnable arms."""
    from proxy.mixture.loss_trend import conservative_mixture
    fits = three_fits()
    s = {n: 1 / 3 for n in "abc"}
    box = {n: 0.1 for n in "abc"}, {n: 0.6 for n in "abc"}
    mv = conservative_mixture(list("abc"), fits, *box, s, set(), 2.0, 4, rule="gate", learnable_ratio=0.25)
    assert mv.target["a"] > s["a"] and mv.target["b"] == pytest.approx(s["b"], abs=1e-12)
    assert mv.target["c"] == pytest.approx(0.1) and mv.lam == 1.0
    free = conservative_mixture(list("abc"), fits, *box, s, set(), 2.0, 4, rule="gate")
    assert free.target["b"] < s["b"]          # unprotected, the slower learnable arm pays
    # every arm learnable (ratio above every b's share of the top): the target is stratified
    alike = conservative_mixture(list("ab"), fits, {"a": 0.1, "b": 0.1}, {"a": 0.9, "b": 0.9},
                                 {"a": 0.5, "b": 0.5}, set(), 2.0, 4,
                                 rule="gate", learnable_ratio=0.25)
    assert alike.target == {"a": 0.5, "b": 0.5} and alike.lam == 0 and alike.gain == 0


def test_a_slow_arm_with_nowhere_to_give_its_share_leaves_the_mixture_stratified():
    """The learnable arms all past one epoch (capped at their stratified share): the slow arm is
    still judged slow, but the target is stratified, lambda 0, and explain() says why rather than
    "moved" (docs/bandit.md#learnable-arms-keep-their-share)."""
    from proxy.mixture.loss_trend import conservative_mixture
    fits = three_fits()
    s = {n: 1 / 3 for n in "abc"}
    box = {n: 0.1 for n in "abc"}, {n: 0.6 for n in "abc"}
    mv = conservative_mixture(list("abc"), fits, *box, s, {"a", "b"}, 2.0, 4, rule="gate", learnable_ratio=0.25)
    assert mv.slow == ("c",) and mv.lam == 0.0 and mv.target == pytest.approx(s, abs=1e-12)
    one = conservative_mixture(list("abc"), fits, *box, s, {"b"}, 2.0, 4, rule="gate", learnable_ratio=0.25)
    assert one.slow == ("c",) and one.lam == 1.0 and one.target["a"] > s["a"]   # a can still take it
    b = Bandit(list("abc"), *box, BanditConfig(warmup_steps=0, confidence_z=2.0), period_steps=10)
    b.fits, b.repeated, b.step = fits, {"a": 5, "b": 5}, 100
    b._refit()
    e = b.explain()
    assert b.slow == {"c"} and b.lam == 0 and e["why"].startswith("stratified: c learn(s) surely slower")
    assert b.probabilities() == pytest.approx(s)


def test_student_t_quantile_and_cdf_match_the_tables():
    """proxy/mixture/loss_trend.py t_cdf / t_quantile: published quantiles (two-sided 5 % and 1 %),
    symmetry, the Cornish-Fisher branch above 200 df, and the inverse relation."""
    from proxy.mixture.loss_trend import t_cdf, t_quantile
    table = [(0.975, 1, 12.706), (0.975, 2, 4.303), (0.975, 10, 2.228), (0.975, 200, 1.972),
             (0.975, 1000, 1.962), (0.995, 3, 5.841), (0.995, 30, 2.750), (0.995, 201, 2.601)]
    for q, df, want in table:
        assert t_quantile(q, df) == pytest.approx(want, abs=1e-3), (q, df)
        assert t_cdf(t_quantile(q, df), df) == pytest.approx(q, abs=1e-9)
        assert t_quantile(1 - q, df) == -t_quantile(q, df)
    assert t_cdf(0.0, 7) == 0.5 and 0.0 <= t_cdf(-40.0, 22) < 1e-14 and t_cdf(float("inf"), 3) == 1.0
    assert t_quantile(NormalDist().cdf(8.0), 1) > 1e12      # z = 8 at one df: huge, finite
    with pytest.raises(ValueError):
        t_quantile(1.0, 5)


def test_an_arm_whose_loss_surely_rises_is_not_learnable_and_none_is_when_no_slope_is_positive():
    """learnable_arms takes the slope with its sign: an arm whose loss rises (b < 0, its bound below
    a quarter of the fastest) gives share; with no positive slope no arm counts as learnable."""
    from proxy.mixture.loss_trend import learnable_arms
    n = {a: 20 for a in ("a", "b", "rising")}
    assert learnable_arms({"a": (0.397, 0.03), "b": (0.347, 0.03), "rising": (-0.314, 0.037)}, n, 3.0,
                          0.25) == {"a", "b"}
    assert learnable_arms({"a": (0.0, 0.01), "b": (-0.2, 0.01)}, n, 3.0, 0.25) == set()
    assert learnable_arms({"a": (0.4, 0.01), "b": (0.3, 0.01)}, n, 3.0, 0.0) == set()
    with pytest.raises(BanditConfigError):
        BanditConfig(confidence_z=9)
    b = Bandit(["a", "b", "noise"], {}, {}, BanditConfig(warmup_steps=50, confidence_z=8), period_steps=10)
    for r in trend_records(200, {"a": 0.2, "b": 0.2, "noise": 0.0}):
        b.observe(r)
    assert b.lam == 0 and all(v["learnable"] for v in b.explain()["arms"].values())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.floats(-5, 5)), min_size=1, max_size=60))
def test_an_arm_fit_holds_exactly_the_last_two_doublings_of_the_step(gaps_and_losses):
    """loss_trend.ArmFit: after any increasing steps its points and slope are those of a plain
    LineSums over the points whose step lies in the newest point's block [2^k, 2^(k+1)) or the
    one before; `to_dict`/`from_dict` is exact (docs/bandit.md#the-default-policy)."""
    from proxy.mixture.loss_trend import ArmFit, LineSums
    fit, points, step = ArmFit(), [], 0
    for gap, y in gaps_and_losses:
        step += gap
        fit.add(step, math.log(step), y)
        points.append((step, y))
    k = step.bit_length() - 1
    plain = LineSums()
    for t, y in points:
        if t >= 2 ** (k - 1):
            plain.add(math.log(t), y)
    assert fit.n == plain.n and fit.block == k
    got, want = fit.slope(), plain.slope()
    assert (got is None) == (want is None)
    if got is not None:
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert ArmFit.from_dict(json.loads(json.dumps(fit.to_dict()))) == fit


def test_an_arm_fit_forgets_an_early_fall_and_a_gap_of_blocks():
    """A loss that falls fast for 200 steps and then stays flat: the fit over the whole history
    still reports the early fall at step 2,000, the window reports the present rate (about 0);
    a point two blocks after the last clears the older block."""
    from proxy.mixture.loss_trend import ArmFit, LineSums
    fit, whole = ArmFit(), LineSums()
    for step in range(25, 2001, 25):
        y = 5.0 - 0.5 * math.log(min(step, 200)) + (0.001 if step % 50 else -0.001)
        fit.add(step, math.log(step), y)
        whole.add(math.log(step), y)
    assert whole.slope()[0] > 0.1 and abs(fit.slope()[0]) < 0.005
    fit.add(9000, math.log(9000), 1.0)          # block 13 after block 10: nothing before it stays
    assert fit.n == 1 and fit.previous.n == 0 and fit.slope() is None


def test_a_slow_arm_needs_its_lower_bound_to_count_as_learnable_again():
    """learnable_arms' hysteresis (docs/bandit.md#learnable-arms-keep-their-share): an arm whose
    upper bound reaches a quarter of the fastest slope is learnable, but once judged slow it is
    learnable again only when its lower bound reaches that level."""
    from proxy.mixture.loss_trend import learnable_arms
    n = {"fast": 20, "x": 20}
    unsure = {"fast": (0.4, 0.01), "x": (0.1, 0.03)}      # 0.1 +- t 0.03 straddles 0.1
    assert learnable_arms(unsure, n, 3.0, 0.25) == {"fast", "x"}
    assert learnable_arms(unsure, n, 3.0, 0.25, slow={"x"}) == {"fast"}
    sure = {"fast": (0.4, 0.01), "x": (0.3, 0.01)}
    assert learnable_arms(sure, n, 3.0, 0.25, slow={"x"}) == {"fast", "x"}


def test_an_arm_the_repetition_guard_holds_does_not_set_the_fastest_rate():
    """A trivially predictable arm (held by the repetition guard) falls fastest for no real gain:
    its slope is not the measure the others are judged against, so a real arm at a third of its
    rate stays learnable (docs/bandit.md#learnable-arms-keep-their-share); seen on the bench's
    trap set, where the list arm's slope 1.18 made repo-docstrings' 0.09 look slow."""
    from proxy.mixture.loss_trend import learnable_arms
    slopes = {"list": (1.18, 0.02), "docs": (0.2, 0.05), "docstrings": (0.09, 0.04)}
    n = {a: 17 for a in slopes}
    assert learnable_arms(slopes, n, 3.0, 0.25) == {"list", "docs"}
    assert learnable_arms(slopes, n, 3.0, 0.25, held={"list"}) == {"list", "docs", "docstrings"}
    assert learnable_arms({"list": (1.18, 0.02), "flat": (0.0, 0.001)}, n, 3.0, 0.25, held={"list"}) == set()


def test_an_arm_past_one_epoch_does_not_set_the_fastest_rate_with_its_stale_slope():
    """An arm past one epoch stops adding points to its fit, so its slope is the rate of the step
    it passed the epoch, which the others' bending losses have since left behind: it is not the
    measure a lowered arm must reach to learn again (docs/bandit.md#learnable-arms-keep-their-share).
    Seen on the bench's set I at 3,000 steps (seed 2): python-docs passed one epoch at step 1,800
    with slope 0.452, and the scrambled arm, slope 0.139 +- 0.029 at step 2,600 beside
    repo-code's live 0.361, stayed lowered to the end. With fewer than two live arms, or none of
    them learning, the stale slopes still set it."""
    from proxy.mixture.loss_trend import ArmFit, conservative_mixture, learnable_arms
    slopes = {"docs": (0.452, 0.016), "code": (0.27, 0.012), "topics": (0.14, 0.01)}
    n = {a: 40 for a in slopes}
    assert learnable_arms(slopes, n, 3.0, 0.25, slow={"topics"}) == {"docs", "code"}
    assert learnable_arms(slopes, n, 3.0, 0.25, slow={"topics"}, stale={"docs"}) == set(slopes)
    flat = {"docs": (0.452, 0.016), "code": (0.27, 0.012), "noise": (-0.01, 0.01)}
    n3 = {a: 40 for a in flat}
    assert learnable_arms(flat, n3, 3.0, 0.25, stale={"docs"}) == {"docs", "code"}
    assert learnable_arms(flat, n3, 3.0, 0.25, stale={"docs", "code"}) == {"docs", "code"}
    lone = {"docs": (0.452, 0.016), "code": (0.27, 0.012), "slow": (0.02, 0.01)}
    assert learnable_arms(lone, n3 | {"slow": 40}, 3.0, 0.25, stale={"docs", "code"}) == {"docs", "code"}
    # conservative_mixture passes its repeated arms as stale: the recovered arm gets its share back
    fits = {a: ArmFit() for a in slopes}
    for i, x in enumerate([7.0 + 0.05 * j for j in range(40)]):
        for a, b in {"docs": 0.452, "code": 0.27, "topics": 0.1}.items():
            fits[a].add(1024, x, 3.0 - b * x + (0.001 if i % 2 else -0.001))
    s = {a: 1 / 3 for a in slopes}
    box = {a: 0.1 for a in slopes}, {a: 0.6 for a in slopes}
    args = (list(slopes), fits, *box, s)
    kw = dict(rule="gate", learnable_ratio=0.25, slow={"topics"})
    assert conservative_mixture(*args, set(), 3.0, 4, **kw).slow == ("topics",)
    back = conservative_mixture(*args, {"docs"}, 3.0, 4, **kw)
    assert back.slow == () and back.lam == 0.0 and back.target == pytest.approx(s)


def test_the_default_policy_moves_exactly_while_some_arm_is_judged_slow_and_keeps_that_on_resume():
    """With learnable_ratio > 0 the learnable test is the gate: lam is 1 exactly when some arm
    is judged slow, and the posted mixture then lowers only those arms; the judgement is part
    of `.state.json`, so a bandit rebuilt from its state decides alike. Retiring the arm
    forgets it."""
    arms = ["a", "b", "noise"]
    b = Bandit(arms, {n: 0.1 for n in arms}, {n: 0.6 for n in arms}, BanditConfig(warmup_steps=50),
               period_steps=10)
    recs = trend_records(600, {"a": 0.3, "b": 0.3, "noise": 0.0}, sigma=0.05, seed=2)
    for i, r in enumerate(recs):
        b.observe(r)
        assert (b.lam > 0) == bool(b.slow) and b.lam in (0.0, 1.0), r["step"]
        assert b.slow <= {"noise"}, r["step"]
        if i == 400:
            twin = Bandit.from_dict(json.loads(json.dumps(b.to_dict())))
            assert twin.slow == b.slow
        if i > 400:
            twin.observe(r)
            assert twin.probabilities() == b.probabilities() and twin.slow == b.slow
    assert b.slow == {"noise"} and b.probabilities()["noise"] == pytest.approx(0.1)
    b.retire("noise", "test")
    assert "noise" not in b.slow and "noise" not in b.to_dict()["trend"]["slow"]


def test_conservative_mixture_matches_its_equations():
    """proxy/mixture/loss_trend.py: pi = M project(b+/sum b+), G = (1/K) sum b ln(pi/s), SE from the
    slopes' variances, lam = max(0, 1 - z SE / G); fewer than min_periods points = no evidence."""
    from proxy.mixture.loss_trend import conservative_mixture
    fits = three_fits()
    s = {n: 1 / 3 for n in "abc"}
    mv = conservative_mixture(list("abc"), fits, {n: 0.1 for n in "abc"}, {n: 0.6 for n in "abc"}, s,
                              set(), 2.0, 4)
    b = {n: mv.slopes[n][0] for n in "abc"}
    assert b["a"] == pytest.approx(0.3, abs=0.02) and b["c"] == pytest.approx(0.0, abs=0.02)
    want = project_to_box({n: max(0, b[n]) / sum(max(0, v) for v in b.values()) for n in "abc"},
                          {n: 0.1 for n in "abc"}, {n: 0.6 for n in "abc"})
    assert mv.target == pytest.approx(want, abs=1e-12)
    g = sum(b[n] * math.log(mv.target[n] / s[n]) for n in "abc") / 3
    se = math.sqrt(sum((math.log(mv.target[n] / s[n]) * mv.slopes[n][1]) ** 2 for n in "abc")) / 3
    assert mv.gain == pytest.approx(g) and mv.gain_se == pytest.approx(se)
    assert mv.lam == pytest.approx(max(0, 1 - 2 * se / g))
    few = conservative_mixture(list("abc"), fits, {}, {}, s, set(), 2.0, 7)
    assert few.lam == 0 and few.target == s
    # rule max_bound: the same target, gain and SE; lam the grid point of largest G(lam) - z SE(lam)
    best = conservative_mixture(list("abc"), fits, {n: 0.1 for n in "abc"}, {n: 0.6 for n in "abc"}, s,
                                set(), 2.0, 4, rule="max_bound")
    assert (best.target, best.gain, best.gain_se) == (mv.target, mv.gain, mv.gain_se)

    def bound(lam):
        logs = {n: math.log(((1 - lam) * s[n] + lam * mv.target[n]) / s[n]) for n in "abc"}
        return (sum(b[n] * logs[n] for n in "abc")
                - 2 * math.sqrt(sum((logs[n] * mv.slopes[n][1]) ** 2 for n in "abc"))) / 3
    assert bound(best.lam) == pytest.approx(max(bound(j / 100) for j in range(101)))
    assert bound(best.lam) >= bound(mv.lam) > 0
    # rule gate: the same target, gain and SE; lam 1 exactly when the bound at the target is positive
    gate = conservative_mixture(list("abc"), fits, {n: 0.1 for n in "abc"}, {n: 0.6 for n in "abc"}, s,
                                set(), 2.0, 4, rule="gate")
    assert (gate.target, gate.gain, gate.gain_se) == (mv.target, mv.gain, mv.gain_se)
    assert gate.lam == (1.0 if mv.gain - 2.0 * mv.gain_se > 0 else 0.0) == 1.0


def test_an_arm_past_one_epoch_stops_counting_and_is_never_raised_above_stratified():
    """docs/bandit.md#repetition: once an arm's lifetime pulls pass its epoch size its training
    loss is no longer held-out evidence: its fit stops at the last held-out-valid period, and
    the target may lower it but never raise it above its stratified share, however fast its
    (memorised) training loss falls."""
    arms = ["big", "other", "small"]
    b = Bandit(arms, {n: 0.1 for n in arms}, {n: 0.6 for n in arms}, BanditConfig(warmup_steps=20),
               period_steps=10, epoch_size={"small": 1000.0, "big": 1e9, "other": 1e9})
    recs = trend_records(400, {"big": 0.2, "other": 0.1, "small": 0.25})
    for r in recs:
        if r["step"] > 200:   # memorising: its training loss now falls fast
            r["arm_loss"]["small"] = r["arm_loss"].get("small", 4.0) - 0.02 * (r["step"] - 200)
        b.observe(r)
        if "small" in b.repeated:
            assert b.probabilities()["small"] <= 1 / 3 + 1e-12
    crossed = b.repeated["small"]
    assert 150 < crossed < 250
    pulls = sum(r["arms"]["small"] for r in recs if r["step"] <= crossed)
    assert pulls > 1000 >= pulls - recs[crossed - 1]["arms"]["small"]
    n_at = b.fits["small"].n
    assert n_at == (crossed // 10 * 10 - 20) // 10 - (0 if crossed % 10 else 1) or n_at <= (crossed - 20) // 10
    assert b.target["small"] <= 1 / 3 + 1e-12
    back = Bandit.from_dict(json.loads(json.dumps(b.to_dict())))
    assert back.to_dict() == b.to_dict() and back.repeated == {"small": crossed}


def test_the_policy_explains_what_it_waits_for_and_why_it_moved():
    """docs/bandit.md#reading-the-policy: `explain()` names the warm-up, the evidence still
    missing and the gain's bound while stratified; once the noise arm is judged slow the posted
    mixture is the target; the per-arm slopes are the fits' over the last two doublings of the
    step and the unlearnable arm's target is its floor. Never part of `.state.json`."""
    arms = ["a", "b", "noise"]
    recs = trend_records(400, {"a": 0.3, "b": 0.3, "noise": 0.0}, sigma=0.02)
    cfg = BanditConfig(warmup_steps=50)
    b = Bandit(arms, {n: 0.1 for n in arms}, {}, cfg, period_steps=10)
    whys = []
    for r in recs:
        b.observe(r)
        e = b.explain()
        whys.append(e["why"].split(":")[0])
        assert e["open"] == (e["lambda"] > 0) and e["bound"] == pytest.approx(e["gain"] - 3 * e["gain_se"])
        assert {a: x["posted"] for a, x in e["arms"].items()} == b.probabilities()
    assert whys[0] == "warm-up" and "waiting for evidence" in whys and whys[-1] == "moved"
    e = b.explain()
    # the window at step 400: the periods ending at 130, 140, .., 400 (blocks [128, 256), [256, 512))
    assert e["arms"]["noise"]["target"] == pytest.approx(0.1) and e["arms"]["a"]["periods"] == 28
    assert e["arms"]["noise"]["learnable"] is False and e["arms"]["a"]["learnable"] is True
    assert "noise learn(s) surely slower" in e["why"]
    assert e["arms"]["a"]["slope"] == pytest.approx(0.3, abs=0.05)
    assert (e["arms"]["a"]["slope"], e["arms"]["a"]["slope_se"]) == pytest.approx(b.slopes()["a"])
    assert "explain" not in json.dumps(b.to_dict()) and "why" not in b.to_dict()
    json.dumps(e)  # JSON-ready


def test_an_exp3_reward_explains_its_weights_and_status_shows_them():
    """docs/bandit.md#reading-the-policy for the EXP3 rewards: per arm the log-weight, the
    reward EMA and the posted share, and `status` prints them as a table."""
    from proxy.commands.status import _policy_lines

    arms = ["a", "b", "noise"]
    b = Bandit(arms, {n: 0.1 for n in arms}, {}, BanditConfig(reward="train_loss", warmup_steps=20),
               period_steps=10)
    for r in trend_records(200, {"a": 0.3, "b": 0.3, "noise": 0.0}, sigma=0.02):
        b.observe(r)
    e = json.loads(json.dumps(b.explain()))
    assert e["why"].startswith("EXP3 on train_loss") and b.updates > 0
    assert {a: x["log_weight"] for a, x in e["arms"].items()} == pytest.approx(b.logw)
    assert {a: x["reward_ema"] for a, x in e["arms"].items()} == pytest.approx(b.ema_reward)
    assert {a: x["posted"] for a, x in e["arms"].items()} == pytest.approx(b.probabilities())
    lines = _policy_lines({"policy": e})
    assert lines[0].startswith("policy      train_loss at step 200: EXP3") and "log-weight" in lines[1]
    assert len(lines) == 2 + len(arms) and all(f"{b.logw[a]:.4f}" in lines[2 + i] for i, a in enumerate(arms))


def content_records(steps: int, slopes: dict, content_sd: float = 0.5, seed: int = 0,
                    unigram: bool = True):
    """trend_records whose arm losses also carry each batch's content: a term u that the rows'
    unigram loss (`arm_unigram_loss`) measures exactly, as the worker reports it."""
    rng = random.Random(seed)
    out = []
    for r in trend_records(steps, slopes, sigma=0.01, seed=seed):
        u = {a: 3.0 + rng.gauss(0, content_sd) for a in r["arm_loss"]}
        r = dict(r, arm_loss={a: v + u[a] for a, v in r["arm_loss"].items()})
        if unigram:
            r["arm_unigram_loss"] = u
        out.append(r)
    return out


def test_the_control_variate_removes_the_rows_content_from_the_fit():
    """docs/bandit.md#the-control-variate: the fit sees each arm's loss minus its rows' unigram
    loss, so batch-to-batch content (here sd 0.5 nats, the unigram loss measuring it exactly)
    leaves the slope's standard error where the content-free losses put it, and the unlearnable
    arm is found; without the field the same content hides it."""
    arms = ["a", "b", "noise"]
    box = {n: 0.1 for n in arms}, {n: 0.6 for n in arms}
    slopes = {"a": 0.2, "b": 0.2, "noise": 0.0}
    cfg = BanditConfig(warmup_steps=50)
    with_cv, without = (Bandit(arms, *box, cfg, period_steps=10) for _ in range(2))
    for r in content_records(300, slopes):
        with_cv.observe(r)
        without.observe({k: v for k, v in r.items() if k != "arm_unigram_loss"})
    assert with_cv.control_variate is True and without.control_variate is False
    clean = Bandit(arms, *box, cfg, period_steps=10)
    for r in trend_records(300, slopes, sigma=0.01, seed=0):
        clean.observe(r)
    for a in arms:
        assert with_cv.slopes()[a] == pytest.approx(clean.slopes()[a], abs=1e-9)
        assert without.slopes()[a][1] > 10 * with_cv.slopes()[a][1]
    assert with_cv.lam == 1.0 and with_cv.target["noise"] == pytest.approx(0.1)
    assert without.lam == 0.0


def test_a_phase_begun_without_the_unigram_loss_never_mixes_it_in():
    """A history written before `arm_unigram_loss` existed, resumed by a worker that reports it:
    the phase's first record decides, so its fits keep the plain losses (a jump of the unigram
    level would read as a fall of several nats), in the live bandit, a replay and a snapshot
    alike."""
    arms = ["a", "b", "noise"]
    box = {n: 0.1 for n in arms}, {n: 0.6 for n in arms}
    recs = content_records(300, {"a": 0.2, "b": 0.2, "noise": 0.0}, content_sd=0.0)
    old = [{k: v for k, v in r.items() if k != "arm_unigram_loss"} for r in recs[:150]]
    mixed = old + recs[150:]
    cfg = BanditConfig(warmup_steps=50)
    b = Bandit(arms, *box, cfg, period_steps=10)
    plain = Bandit(arms, *box, cfg, period_steps=10)
    for r in mixed:
        b.observe(r)
    for r in content_records(300, {"a": 0.2, "b": 0.2, "noise": 0.0}, content_sd=0.0, unigram=False):
        plain.observe(r)
    assert b.control_variate is False and b.to_dict()["trend"] == plain.to_dict()["trend"]
    # a snapshot of the state resumes exactly; one from before the field (no key) cannot say
    # which signal its fits hold, so it is refused (the rebuild replays the phase instead:
    # tests/test_state_snapshots.py)
    half = Bandit(arms, *box, cfg, period_steps=10)
    for r in old:
        half.observe(r)
    snap = json.loads(json.dumps(half.to_dict()))
    resumed = Bandit.from_dict(snap)
    for r in recs[150:]:
        resumed.observe(r)
    assert resumed.control_variate is False and resumed.to_dict() == b.to_dict()
    del snap["trend"]["control_variate"]
    with pytest.raises(ValueError, match="control_variate"):
        Bandit.from_dict(snap)
    # a fresh phase decides anew, and its snapshot keeps the decision
    fresh = Bandit(arms, *box, cfg, period_steps=10)
    assert Bandit.from_dict(json.loads(json.dumps(fresh.to_dict()))).control_variate is None
    fresh.observe(recs[0])
    assert Bandit.from_dict(json.loads(json.dumps(fresh.to_dict()))).control_variate is True


def late_learner_records(n_steps, turn=400, seed=4, sigma=0.05):
    """Records of arms "a" and "b" falling at 0.3 nats per e-fold from the start and "late",
    flat until step `turn` and falling at that rate after it (an arm the model cannot learn
    early on and can later: set I's scrambled arm, docs/bandit.md#where-it-stands)."""
    recs = trend_records(n_steps, {"a": 0.3, "b": 0.3, "late": 0.0}, sigma=sigma, seed=seed)
    for r in recs:
        if r["step"] > turn and "late" in r["arm_loss"]:
            r["arm_loss"]["late"] -= 0.3 * (math.log(r["step"]) - math.log(turn))
    return recs


def test_a_lowered_arm_that_learns_again_gets_back_the_share_it_was_denied():
    """docs/bandit.md#lowered-arms-get-their-share-back: an arm judged slow and lowered, once it
    learns again, is posted above its stratified share (never above its cap) until the
    share-steps it was denied are paid back by the arms that took them; then the mixture is
    stratified, and over the phase every arm has had its stratified share. `owed` is part of
    `.state.json`: a bandit rebuilt from it mid-repayment decides alike."""
    arms = ["a", "b", "late"]
    b = Bandit(arms, {n: 0.1 for n in arms}, {n: 0.6 for n in arms}, BanditConfig(warmup_steps=50),
               period_steps=10)
    s = b.stratified()
    posted_sum = {a: 0.0 for a in arms}
    lowered = repaid_at = None
    above = 0
    twin = None
    for r in late_learner_records(4000):
        p = b.probabilities()
        for a in arms:
            posted_sum[a] += p[a]
        b.observe(r)
        assert math.fsum(b.owed.values()) == pytest.approx(0.0, abs=1e-9), r["step"]
        p = b.probabilities()
        assert all(0.1 - 1e-12 <= p[a] <= 0.6 + 1e-12 for a in arms), (r["step"], p)
        if "late" in b.slow and lowered is None:
            lowered = r["step"]
        if lowered and "late" not in b.slow and p["late"] > s["late"] + 1e-9:
            above += 1
            assert b.owed["late"] > 0 and b.explain()["why"].startswith("paying back"), r["step"]
            if twin is None:
                twin = Bandit.from_dict(json.loads(json.dumps(b.to_dict())))
                continue
        if twin is not None:
            twin.observe(r)
            assert twin.probabilities() == p and twin.owed == b.owed, r["step"]
        if lowered and above and repaid_at is None and b.lam == 0.0:
            repaid_at = r["step"]
    assert lowered is not None and above > 100, (lowered, above)
    assert repaid_at is not None and b.probabilities() == s
    assert abs(b.owed["late"]) < 0.01 * 4000
    for a in arms:  # every arm had its stratified share over the phase, to the last period's
        assert posted_sum[a] / 4000 == pytest.approx(s[a], abs=0.02), (a, posted_sum)


def test_repayment_takes_only_from_learnable_arms_with_a_credit_and_only_what_is_owed():
    """`repayment` (proxy/mixture/loss_trend.py): a debtor rises by owed / period at most, to its
    cap at most; creditors fall in proportion to what they can give, to max(floor, MIN_SHARE s)
    at most; the changes sum to zero; a slow, past-one-epoch or held arm never rises; nothing
    moves without both a learnable debtor and a learnable creditor."""
    from proxy.mixture.loss_trend import MIN_SHARE, repayment
    s = {"a": 0.25, "b": 0.25, "c": 0.5}
    floors = {"a": 0.0, "b": 0.2, "c": 0.0}
    cap = {"a": 0.6, "b": 0.6, "c": 0.6}
    keep = {"a", "b", "c"}
    small = repayment(keep, {"a": 1.0, "b": -0.25, "c": -0.75}, s, floors, cap, set(), 10)
    assert small == pytest.approx({"a": 0.1, "b": -0.025, "c": -0.075})
    big = repayment(keep, {"a": 100.0, "b": -50.0, "c": -50.0}, s, floors, cap, set(), 10)
    # a rises to its cap (0.35); b can give 0.05 (to its floor 0.2), c 0.45: scaled to 0.35
    assert big["a"] == pytest.approx(0.35)
    assert big["b"] == pytest.approx(-0.05 * 0.35 / 0.5) and big["c"] == pytest.approx(-0.45 * 0.35 / 0.5)
    assert math.fsum(big.values()) == pytest.approx(0.0, abs=1e-15)
    assert s["c"] + big["c"] >= MIN_SHARE * s["c"]
    assert repayment({"b", "c"}, {"a": 1.0, "b": -0.5, "c": -0.5}, s, floors, cap, set(), 10) == {}
    assert repayment(keep, {"a": 1.0, "b": -0.5, "c": -0.5}, s, floors, cap, {"a"}, 10) == {}
    assert repayment({"a", "b"}, {"a": 1.0, "b": 0.0, "c": -1.0}, s, floors, cap, set(), 10) == {}
    assert repayment(keep, {"a": 1e-9, "b": -1e-9, "c": 0.0}, s, floors, cap, set(), 10) == {}


@pytest.mark.parametrize("others, floor, cap", [(1, 0.1, 0.9), (3, 0.0, 0.45), (3, 0.0, 0.65), (7, 0.0, 0.6)])
def test_a_debtor_paid_back_at_its_cap_is_posted_at_its_cap(others, floor, cap):
    """A debtor held by its cap gets a floor of exactly its cap, never one rounding above it
    (which the projection refuses as infeasible): a mixture of 2, 4 or 8 arms whose arm learns
    late is paid back to the end and is stratified again."""
    arms = [f"a{i}" for i in range(others)] + ["late"]
    b = Bandit(arms, {n: floor for n in arms}, {n: cap for n in arms}, BanditConfig(warmup_steps=50),
               period_steps=10)
    recs = trend_records(3000, {a: 0.0 if a == "late" else 0.3 for a in arms}, sigma=0.05, seed=4)
    for r in recs:
        if r["step"] > 400 and "late" in r["arm_loss"]:
            r["arm_loss"]["late"] -= 0.3 * (math.log(r["step"]) - math.log(400))
    rose = 0
    for r in recs:
        b.observe(r)
        p = b.probabilities()
        rose += b.paid == {"late"} and p["late"] == pytest.approx(cap)
    assert rose > 0 and b.lam == 0.0 and b.probabilities() == b.stratified()


def test_only_the_learnable_test_pays_back_and_a_retired_arm_leaves_the_ledger_balanced():
    """Under the gain's bound (learnable_ratio 0) nothing is owed and nothing is paid back,
    whatever the posted mixture; a debtor retired mid-payback leaves its debt to the arms that
    stay, so the ledger still sums to zero and the mixture is stratified again."""
    arms = ["a", "b", "late"]
    for rule in ("gate", "ratio", "max_bound"):
        b = Bandit(arms, {n: 0.1 for n in arms}, {n: 0.6 for n in arms},
                   BanditConfig(warmup_steps=50, learnable_ratio=0.0, lambda_rule=rule), period_steps=10)
        moved = False
        for r in late_learner_records(1500):
            b.observe(r)
            moved |= b.lam > 0
            assert set(b.owed.values()) == {0.0} and not b.paid, (rule, r["step"])
            assert not b.explain()["why"].startswith("paying back"), (rule, r["step"])
        assert moved, rule
    b = Bandit(arms, {n: 0.1 for n in arms}, {n: 0.6 for n in arms}, BanditConfig(warmup_steps=50),
               period_steps=10)
    recs = late_learner_records(3000)
    for r in recs:
        b.observe(r)
        if b.paid:
            break
    assert b.paid == {"late"} and b.owed["late"] > 0
    b.retire("late", "test")
    assert math.fsum(b.owed.values()) == pytest.approx(0.0, abs=1e-9) and not b.paid
    for later in recs[r["step"]:]:
        b.observe(later)
    assert b.lam == 0.0 and b.probabilities() == b.stratified()
