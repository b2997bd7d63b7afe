"""The default policy's evidence and its conservative move (docs/bandit.md#the-default-policy).

What it is: per arm, an online least-squares fit of the arm's mean pre-update training loss per
policy period against ln(step) (`ArmFit`), and `conservative_mixture`, which turns the fitted
slopes into a target mixture and the share lambda of the way from stratified to it that a lower
confidence bound on the gain supports. What it is not: the folding of records, the repetition
bookkeeping or the state (proxy/mixture/bandit.py), the projection (proxy/mixture/box_projection.py).

Plain Python floats in a fixed order (sorted arm names, `math.fsum` for sums over arms), so a
replay of the same records gives the same numbers bit for bit.

Sources: the log-linear loss in an arm's own data, L_j = a_j - b_j ln n_j, whose mean-optimal
mixture is p_j proportional to b_j (data mixing laws: Ye et al. 2024 "Data Mixing Laws"; Aioli,
Chen et al. ICLR 2025, fits the same per-arm linear dynamics online); the conservative move
between a baseline and a learnt policy from a lower confidence bound (Wu, Shariff, Lattimore,
Szepesvari, "Conservative Bandits", ICML 2016; Kazerouni et al. 2017 "Conservative Contextual
Linear Bandits"); training loss as the free online signal (ODM, Albalak et al. 2023; ADO, Jiang
et al. 2025 "Adaptive Data Optimization").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from statistics import NormalDist
from typing import AbstractSet as Set
from typing import Mapping

from proxy.mixture.box_projection import project_to_box

MIN_SHARE = 0.1  # the target keeps every arm at this fraction of its stratified share or more


@dataclasses.dataclass
class LineSums:
    """Running sums of points (x = ln step, y = mean training loss in nats) for the least-squares
    line y = a - b x. All fields plain numbers; `from_dict` inverts `dataclasses.asdict` exactly."""

    n: int = 0
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0

    def add(self, x: float, y: float) -> None:
        """Add one point (finite floats)."""
        self.n += 1
        self.sx += x
        self.sxx += x * x
        self.sy += y
        self.sxy += x * y
        self.syy += y * y

    def __add__(self, o: "LineSums") -> "LineSums":
        return LineSums(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(o))))

    def slope(self) -> tuple[float, float] | None:
        """(b, var_b): b = minus the least-squares slope of y on x (nats of loss per e-fold of
        steps; positive while the arm's loss falls), var_b = residual variance / Sxx, its
        sampling variance. None with fewer than 3 points or no spread in x."""
        if self.n < 3:
            return None
        sxx = self.sxx - self.sx * self.sx / self.n
        if not sxx > 0:
            return None
        sxy = self.sxy - self.sx * self.sy / self.n
        syy = self.syy - self.sy * self.sy / self.n
        beta = sxy / sxx
        resid = max(0.0, syy - beta * sxy) / (self.n - 2)
        return -beta, resid / sxx

    @classmethod
    def from_dict(cls, d: Mapping) -> "LineSums":
        return cls(int(d["n"]), *(float(d[k]) for k in ("sx", "sxx", "sy", "sxy", "syy")))


@dataclasses.dataclass
class ArmFit:
    """One arm's loss trend over the last two doublings of the step
    (docs/bandit.md#the-default-policy): the points of the newest point's block
    [2^k, 2^(k+1)) of steps and of the block before it, so the line spans the last half to the
    last three quarters of the steps so far (ln 2 to ln 4 in x) and its slope is the loss's
    present rate of fall, not its mean since the phase began. A loss that bends (a power law with
    a floor, Hoffmann et al. 2022) falls more slowly the longer it is trained; a fit over the
    whole phase keeps the early fall for ever. Constant state (two `LineSums`); `to_dict`/`from_dict` exact."""

    block: int = -1  # k of the newest point; -1 before any
    current: LineSums = dataclasses.field(default_factory=LineSums)
    previous: LineSums = dataclasses.field(default_factory=LineSums)

    def add(self, step: int, x: float, y: float) -> None:
        """Add the point (x, y) of a period that ends at `step` (an int >= 1; its block is
        floor(log2 step)); a point of a later block shifts the window."""
        block = step.bit_length() - 1
        if block > self.block:
            self.previous = self.current if block == self.block + 1 else LineSums()
            self.current, self.block = LineSums(), block
        self.current.add(x, y)

    @property
    def n(self) -> int:
        """Points in the window."""
        return self.current.n + self.previous.n

    def slope(self) -> tuple[float, float] | None:
        """`LineSums.slope` of the window's points."""
        return (self.previous + self.current).slope()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ArmFit":
        return cls(
            int(d["block"]), LineSums.from_dict(d["current"]), LineSums.from_dict(d["previous"])
        )


@dataclasses.dataclass
class Move:
    """What `conservative_mixture` decides: `target` {arm: p} (the policy pi), `lam` in [0, 1],
    `gain` and `gain_se` (nats of mean loss over arms, the model's estimate of pi's gain over
    stratified and its standard error), `slopes` {arm: (b, se_b)} of the arms counted as evidence,
    `slow` the arms judged not learnable (`learnable_arms`), sorted; `paid` the arms whose floor
    `repayment` raised above their stratified share, sorted."""

    target: dict[str, float]
    lam: float
    gain: float
    gain_se: float
    slopes: dict[str, tuple[float, float]]
    slow: tuple[str, ...] = ()
    paid: tuple[str, ...] = ()


def conservative_mixture(
    arms: list[str],
    fits: Mapping[str, ArmFit],
    floors: Mapping[str, float],
    caps: Mapping[str, float],
    stratified: Mapping[str, float],
    repeated: set[str] | frozenset[str],
    z: float,
    min_periods: int,
    rule: str = "ratio",
    learnable_ratio: float = 0.0,
    slow: Set[str] = frozenset(),
    held: Set[str] = frozenset(),
    owed: Mapping[str, float] | None = None,
    period_steps: int = 1,
) -> Move:
    """The default policy's move (docs/bandit.md#the-default-policy).

    Arms with at least `min_periods` fitted points are evidence; the rest stay at their
    stratified share s_i. Over the evidence arms, with M their stratified mass,

        pi   = M * project_to_box(b+ / sum b+, floors' / M, caps' / M)
               floors'_i = max(floor_i, MIN_SHARE s_i); caps'_i = min(cap_i, s_i) for `repeated` arms
        G    = (1/K) sum_i b_i ln(pi_i / s_i)                           the log-linear model's gain, nats
        SE   = (1/K) sqrt(sum_i ln(pi_i / s_i)^2 var(b_i))              arms taken as independent
        lam  = max(0, 1 - z SE / G) when G > 0, else 0                  rule "ratio": lam G = G - z SE
        lam  = argmax over lam in {0, 0.01, .., 1} of G(lam) - z SE(lam)   rule "max_bound"
        lam  = 1 when G - z SE > 0, else 0                              rule "gate"
               G(lam), SE(lam): G and SE at p(lam) = (1 - lam) s + lam pi instead of pi
        lam  = 1 when some evidence arm is slow or paid back and pi != s, else 0
                                                                learnable_ratio > 0 (any rule)

    b+ = max(b, 0). floors' keep every arm at MIN_SHARE (a tenth) of its stratified share or
    more, so no arm is starved and ln(pi_i / s_i) >= ln(MIN_SHARE). All b+ zero, or fewer than
    two evidence arms, gives pi = s and lam = 0.
    pi maximises sum_i b_i ln pi_i in the box (its KKT conditions are exactly the KL
    projection of b / sum b), the mean-optimal mixture of the log-linear model. `stratified`
    must lie inside floors/caps (proxy/mixture/bandit.py computes it so). `rule` is "ratio",
    "max_bound" (the mixture on the segment from s to pi whose lower confidence bound on the
    gain is largest; stratified when the bound at pi is not positive) or "gate" (the default
    policy's, docs/bandit.md#the-default-policy: pi itself once its lower confidence bound is
    positive, stratified until then).

    With learnable_ratio > 0 (the default policy's, docs/bandit.md#learnable-arms-keep-their-share)
    floors'_i = s_i for every learnable arm (`learnable_arms`, given the arms judged slow at the
    last refit as `slow`, those the repetition guard holds as `held` and the `repeated` ones as
    `stale`), so pi takes share only from slow arms, each surely learning at under
    learnable_ratio times the fastest rate, and gives it to faster ones; that test is the
    evidence. A learnable arm's floor is moved by `repayment` of `owed` {arm: share-steps} over
    periods of `period_steps` steps (docs/bandit.md#lowered-arms-get-their-share-back): a lowered
    arm that learns again rises above s_i, the learnable arms that took its share fall below it.
    lam is 1 exactly when some arm is slow or paid back and pi differs from s (the learnable
    arms may all be capped at s: past one epoch, or by their caps; G and SE are still reported).
    Returns a Move; its `gain` and `gain_se` are those of pi, its `slow` the arms judged slow
    now, its `paid` the arms paid back."""
    k = len(arms)
    fitted = {a: fits[a].slope() for a in arms if a in fits and fits[a].n >= min_periods}
    est = {a: s for a, s in fitted.items() if s is not None}
    target = {a: stratified[a] for a in arms}
    slopes = {a: (b, math.sqrt(v)) for a, (b, v) in est.items()}
    none = Move(target, 0.0, 0.0, 0.0, slopes, tuple(sorted(set(slow) & set(arms))))
    free = sorted(est)
    mass = math.fsum(stratified[a] for a in free)
    plus = {a: max(0.0, est[a][0]) for a in free}
    total = math.fsum(plus.values())
    if len(free) < 2 or not mass > 0 or not total > 0:
        return none
    cap = {a: (min(caps[a], stratified[a]) if a in repeated else caps[a]) for a in free}
    keep = learnable_arms(
        slopes, {a: fits[a].n for a in free}, z, learnable_ratio, slow, held, repeated
    )
    low = {
        a: stratified[a] if a in keep else max(floors[a], MIN_SHARE * stratified[a]) for a in free
    }
    back = repayment(
        keep, owed or {}, stratified, floors, cap, set(repeated) | set(held), period_steps
    )
    low.update({a: min(cap[a], low[a] + d) for a, d in back.items()})
    sub = project_to_box(
        {a: plus[a] / total for a in free},
        {a: min(1.0, low[a] / mass) for a in free},
        {a: min(1.0, cap[a] / mass) for a in free},
    )
    target.update({a: mass * sub[a] for a in free})
    # a share the projection left at s_i (up to its rounding) has moved nowhere
    logs = {a: math.log(target[a] / stratified[a]) for a in free}
    logs = {a: 0.0 if abs(v) < 1e-12 else v for a, v in logs.items()}
    gain, se = _gain(est, logs, k)
    judged = tuple(sorted(a for a in free if a not in keep)) if learnable_ratio > 0 else ()
    if learnable_ratio > 0:  # the test is the gate; a target with nowhere to move is s itself
        lam = 1.0 if (judged or back) and any(logs.values()) else 0.0
    elif not gain - z * se > 0:
        lam = 0.0
    elif rule == "gate":
        lam = 1.0
    elif rule == "max_bound":
        lam = _max_bound_lam(free, est, stratified, target, k, z)
    elif se == 0:
        lam = 1.0
    else:
        lam = max(0.0, 1.0 - z * se / gain)
    paid = tuple(sorted(a for a, d in back.items() if d > 0))
    return Move(target, lam, gain, se, slopes, judged, paid)


OWED_EPS = 1e-6  # share-steps: a debt or credit smaller than this is rounding, not owed


def repayment(
    keep: Set[str],
    owed: Mapping[str, float],
    stratified: Mapping[str, float],
    floors: Mapping[str, float],
    cap: Mapping[str, float],
    capped: Set[str],
    period_steps: int,
) -> dict[str, float]:
    """{arm: change of its floor} that gives a learnable arm back the share it was denied
    (docs/bandit.md#lowered-arms-get-their-share-back), as fast as the box allows.

    `owed` {arm: share-steps}: the sum over the phase's steps of stratified minus posted share
    (a deficit counter, as in deficit round robin: Shreedhar & Varghese, SIGCOMM 1995). A
    debtor (in `keep`, owed > OWED_EPS, not in `capped`: arms past one epoch or held by the
    repetition guard, which may not rise) may rise to its cap, by at most owed / `period_steps`
    (the debt paid in one period); a creditor (in `keep`, owed < -OWED_EPS) may fall to
    max(floor, MIN_SHARE s), by at most its credit / `period_steps`. The debtors' rises and the
    creditors' falls are both scaled to the smaller of their totals, so the changes sum to 0 (up
    to rounding); {} when nothing is owed or no learnable arm has a credit to pay it from.
    `floors` and `cap` (the target's caps, `conservative_mixture`) hold every arm of `keep`."""
    rise = {
        a: min(cap[a] - stratified[a], owed[a] / period_steps)
        for a in sorted(keep)
        if owed.get(a, 0.0) > OWED_EPS and a not in capped
    }
    fall = {
        a: min(stratified[a] - max(floors[a], MIN_SHARE * stratified[a]), -owed[a] / period_steps)
        for a in sorted(keep)
        if owed.get(a, 0.0) < -OWED_EPS
    }
    rise = {a: v for a, v in rise.items() if v > 0}
    fall = {a: v for a, v in fall.items() if v > 0}
    up, down = math.fsum(rise.values()), math.fsum(fall.values())
    paid = min(up, down)
    if not paid > 0:
        return {}
    out = {a: v * (paid / up) for a, v in rise.items()}  # the ratio is 1.0 exactly when paid == up
    out.update({a: -v * (paid / down) for a, v in fall.items()})
    return out


def _gain(
    est: Mapping[str, tuple[float, float]], logs: Mapping[str, float], k: int
) -> tuple[float, float]:
    """(G, SE) of `conservative_mixture` for the log-shares `logs` {arm: ln(p_i / s_i)}."""
    g = math.fsum(est[a][0] * logs[a] for a in logs) / k
    return g, math.sqrt(math.fsum(logs[a] * logs[a] * est[a][1] for a in logs)) / k


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with `df` >= 1 degrees of freedom: the exact finite series of
    Abramowitz & Stegun 26.7.3-4 (df / 2 terms), to about 1e-15 absolute; clamped to [0, 1]."""
    th = math.atan(t / math.sqrt(df))
    c2, even = math.cos(th) ** 2, df % 2 == 0
    term = total = 1.0 if even else math.cos(th)
    for k in range(2 if even else 3, df - 1, 2):
        term *= c2 * (k - 1) / k
        total += term
    if even:
        two_sided = math.sin(abs(th)) * total
    else:
        two_sided = 2 / math.pi * (abs(th) + (math.sin(abs(th)) * total if df > 1 else 0.0))
    return min(1.0, max(0.0, 0.5 + math.copysign(two_sided / 2, t)))


@functools.lru_cache(maxsize=4096)
def t_quantile(q: float, df: int) -> float:
    """The q-quantile (0 < q < 1) of Student's t with `df` >= 1 degrees of freedom: bisection on
    `t_cdf` to a relative 1e-9 (q < 0.5 by symmetry); above 200 df the Cornish-Fisher expansion of
    the normal quantile (Abramowitz & Stegun 26.7.5), within 1e-7 of it there. Raises ValueError
    for q outside (0, 1)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t_quantile: q = {q!r} must lie in (0, 1)")
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    z = NormalDist().inv_cdf(q)
    if df > 200:
        return (
            z
            + (z**3 + z) / (4 * df)
            + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
        )
    lo, hi = z, max(1.0, 2.0 * z)
    while t_cdf(hi, df) < q:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def learnable_arms(
    slopes: Mapping[str, tuple[float, float]],
    periods: Mapping[str, int],
    z: float,
    learnable_ratio: float,
    slow: Set[str] = frozenset(),
    held: Set[str] = frozenset(),
    stale: Set[str] = frozenset(),
) -> set[str]:
    """The arms of `slopes` {arm: (b, se_b)} that learn (docs/bandit.md#learnable-arms-keep-their-share):
    the upper confidence bound b + t se_b reaches learnable_ratio times the largest slope, t being
    Student's quantile at the normal's one-sided level of `z` with `periods[arm]` - 2 degrees of
    freedom (those of the fit's residual variance; `periods` >= 3). An arm of `slow` (judged not
    learnable at the last refit) learns again only once its lower bound b - t se_b reaches that
    level: a hysteresis, so that an arm whose share fell, and whose fit grew noisier with fewer
    tokens, does not flip back on noise alone. The largest slope is taken over the arms not in
    `held` (those the repetition guard holds, docs/bandit.md#the-repetition-guard): a trivially
    predictable source falls fastest for no real gain, and is no measure of what learning is.
    Nor over the `stale` arms (past one epoch: their fits stopped there, so their slopes are the
    rates of an earlier step, which a loss that bends no longer has) while at least two other
    arms are live and one of them learns (a lone live arm has nothing to be compared with).
    Empty when learnable_ratio is 0 (none kept) or no slope of an arm outside `held` is
    positive (none learns)."""
    not_live = set(held) | set(stale)
    live = [b for a, (b, _) in slopes.items() if a not in not_live]
    top = max(live, default=0.0)
    if len(live) < 2 or not top > 0:
        top = max((b for a, (b, _) in slopes.items() if a not in held), default=0.0)
    if not learnable_ratio > 0 or not top > 0:
        return set()
    q = NormalDist().cdf(z)
    out = set()
    for a, (b, se) in slopes.items():
        margin = t_quantile(q, max(1, periods[a] - 2)) * se
        if (b - margin if a in slow else b + margin) >= learnable_ratio * top:
            out.add(a)
    return out


LAM_STEPS = 100  # the max_bound rule searches lam on this many equal steps of [0, 1]


def _max_bound_lam(
    free: list[str],
    est: Mapping[str, tuple[float, float]],
    stratified: Mapping[str, float],
    target: Mapping[str, float],
    k: int,
    z: float,
) -> float:
    """The lam in {0, 1/LAM_STEPS, ..., 1} that maximises the lower confidence bound of the gain
    of p(lam) = (1 - lam) s + lam pi over s, G(lam) - z SE(lam) with G and SE as in
    `conservative_mixture` at p(lam) instead of pi; 0 when no lam > 0 has a positive bound
    (the smallest lam on a tie). Pessimism over the segment from stratified to the target:
    the conservative-bandit rule applied to every mixture on the way (Wu et al. 2016)."""
    best, best_lam = 0.0, 0.0
    for j in range(1, LAM_STEPS + 1):
        lam = j / LAM_STEPS
        logs = {
            a: math.log(((1.0 - lam) * stratified[a] + lam * target[a]) / stratified[a])
            for a in free
        }
        g, se = _gain(est, logs, k)
        bound = g - z * se
        if bound > best:
            best, best_lam = bound, lam
    return best_lam
