"""The data-mixture bandit: an EXP3-family policy over arms, held inside per-arm floors and caps.

What it is: the pure policy of `docs/bandit.md` -- configuration parsing
and validation, the exact KL projection onto the box, the quantile reward scaler, and the
`Bandit` state that folds one per-step training record at a time and round-trips through JSON.
What it is not: no file I/O, no locking, no torch. The proxy reads `.loss.json`, calls
`Bandit.observe` in step order, posts `Bandit.probabilities()` and writes `Bandit.to_dict()`
into `.state.json`.

Everything is keyed by arm NAME and iterated in sorted name order, and arithmetic is plain
Python floats with `math.fsum`, so replaying the same records gives the same state bit for bit.

Sources: docs/bandit.md; Graves et al. 2017 "Automated Curriculum Learning for Neural Networks"
(self prediction gain, 20/80-percentile reward scaling); Auer et al. 2002 "The Nonstochastic
Multiarmed Bandit Problem" (Exp3.S fixed share); Albalak et al. 2023 "Efficient Online Data
Mixing For Language Model Pre-Training" (ODM, the `train_loss` baseline).
"""
from __future__ import annotations

import bisect
import collections
import copy
import dataclasses
import math
from typing import Any, Iterable, Mapping

BOUND_SLACK = 1e-9          # tolerance on sum(floors) <= 1 <= sum(caps)
REWARDS = ("heldout_progress", "train_loss")
SCALER_CAPACITY = 1000      # raw rewards kept by QuantileScaler (the last N, no sampling)


class BanditConfigError(ValueError):
    """A bad operator setting (arm name, floor, cap, prior, config value), refused before training.

    Messages name the arm, the offending value, the rule and the fix (docs/architecture.md#bad-input-and-faults). Source: docs/bandit.md
    "State" (anything outside 0 <= floor <= cap <= 1, sum(floor) <= 1 <= sum(cap) is an error).
    """


def _g(x: float) -> str:
    return f"{x:.6g}"


def _check_arm_names(arm_names: Iterable[str]) -> list[str]:
    names = list(arm_names)
    if not names:
        raise BanditConfigError("no arms configured: the bandit needs at least one arm")
    for n in names:
        if not isinstance(n, str) or not n:
            raise BanditConfigError(f"arm name {n!r} is not a non-empty string")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BanditConfigError(f"arm name(s) {', '.join(dup)} listed more than once")
    return sorted(names)


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---------------------------------------------------------------------------------------------
# configuration text and bounds

def parse_arm_values(text: str, arm_names: list[str], what: str) -> dict[str, float]:
    """Parse operator text ``"repo-code=0.5,python-docs=0.2"`` into ``{arm: probability}``.

    `what` names the setting in messages (e.g. ``"--caps"``). Empty or blank text gives ``{}``;
    empty entries between commas are skipped. Values are probabilities (unitless, in [0, 1]).
    Raises BanditConfigError for an entry without ``=``, an unknown arm (the message lists the
    known arms), a duplicate arm, a value that is not a number, NaN, or outside [0, 1].
    Source: docs/architecture.md#bad-input-and-faults ("caps/floors infeasible, unknown arm names, bad numbers: refused
    before anything starts").
    """
    known = _check_arm_names(arm_names)
    out: dict[str, float] = {}
    if text is None or not text.strip():
        return out
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if "=" not in item:
            raise BanditConfigError(
                f"{what}: entry {item!r} is not ARM=VALUE; write e.g. {known[0]}=0.1")
        name, _, value_text = item.partition("=")
        name, value_text = name.strip(), value_text.strip()
        if name not in known:
            raise BanditConfigError(
                f"{what}: unknown arm {name!r}; known arms: {', '.join(known)}")
        if name in out:
            raise BanditConfigError(f"{what}: arm {name!r} given twice; give each arm once")
        try:
            v = float(value_text)
        except ValueError:
            raise BanditConfigError(
                f"{what}: arm {name!r} value {value_text!r} is not a number; "
                f"write a probability in [0, 1] such as {name}=0.1") from None
        if math.isnan(v):
            raise BanditConfigError(
                f"{what}: arm {name!r} value {value_text!r} is NaN; a probability in [0, 1] is needed")
        if not 0.0 <= v <= 1.0:
            raise BanditConfigError(
                f"{what}: arm {name!r} value {_g(v)} is outside [0, 1]; {what} values are probabilities")
        out[name] = v
    return out


def _check_bounds(names: list[str], floors: Mapping[str, float], caps: Mapping[str, float]) -> None:
    for kind, given in (("floor", floors), ("cap", caps)):
        for n in names:
            v = given[n]
            if not _real(v) or not 0.0 <= v <= 1.0:
                raise BanditConfigError(
                    f"arm {n!r}: {kind} {v!r} is not a probability in [0, 1]")
    bad = [n for n in names if floors[n] > caps[n]]
    if bad:
        detail = ", ".join(f"{n} (floor {_g(floors[n])} > cap {_g(caps[n])})" for n in bad)
        raise BanditConfigError(
            f"floor above cap for arm(s) {detail}: each arm needs floor <= cap; "
            f"lower the floor or raise the cap")
    sf = math.fsum(floors[n] for n in names)
    if sf > 1.0 + BOUND_SLACK:
        detail = ", ".join(f"{n}={_g(floors[n])}" for n in names if floors[n] > 0)
        raise BanditConfigError(
            f"sum of floors = {_g(sf)} > 1 ({detail}): the floors alone exceed a whole batch; "
            f"lower some floors")
    sc = math.fsum(caps[n] for n in names)
    if sc < 1.0 - BOUND_SLACK:
        detail = ", ".join(f"{n}={_g(caps[n])}" for n in names)
        raise BanditConfigError(
            f"sum of caps = {_g(sc)} < 1 ({detail}): the caps cannot hold a whole batch; "
            f"raise some caps")


def resolve_bounds(arm_names: list[str], caps: Mapping[str, float] | None,
                   floors: Mapping[str, float] | None) -> tuple[dict[str, float], dict[str, float]]:
    """Complete and validate per-arm bounds; returns ``(caps, floors)`` (the argument order).

    Arms not given get floor 0.0 and cap 1.0. Checks, per docs/bandit.md#state: every value a
    probability in [0, 1]; floor <= cap per arm; sum(floors) <= 1 and sum(caps) >= 1 (slack
    1e-9). Raises BanditConfigError naming the unknown arm (with the known ones), the arm(s)
    whose floor exceeds the cap, or the sum and its terms.
    """
    names = _check_arm_names(arm_names)
    caps, floors = dict(caps or {}), dict(floors or {})
    for kind, given in (("caps", caps), ("floors", floors)):
        for n in given:
            if n not in names:
                raise BanditConfigError(
                    f"{kind}: unknown arm {n!r}; known arms: {', '.join(names)}")
    full_f = {n: floors.get(n, 0.0) for n in names}
    full_c = {n: caps.get(n, 1.0) for n in names}
    _check_bounds(names, full_f, full_c)
    return ({n: float(full_c[n]) for n in names}, {n: float(full_f[n]) for n in names})


# ---------------------------------------------------------------------------------------------
# the exact KL projection onto the box

def _clip(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _solve_box(q: list[float], lo: list[float], hi: list[float], target: float) -> list[float]:
    """p_i = clip(c q_i, lo_i, hi_i) with sum p = target; all q_i > 0. c from the breakpoints."""
    if target <= math.fsum(lo):
        return list(lo)
    if target >= math.fsum(hi):
        return list(hi)
    k = len(q)
    lb = [lo[i] / q[i] for i in range(k)]
    ub = [hi[i] / q[i] for i in range(k)]

    def f(c: float) -> float:
        return math.fsum(_clip(c * q[i], lo[i], hi[i]) for i in range(k))

    # f is continuous, piecewise linear and non-decreasing, f(0) = sum lo < target < f(inf).
    bps = sorted({0.0, *lb, *ub})
    prev, b = bps[0], bps[-1]
    for cand in bps[1:]:
        if f(cand) >= target:
            b = cand
            break
        prev = cand
    # Within [prev, b] the free set is fixed, so c solves one linear equation exactly:
    # c = rest / sum(q_free). Written as p_i = rest * q_i / sum(q_free) so tiny q cannot overflow c.
    at_floor = [i for i in range(k) if lb[i] >= b]
    at_cap = [i for i in range(k) if ub[i] <= prev]
    free = [i for i in range(k) if lb[i] < b and ub[i] > prev]
    p = list(lo)
    for i in at_cap:
        p[i] = hi[i]
    sq = math.fsum(q[i] for i in free)
    if sq > 0:
        rest = target - math.fsum(lo[i] for i in at_floor) - math.fsum(hi[i] for i in at_cap)
        for i in free:
            p[i] = _clip(rest * (q[i] / sq), lo[i], hi[i])
    return _renormalise(p, q, lo, hi, target)


def _renormalise(p: list[float], q: list[float], lo: list[float], hi: list[float],
                 target: float) -> list[float]:
    """Remove the rounding residue target - sum(p), staying within [lo, hi].

    The residue goes first to arms strictly inside their bounds, in proportion to q (the exact
    KL correction), then, if none can take it, to arms with room in proportion to the room.
    """
    k = len(p)
    for _ in range(2 * k + 2):
        err = target - math.fsum(p)
        if err == 0.0:
            break
        inside = [i for i in range(k) if lo[i] < p[i] < hi[i]]
        si = math.fsum(q[i] for i in inside)
        if inside and si > 0:
            new = [_clip(p[i] + err * (q[i] / si), lo[i], hi[i]) for i in inside]
            if all(x == p[i] for x, i in zip(new, inside)):
                break                       # below one ulp everywhere: done
            for x, i in zip(new, inside):
                p[i] = x
            continue
        room = [(hi[i] - p[i]) if err > 0 else (p[i] - lo[i]) for i in range(k)]
        total = math.fsum(room)
        if total <= 0:
            break
        share = min(1.0, abs(err) / total)
        sign = 1.0 if err > 0 else -1.0
        new = [_clip(p[i] + sign * room[i] * share, lo[i], hi[i]) for i in range(k)]
        if new == p:
            break
        p = new
    return p


def project_to_box(q: Mapping[str, float], floors: Mapping[str, float],
                   caps: Mapping[str, float]) -> dict[str, float]:
    """The KL projection of weights `q` onto the box: argmin_p KL(p || q), floor <= p <= cap, sum 1.

    `q`: non-negative finite weights per arm (need not sum to 1). Floors/caps missing for an arm
    default to 0/1. Solution (docs/bandit.md#policy-softmax-then-the-projection-onto-the-box): p_i = clip(c q_i, floor_i, cap_i) with the
    one c > 0 that makes sum p = 1, found exactly by sorting the breakpoints floor_i/q_i and
    cap_i/q_i and solving the linear piece that crosses 1; the result is renormalised within
    bounds so sum p = 1 to rounding. Arms with q_i == 0 stay at their floor (KL forbids more)
    unless the positive arms all at their caps still fall short of 1; then the shortfall is
    spread over the zero arms as if they had equal infinitesimal weight (the limit of the KL
    solution). All q zero: the box projection of the uniform distribution.
    Raises BanditConfigError for infeasible bounds or unknown arms, ValueError for a negative,
    NaN or infinite weight. Example: q=[.90,.05,.03,.02], floors [.05,.05,.10,.05],
    caps [.5,.6,.6,.6] gives p=[.50,.25,.15,.10].
    """
    names = sorted(q)
    if not names:
        raise BanditConfigError("project_to_box: no arms")
    for kind, given in (("floors", floors), ("caps", caps)):
        extra = sorted(set(given) - set(names))
        if extra:
            raise BanditConfigError(
                f"{kind}: unknown arm(s) {', '.join(extra)}; known arms: {', '.join(names)}")
    lo_d = {n: floors.get(n, 0.0) for n in names}
    hi_d = {n: caps.get(n, 1.0) for n in names}
    _check_bounds(names, lo_d, hi_d)
    for n in names:
        if not _real(q[n]) or q[n] < 0:
            raise ValueError(f"project_to_box: arm {n!r} weight {q[n]!r} is not a finite number >= 0")
    top = max(float(q[n]) for n in names)
    qn = {n: (float(q[n]) / top if top > 0 else 0.0) for n in names}   # max 1: no overflow
    pos = [n for n in names if qn[n] > 0]
    zero = [n for n in names if qn[n] <= 0]
    out: dict[str, float] = {}
    cap_pos = math.fsum(hi_d[n] for n in pos)
    floor_zero = math.fsum(lo_d[n] for n in zero)
    if pos and cap_pos + floor_zero >= 1.0:
        vals = _solve_box([qn[n] for n in pos], [lo_d[n] for n in pos],
                          [hi_d[n] for n in pos], 1.0 - floor_zero)
        out.update(zip(pos, vals))
        out.update((n, float(lo_d[n])) for n in zero)
    else:
        out.update((n, float(hi_d[n])) for n in pos)
        vals = _solve_box([1.0] * len(zero), [lo_d[n] for n in zero],
                          [hi_d[n] for n in zero], 1.0 - cap_pos)
        out.update(zip(zero, vals))
    return {n: out[n] for n in names}


# ---------------------------------------------------------------------------------------------
# reward scaling

class QuantileScaler:
    """Maps a raw reward to [-1, 1] by the 20th/80th percentiles of past raw rewards.

    Source: Graves et al. 2017 (section 3, reward scaling), docs/bandit.md#rewards. The reservoir
    is the last `capacity` (default 1000) finite raw rewards, in arrival order, with no
    randomness, so a replay reproduces it. Percentiles use linear interpolation between order
    statistics (numpy's default "linear" method). `scale(r)`: r <= q20 -> -1, r >= q80 -> +1,
    linear between. Degenerate reservoirs: empty -> 0.0; when q80 == q20 (one value, or all
    equal) the result is sign-based: +1 above, -1 below, 0.0 equal. Units: those of the reward
    (nats of loss decrease, or nats of loss for `train_loss`) in, unitless out.
    """

    def __init__(self, capacity: int = SCALER_CAPACITY, low: float = 0.2, high: float = 0.8):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise BanditConfigError(f"QuantileScaler capacity {capacity!r} must be an int >= 1")
        if not (_real(low) and _real(high) and 0.0 <= low < high <= 1.0):
            raise BanditConfigError(f"QuantileScaler quantiles ({low!r}, {high!r}) need 0 <= low < high <= 1")
        self.capacity, self.low, self.high = capacity, float(low), float(high)
        self._recent: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, r: float) -> None:
        """Append one raw reward (finite float; -0.0 stored as 0.0), dropping the oldest past capacity.

        Raises ValueError for NaN or infinity (callers skip those before they get here).
        """
        if not _real(r):
            raise ValueError(f"QuantileScaler.add: reward {r!r} is not a finite number")
        r = float(r) + 0.0
        self._recent.append(r)
        bisect.insort(self._sorted, r)
        if len(self._recent) > self.capacity:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def quantile(self, frac: float) -> float:
        """The `frac` quantile (0..1) of the reservoir; raises ValueError when it is empty."""
        s = self._sorted
        if not s:
            raise ValueError("QuantileScaler.quantile: empty reservoir")
        pos = (len(s) - 1) * frac
        i = int(math.floor(pos))
        j = min(i + 1, len(s) - 1)
        return s[i] + (s[j] - s[i]) * (pos - i)

    def scale(self, r: float) -> float:
        """Raw reward -> [-1, 1] (see class docstring for the degenerate cases)."""
        if not self._sorted:
            return 0.0
        q20, q80 = self.quantile(self.low), self.quantile(self.high)
        if q80 <= q20:
            return 1.0 if r > q80 else -1.0 if r < q20 else 0.0
        if r <= q20:
            return -1.0
        if r >= q80:
            return 1.0
        return _clip(-1.0 + 2.0 * (r - q20) / (q80 - q20), -1.0, 1.0)

    def to_dict(self) -> dict:
        """JSON-safe state: capacity, quantiles and the reservoir in arrival order."""
        return {"capacity": self.capacity, "low": self.low, "high": self.high,
                "values": list(self._recent)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantileScaler":
        """Inverse of `to_dict`; raises ValueError (or BanditConfigError) on malformed input."""
        try:
            s = cls(int(d["capacity"]), float(d["low"]), float(d["high"]))
            for v in d["values"]:
                s.add(v)
        except (KeyError, TypeError) as e:
            raise ValueError(f"scaler state malformed ({e!r}); rebuild the bandit by replay") from None
        return s


# ---------------------------------------------------------------------------------------------
# the bandit

@dataclasses.dataclass
class BanditConfig:
    """Bandit knobs (docs/bandit.md#rewards, docs/bandit.md#update); validated on construction.

    Raises BanditConfigError naming the field, the value and the allowed range.
    """
    reward: str = "heldout_progress"   # "heldout_progress" (Graves 2017) | "train_loss" (ODM, Albalak 2023)
    eta: float = 0.05                  # learning rate on log-weights, nats per update per unit scaled reward
    discount: float = 0.999            # lambda: log-weight decay per update, (0, 1]
    share: float = 0.01                # alpha: Exp3.S fixed-share mixing per update (Auer 2002), [0, 1)
    warmup_steps: int = 200            # steps after the phase start on the prior before the first update
    ema_beta: float = 0.9              # decay of the per-arm reward EMA (bias-corrected), [0, 1)
    epochs_discount: bool = False      # multiply rewards by 1/(1 + epochs_i) when records carry "epochs"
    center_progress: bool = True       # heldout_progress: subtract the probe's mean over arms before scaling

    def __post_init__(self):
        def bad(field: str, value: Any, rule: str) -> BanditConfigError:
            return BanditConfigError(f"bandit config: {field} = {value!r} {rule}")
        if self.reward not in REWARDS:
            raise bad("reward", self.reward, f"is not one of {', '.join(REWARDS)}")
        if not _real(self.eta) or self.eta <= 0:
            raise bad("eta", self.eta, "must be a finite number > 0 (default 0.05)")
        if not _real(self.discount) or not 0.0 < self.discount <= 1.0:
            raise bad("discount", self.discount, "must be in (0, 1] (default 0.999)")
        if not _real(self.share) or not 0.0 <= self.share < 1.0:
            raise bad("share", self.share, "must be in [0, 1) (default 0.01)")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) \
                or self.warmup_steps < 0:
            raise bad("warmup_steps", self.warmup_steps, "must be an int >= 0 (default 200)")
        if not _real(self.ema_beta) or not 0.0 <= self.ema_beta < 1.0:
            raise bad("ema_beta", self.ema_beta, "must be in [0, 1) (default 0.9)")
        if not isinstance(self.epochs_discount, bool):
            raise bad("epochs_discount", self.epochs_discount, "must be true or false")
        if not isinstance(self.center_progress, bool):
            raise bad("center_progress", self.center_progress, "must be true or false")
        self.eta, self.discount, self.share = float(self.eta), float(self.discount), float(self.share)
        self.ema_beta = float(self.ema_beta)

    def to_dict(self) -> dict:
        """JSON-safe field dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BanditConfig":
        """Inverse of `to_dict`; unknown keys raise BanditConfigError."""
        names = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(d) - names)
        if extra:
            raise BanditConfigError(
                f"bandit config: unknown field(s) {', '.join(extra)}; known: {', '.join(sorted(names))}")
        return cls(**dict(d))


def _record_phase(record: Mapping[str, Any]) -> int | None:
    if "phase_index" in record:
        return int(record["phase_index"])
    ph = record.get("phase")
    if isinstance(ph, Mapping) and "index" in ph:
        return int(ph["index"])
    return None


def _finite_or_none(x: Any) -> float | None:
    return float(x) if _real(x) else None


class Bandit:
    """EXP3-family mixture policy for one phase, keyed by arm name (docs/bandit.md).

    State: log-weights `logw` (max re-centred to 0; -inf allowed only from a zero prior),
    `floors`/`caps` (probabilities), `pulls` (this phase) and `pulls_lifetime` (sequences),
    reward EMA per arm, the QuantileScaler, phase counters, `version` (+1 per posted policy),
    `step` (the last record folded in). Policy: `probabilities()` = project(softmax(logw)).
    Update per reward: discounted Hedge (lambda, eta) then the Exp3.S fixed share (alpha) of
    Auer et al. 2002. Rewards: `heldout_progress` (Graves et al. 2017) or `train_loss` (ODM,
    Albalak et al. 2023). Constructor raises BanditConfigError for bad arms, bounds or prior.
    """

    def __init__(self, arm_names: list[str], floors: Mapping[str, float] | None,
                 caps: Mapping[str, float] | None, config: BanditConfig,
                 prior: Mapping[str, float] | None = None, phase_label: str = "initial",
                 phase_index: int = 0, phase_start_step: int = 0):
        if not isinstance(config, BanditConfig):
            raise BanditConfigError(f"config must be a BanditConfig, got {type(config).__name__}")
        self.arms: list[str] = _check_arm_names(arm_names)
        self.caps, self.floors = resolve_bounds(self.arms, caps, floors)
        self.config = config
        self.phase_label = str(phase_label)
        self.phase_index = int(phase_index)
        self.phase_start_step = int(phase_start_step)
        self.step = self.phase_start_step
        self.version = 0
        self.updates = 0            # log-weight updates this phase
        self.steps = 0              # records folded this phase
        self.scaler = QuantileScaler()
        self.retired: dict[str, dict] = {}
        self.added: dict[str, dict] = {}     # arms that joined after the phase start (add_arm)
        self.pulls = {a: 0 for a in self.arms}
        self.pulls_lifetime = {a: 0 for a in self.arms}
        self.ema_acc = {a: 0.0 for a in self.arms}   # uncorrected EMA accumulator
        self.ema_n = {a: 0 for a in self.arms}
        self.last_probe: dict[str, float | None] = {a: None for a in self.arms}
        if prior is None:
            raw = {a: 1.0 for a in self.arms}
        else:
            extra = sorted(set(prior) - set(self.arms))
            if extra:
                raise BanditConfigError(
                    f"prior: unknown arm(s) {', '.join(extra)}; known arms: {', '.join(self.arms)}")
            raw = {a: prior.get(a, 0.0) for a in self.arms}
            for a, v in raw.items():
                if not _real(v) or v < 0:
                    raise BanditConfigError(f"prior: arm {a!r} weight {v!r} must be a finite number >= 0")
            if math.fsum(raw.values()) <= 0:
                raw = {a: 1.0 for a in self.arms}
        self.prior = project_to_box(raw, self.floors, self.caps)
        logw = {a: (math.log(v) if v > 0 else -math.inf) for a, v in self.prior.items()}
        top = max(logw.values())
        self.logw = {a: v - top for a, v in logw.items()}

    # -- policy -----------------------------------------------------------------------------
    def probabilities(self) -> dict[str, float]:
        """project(softmax(logw)) as {arm: probability}, sorted by name; always inside the box."""
        top = max(self.logw.values())
        w = {a: math.exp(self.logw[a] - top) for a in self.arms}
        tot = math.fsum(w.values())
        return project_to_box({a: w[a] / tot for a in self.arms}, self.floors, self.caps)

    @property
    def ema_reward(self) -> dict[str, float]:
        """Bias-corrected EMA of each arm's scaled reward, acc / (1 - beta^n); 0.0 before any."""
        b = self.config.ema_beta
        return {a: (self.ema_acc[a] / (1.0 - b ** self.ema_n[a]) if self.ema_n[a] else 0.0)
                for a in self.arms}

    # -- feedback ---------------------------------------------------------------------------
    def observe(self, record: Mapping[str, Any]) -> bool:
        """Fold one per-step training record into the state; True when logw changed.

        Record fields: "step" (int), "phase_index" (int; or "phase": {"index": int}), "arms"
        {arm: sequences drawn}, "p" {arm: probability recorded when the batch was drawn},
        "arm_loss" {arm: mean train loss, nats}, "probe" {arm: held-out probe loss, nats} or
        None, "batch_size" (int; defaults to the sum of "arms"), optional "epochs" {arm: epochs}.
        Records of another phase (or untagged) and records with step <= self.step are ignored
        (False). Arms not in `self.arms` (retired, unknown) are ignored. Non-finite losses, and
        `train_loss` feedback for an arm whose recorded p is missing or <= 0, are skipped.
        Rewards (docs/bandit.md#rewards): heldout_progress = previous probe - this probe per arm,
        full information (the first probe of a phase only sets the baseline), minus the mean
        over the arms of that probe when `center_progress` (default): the update is invariant
        to a shift common to every arm, so centring loses nothing, but without it the shared
        trend (every arm's progress shrinks as training goes on) pushes late rewards below the
        reservoir's 20th percentile, where all arms score -1 and the arms' differences are
        lost (scripts/bench_mixture.py: 48 % of scaled rewards at -1 without, 13 % with); train_loss =
        g_i = n_i s_i / (B p_i) with s_i the scaled train loss (0 for n_i == 0). Raw rewards
        enter the QuantileScaler, then are scaled to [-1, 1]; the EMA sees the scaled value.
        No log-weight update during warm-up (step <= phase start + warmup_steps) or when the
        record carries no reward. Raises ValueError for a record without a usable "step" or
        with negative or non-integer counts (nothing is changed then).
        """
        try:
            step = int(record["step"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"bandit record without an integer 'step': {record!r:.200}") from None
        if _record_phase(record) != self.phase_index or step <= self.step:
            return False
        counts = record.get("arms") or {}
        n: dict[str, int] = {}
        for a in self.arms:
            v = counts.get(a, 0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
                raise ValueError(f"step {step}: arm {a!r} count {v!r} is not an integer >= 0")
            n[a] = int(v)
        for a in self.arms:
            self.pulls[a] += n[a]
            self.pulls_lifetime[a] += n[a]
        self.step = step
        self.steps += 1
        if self.config.reward == "heldout_progress":
            g = self._heldout_rewards(record)
        else:
            g = self._train_loss_rewards(record, n)
        if not g or step <= self.phase_start_step + self.config.warmup_steps:
            return False
        self._update(g)
        return True

    def _multiplier(self, record: Mapping[str, Any], a: str) -> float:
        if not self.config.epochs_discount:
            return 1.0
        e = (record.get("epochs") or {}).get(a)
        return 1.0 / (1.0 + e) if _real(e) and e >= 0 else 1.0

    def _fold_scaled(self, raw: dict[str, float]) -> dict[str, float]:
        for a in sorted(raw):
            self.scaler.add(raw[a])
        b = self.config.ema_beta
        scaled = {}
        for a in sorted(raw):
            s = self.scaler.scale(raw[a])
            self.ema_acc[a] = b * self.ema_acc[a] + (1.0 - b) * s
            self.ema_n[a] += 1
            scaled[a] = s
        return scaled

    def _heldout_rewards(self, record: Mapping[str, Any]) -> dict[str, float]:
        probe = record.get("probe")
        if not probe:
            return {}
        raw = {}
        for a in self.arms:
            v = _finite_or_none(probe.get(a))
            if v is None:
                continue
            prev, self.last_probe[a] = self.last_probe[a], v
            if prev is not None:
                raw[a] = prev - v
        if self.config.center_progress and len(raw) > 1:
            mean = math.fsum(raw.values()) / len(raw)
            raw = {a: v - mean for a, v in raw.items()}
        scaled = self._fold_scaled(raw)
        return {a: s * self._multiplier(record, a) for a, s in scaled.items()}

    def _train_loss_rewards(self, record: Mapping[str, Any], n: dict[str, int]) -> dict[str, float]:
        losses = record.get("arm_loss") or {}
        p_rec = record.get("p") or {}
        bsz = record.get("batch_size") or sum(n.values())
        if not _real(bsz) or bsz <= 0:
            return {}
        raw, pr = {}, {}
        for a in self.arms:
            r, p = _finite_or_none(losses.get(a)), _finite_or_none(p_rec.get(a))
            if n[a] > 0 and r is not None and p is not None and p > 0:
                raw[a], pr[a] = r, p
        scaled = self._fold_scaled(raw)
        return {a: n[a] * s / (bsz * pr[a]) * self._multiplier(record, a) for a, s in scaled.items()}

    def _update(self, g: Mapping[str, float]) -> None:
        """logw' = lambda logw + eta g; Exp3.S share; re-centre (docs/bandit.md#update)."""
        lam, eta, alpha = self.config.discount, self.config.eta, self.config.share
        lw = {a: lam * self.logw[a] + eta * g.get(a, 0.0) for a in self.arms}
        k = len(self.arms)
        if k > 1 and alpha > 0:
            top = max(lw.values())
            w = {a: math.exp(lw[a] - top) for a in self.arms}
            mixed = {}
            for a in self.arms:
                others = math.fsum(w[b] for b in self.arms if b != a)
                m = (1.0 - alpha) * w[a] + alpha / (k - 1) * others
                mixed[a] = math.log(m) + top if m > 0 else -math.inf
            lw = mixed
        top = max(lw.values())
        self.logw = {a: lw[a] - top for a in self.arms}
        self.updates += 1
        self.version += 1

    # -- arms and phases --------------------------------------------------------------------
    def retire(self, name: str, reason: str) -> None:
        """Move arm `name` to the retired section (with `reason` and its stats); never pulled again.

        The remaining arms keep their floors and caps and are re-projected. Raises
        BanditConfigError for an unknown arm, the last arm, or when the remaining caps sum
        below 1 (the state is unchanged then). Source: docs/architecture.md#arms.
        """
        if name not in self.arms:
            raise BanditConfigError(f"retire: unknown arm {name!r}; active arms: {', '.join(self.arms)}")
        rest = [a for a in self.arms if a != name]
        if not rest:
            raise BanditConfigError(f"retire: {name!r} is the last arm; a run needs at least one")
        try:
            _check_bounds(rest, self.floors, self.caps)
        except BanditConfigError as e:
            raise BanditConfigError(f"retiring arm {name!r} leaves infeasible bounds: {e}") from None
        p = self.probabilities()
        lw = self.logw[name]
        self.retired[name] = {
            "reason": str(reason), "retired_at_step": self.step, "phase_index": self.phase_index,
            "pulls": self.pulls[name], "pulls_lifetime": self.pulls_lifetime[name],
            "ema_reward": self.ema_reward[name], "ema_n": self.ema_n[name],
            "p": p[name], "logw": lw if math.isfinite(lw) else None,
            "floor": self.floors[name], "cap": self.caps[name],
            "ema_acc": self.ema_acc[name], "prior": self.prior[name],
            "last_probe": self.last_probe[name]}
        self.arms = rest
        for d in (self.floors, self.caps, self.pulls, self.pulls_lifetime, self.ema_acc,
                  self.ema_n, self.last_probe, self.prior, self.logw):
            del d[name]
        top = max(self.logw.values())
        self.logw = {a: v - top for a, v in self.logw.items()}
        self.version += 1

    def add_arm(self, name: str, reason: str, floor: float = 0.0, cap: float = 1.0) -> None:
        """Let arm `name` join from the next record on (an arm added on a restart).

        A RETIRED arm re-joins with its statistics restored by name: pulls_lifetime always; when
        it was retired in this phase after the phase start also its phase pulls, reward EMA,
        probe baseline and log-weight (a retirement in an earlier phase, or at this phase's
        start, keeps only lifetime pulls: a pivot resets the rest for every arm anyway). A NEW arm starts with no statistics and the log-weight of
        an average arm, log(mean(exp(logw))), so it is neither favoured nor starved before its
        first reward. Bounds `floor`/`cap` (probabilities) are the phase's for that arm, 0 and 1
        when the phase does not name it. The join is listed under "added" in `to_dict()`.
        Raises BanditConfigError when the arm is already active, or the bounds are infeasible
        (nothing is changed then). Source: docs/architecture.md#arms.
        """
        if name in self.arms:
            raise BanditConfigError(f"add_arm: arm {name!r} is already active")
        arms = sorted(self.arms + [name])
        floors, caps = dict(self.floors), dict(self.caps)
        floors[name], caps[name] = float(floor), float(cap)
        _check_arm_names(arms)
        _check_bounds(arms, floors, caps)
        old = self.retired.pop(name, None)
        finite = [v for v in self.logw.values() if math.isfinite(v)]
        average = math.log(math.fsum(math.exp(v) for v in finite) / len(finite)) if finite else 0.0
        self.arms, self.floors, self.caps = arms, floors, caps
        self.pulls[name], self.pulls_lifetime[name] = 0, 0
        self.ema_acc[name], self.ema_n[name], self.last_probe[name] = 0.0, 0, None
        self.logw[name], self.prior[name] = average, 0.0
        if old is not None:
            self.pulls_lifetime[name] = int(old["pulls_lifetime"])
            if (old.get("phase_index") == self.phase_index and "ema_acc" in old
                    and old["retired_at_step"] > self.phase_start_step):
                self.pulls[name] = int(old["pulls"])
                self.ema_acc[name], self.ema_n[name] = float(old["ema_acc"]), int(old["ema_n"])
                self.last_probe[name] = _finite_or_none(old.get("last_probe"))
                if old["logw"] is not None:  # a zero-prior arm comes back as an average one
                    self.logw[name] = float(old["logw"])
                self.prior[name] = float(old.get("prior", 0.0))
        top = max(self.logw.values())
        self.logw = {a: self.logw[a] - top for a in self.arms}
        for d in (self.floors, self.caps, self.pulls, self.pulls_lifetime, self.ema_acc,
                  self.ema_n, self.last_probe, self.prior):
            items = sorted(d.items())
            d.clear()
            d.update(items)
        self.added[name] = {"step": self.step, "reason": str(reason),
                            "rejoined": old is not None}
        self.version += 1

    def pivot(self, new_floors: Mapping[str, float] | None, new_caps: Mapping[str, float] | None,
              label: str, start_step: int) -> "Bandit":
        """A fresh Bandit for the next phase (docs/bandit.md#polish-pivot).

        Prior = this bandit's current probabilities projected into the new box. Keeps
        pulls_lifetime and the retired section; resets logw, EMAs, the scaler, probe baselines,
        phase pulls and version. Phase index + 1, label `label`, phase start `start_step` (the
        pivot checkpoint's step B; records from B+1 on belong to it). Raises BanditConfigError
        for infeasible or unknown bounds.
        """
        nb = Bandit(self.arms, new_floors, new_caps, self.config, prior=self.probabilities(),
                    phase_label=label, phase_index=self.phase_index + 1, phase_start_step=start_step)
        nb.pulls_lifetime = dict(self.pulls_lifetime)
        nb.retired = copy.deepcopy(self.retired)
        return nb

    # -- persistence ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-serialisable state for `.state.json`; `from_dict` restores it exactly.

        Floats are Python floats (json round-trips them exactly); a -inf log-weight (zero prior)
        is written as null, as is a missing probe baseline.
        """
        p = self.probabilities()
        ema = self.ema_reward
        arms = {}
        for a in self.arms:
            lw = self.logw[a]
            arms[a] = {"pulls": self.pulls[a], "pulls_lifetime": self.pulls_lifetime[a],
                       "ema_reward": ema[a], "ema_n": self.ema_n[a], "ema_acc": self.ema_acc[a],
                       "p": p[a], "logw": lw if math.isfinite(lw) else None,
                       "prior": self.prior[a], "last_probe": self.last_probe[a]}
        return {"step": self.step,
                "phase": {"label": self.phase_label, "index": self.phase_index,
                          "started_at_step": self.phase_start_step, "updates": self.updates,
                          "steps": self.steps},
                "caps": dict(self.caps), "floors": dict(self.floors), "version": self.version,
                "config": self.config.to_dict(), "arms": arms, "scaler": self.scaler.to_dict(),
                "retired": copy.deepcopy(self.retired), "added": copy.deepcopy(self.added)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Bandit":
        """Rebuild a Bandit from `to_dict` output (after JSON). Raises ValueError when malformed
        (BanditConfigError when its bounds or config are invalid): rebuild by `replay` then."""
        try:
            config = BanditConfig.from_dict(d["config"])
            arms = d["arms"]
            ph = d["phase"]
            b = cls(list(arms), d["floors"], d["caps"], config, prior=None,
                    phase_label=ph["label"], phase_index=ph["index"],
                    phase_start_step=ph["started_at_step"])
            b.step = int(d["step"])
            b.version = int(d["version"])
            b.updates = int(ph.get("updates", 0))
            b.steps = int(ph.get("steps", 0))
            b.scaler = QuantileScaler.from_dict(d["scaler"])
            b.retired = copy.deepcopy(dict(d.get("retired") or {}))
            b.added = copy.deepcopy(dict(d.get("added") or {}))
            for a in b.arms:
                s = arms[a]
                b.pulls[a] = int(s["pulls"])
                b.pulls_lifetime[a] = int(s["pulls_lifetime"])
                b.ema_n[a] = int(s["ema_n"])
                b.ema_acc[a] = float(s["ema_acc"])
                b.logw[a] = -math.inf if s["logw"] is None else float(s["logw"])
                b.prior[a] = float(s["prior"])
                b.last_probe[a] = _finite_or_none(s["last_probe"])
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"bandit state malformed ({e!r}); rebuild it by replaying the history") from None
        return b


def replay(arm_names: list[str], floors: Mapping[str, float] | None,
           caps: Mapping[str, float] | None, config: BanditConfig,
           records: Iterable[Mapping[str, Any]], phase_index: int, phase_label: str,
           phase_start_step: int, prior: Mapping[str, float] | None = None,
           upto_step: int | None = None,
           lifetime_pulls: Mapping[str, int] | None = None) -> Bandit:
    """Build a Bandit for one phase and fold `records` in order (docs/bandit.md#determinism).

    Records of other phases, already-folded steps and (when `upto_step` is given) steps past
    `upto_step` are skipped. Replaying the same history gives `to_dict()` equal bit for bit;
    that is how a resume from an older checkpoint rebuilds `.state.json`. After a pivot, pass
    the phase's `prior` and `lifetime_pulls` (sequences per arm drawn before the phase start,
    e.g. summed from earlier phases' records) to reproduce the state exactly; arms retired in
    the live bandit must be retired again by the caller. Raises as `Bandit.__init__` and
    `Bandit.observe`, and BanditConfigError for an unknown arm in `lifetime_pulls`.
    """
    b = Bandit(arm_names, floors, caps, config, prior=prior, phase_label=phase_label,
               phase_index=phase_index, phase_start_step=phase_start_step)
    for a, v in (lifetime_pulls or {}).items():
        if a not in b.pulls_lifetime:
            raise BanditConfigError(
                f"lifetime_pulls: unknown arm {a!r}; known arms: {', '.join(b.arms)}")
        b.pulls_lifetime[a] = int(v)
    for rec in records:
        if upto_step is not None and int(rec["step"]) > upto_step:
            continue
        b.observe(rec)
    return b
