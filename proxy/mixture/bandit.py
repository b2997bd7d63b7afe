"""The data-mixture bandit: the default free-signal conservative policy, and EXP3-family
policies over arms, held inside per-arm floors and caps.

What it is: the pure policy of `docs/bandit.md`: `BanditConfig` and the `Bandit` state that
folds one per-step training record at a time and round-trips through JSON. The bounds' parsing
and checks are proxy/mixture/arm_bounds.py, the projection onto the box proxy/mixture/box_projection.py, the
reward scaler proxy/mixture/reward_scaler.py (their names are re-exported here).
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

import copy
import dataclasses
import math
from typing import Any, Mapping

from proxy.mixture.arm_bounds import (
    BOUND_SLACK,
    BanditConfigError,
    parse_arm_values,
    resolve_bounds,
)
from proxy.mixture.arm_bounds import check_arm_names as _check_arm_names
from proxy.mixture.arm_bounds import check_bounds as _check_bounds
from proxy.mixture.arm_bounds import is_real as _real
from proxy.mixture.box_projection import project_to_box
from proxy.mixture.loss_trend import ArmFit, conservative_mixture
from proxy.mixture.reward_scaler import QuantileScaler
from shared.data.redundancy import REPETITIVE_RATIO
from shared.run.config import REWARDS  # the reward names

__all__ = [
    "Bandit",
    "BanditConfig",
    "BanditConfigError",
    "QuantileScaler",
    "parse_arm_values",
    "project_to_box",
    "resolve_bounds",
]


LAMBDA_RULES = ("ratio", "max_bound", "gate")


def _flag(v: Any) -> bool:
    return isinstance(v, bool)


def _int_from(low: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _closed(low: float, high: float):
    return lambda v: _real(v) and low <= v <= high


def _unit(v: Any) -> bool:
    """A finite number in [0, 1)."""
    return _real(v) and 0.0 <= v < 1.0


@dataclasses.dataclass
class BanditConfig:
    """Bandit knobs (docs/bandit.md#rewards, docs/bandit.md#update); validated on construction.

    Raises BanditConfigError naming the field, the value and the allowed range.
    """

    # "train_slope" (free, conservative; docs/bandit.md#the-default-policy) | "heldout_progress"
    # (Graves 2017, reads the probe) | "train_loss" (ODM, Albalak 2023)
    reward: str = "train_slope"
    eta: float = 0.05  # learning rate on log-weights, nats per update per unit scaled reward
    discount: float = 0.999  # gamma: log-weight decay per update, (0, 1]
    share: float = 0.01  # alpha: Exp3.S fixed-share mixing per update (Auer 2002), [0, 1)
    warmup_steps: int = 200  # steps after the phase start on the prior before the first update
    ema_beta: float = 0.9  # decay of the per-arm reward EMA (bias-corrected), [0, 1)
    epochs_discount: bool = False  # multiply rewards by 1/(1 + epochs_i) when records carry epochs
    center_progress: bool = True  # heldout_progress: subtract the probe's mean over arms first
    progress_per_p: bool = False  # heldout_progress: divide each arm's progress by its mean p
    # heldout_progress: an arm whose probe loss is below this times the mean of the others' is
    # trivially predictable: it never out-scores the worst arm (the collapse trap,
    # docs/bandit.md#the-easy-arm-guard); 0 = off (default)
    easy_arm_ratio: float = 0.0
    # train_slope: the level of the learnable test (and, with learnable_ratio 0, z of the lower
    # confidence bound on the gain that sets lambda)
    confidence_z: float = 3.0
    # train_slope: an arm whose slope's upper bound (Student's t at the level of z) is at least
    # this fraction of the largest slope is never lowered below its stratified share, and the
    # target moves exactly when some arm is below it; 0 = off, the gain's bound then gates
    # (docs/bandit.md#learnable-arms-keep-their-share)
    learnable_ratio: float = 0.25
    min_periods: int = 4  # train_slope: policy periods of an arm's fit before it is evidence
    # train_slope: "gate" (the target itself once its lower confidence bound on the gain is
    # positive) | "max_bound" (the lam whose mixture has the largest lower bound) | "ratio"
    # (lam = 1 - z SE / G at the target); docs/bandit.md#the-default-policy
    lambda_rule: str = "gate"
    # repetition guard: an arm whose tokens compress at least this well
    # (shared/data/redundancy.py) is held at or below the p it has when the warm-up ends
    # (docs/bandit.md#the-repetition-guard); 0 = off
    repetitive_ratio: float = REPETITIVE_RATIO

    def __post_init__(self):
        rules = (  # (field, test, the rule a value that fails it breaks), checked in this order
            ("reward", lambda v: v in REWARDS, f"is not one of {', '.join(REWARDS)}"),
            ("eta", lambda v: _real(v) and v > 0, "must be a finite number > 0 (default 0.05)"),
            ("discount", lambda v: _real(v) and 0 < v <= 1, "must be in (0, 1] (default 0.999)"),
            ("share", _unit, "must be in [0, 1) (default 0.01)"),
            ("warmup_steps", _int_from(0), "must be an int >= 0 (default 200)"),
            ("ema_beta", _unit, "must be in [0, 1) (default 0.9)"),
            ("epochs_discount", _flag, "must be true or false"),
            ("center_progress", _flag, "must be true or false"),
            ("progress_per_p", _flag, "must be true or false"),
            ("easy_arm_ratio", _unit, "must be in [0, 1) (default 0 = off)"),
            ("confidence_z", _closed(0, 8), "must be a number in [0, 8] (default 3)"),
            ("learnable_ratio", _closed(0, 1), "must be in [0, 1] (default 0.25)"),
            ("min_periods", _int_from(3), "must be an int >= 3 (default 4)"),
            ("lambda_rule", lambda v: v in LAMBDA_RULES, "must be 'ratio', 'max_bound' or 'gate'"),
            (
                "repetitive_ratio",
                lambda v: _real(v) and (v == 0 or v >= 1),
                "must be 0 (off) or a ratio >= 1 (default 20)",
            ),
        )
        for field, ok, rule in rules:
            value = getattr(self, field)
            if not ok(value):
                raise BanditConfigError(f"bandit config: {field} = {value!r} {rule}")
        for f in dataclasses.fields(self):
            if f.type in ("float", float):  # text under postponed evaluation, else the type
                setattr(self, f.name, float(getattr(self, f.name)))

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
                f"bandit config: unknown field(s) {', '.join(extra)}; known: {', '.join(sorted(names))}"
            )
        return cls(**dict(d))


ARM_MAPS = ("arms", "p", "arm_loss", "arm_unigram_loss", "probe", "epochs")  # {arm: number} or None


def _record_phase(record: Mapping[str, Any]) -> int | None:
    if "phase_index" in record:
        return int(record["phase_index"])
    ph = record.get("phase")
    if isinstance(ph, Mapping) and "index" in ph:
        return int(ph["index"])
    return None


def _finite_or_none(x: Any) -> float | None:
    return float(x) if _real(x) else None


def _positive(m: Mapping[str, Any] | None) -> dict[str, float]:
    """The entries of `m` that are finite numbers > 0, as floats, sorted by arm."""
    return {a: float(v) for a, v in sorted((m or {}).items()) if _real(v) and v > 0}


class Bandit:
    """The mixture policy of one phase, keyed by arm name (docs/bandit.md).

    Default reward `train_slope` (docs/bandit.md#the-default-policy): per-arm fits of the
    pre-update training loss against ln(step) (`fits`, proxy/mixture/loss_trend.py), arms past one epoch
    (`repeated`), the share-steps each arm is owed (`owed`: stratified minus posted, summed over
    the phase's records), and the posted p = (1 - lam) stratified + lam target, lam from the
    learnable test (docs/bandit.md#learnable-arms-keep-their-share); `period_steps` (the
    policy period P) and `epoch_size` {arm: training windows per epoch} come from the run. The
    EXP3 machinery below serves the other two rewards.

    State: log-weights `logw` (max re-centred to 0; -inf allowed only from a zero prior),
    `floors`/`caps` (probabilities), `pulls` (this phase) and `pulls_lifetime` (sequences),
    reward EMA per arm, the QuantileScaler, phase counters, `version` (+1 per posted policy),
    `step` (the last record folded in). Policy: `probabilities()` = project(softmax(logw)).
    Update per reward: discounted Hedge (gamma, eta) then the Exp3.S fixed share (alpha) of
    Auer et al. 2002. Rewards: `heldout_progress` (Graves et al. 2017) or `train_loss` (ODM,
    Albalak et al. 2023). Constructor raises BanditConfigError for bad arms, bounds or prior.
    """

    def __init__(
        self,
        arm_names: list[str],
        floors: Mapping[str, float] | None,
        caps: Mapping[str, float] | None,
        config: BanditConfig,
        prior: Mapping[str, float] | None = None,
        phase_label: str = "initial",
        phase_index: int = 0,
        phase_start_step: int = 0,
        compression: Mapping[str, float] | None = None,
        period_steps: int = 25,
        epoch_size: Mapping[str, float] | None = None,
    ):
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
        self.updates = 0  # log-weight updates this phase
        self.steps = 0  # records folded this phase
        self.scaler = QuantileScaler()
        self.retired: dict[str, dict] = {}
        self.added: dict[str, dict] = {}  # arms that joined after the phase start (add_arm)
        self.pulls = {a: 0 for a in self.arms}
        self.pulls_lifetime = {a: 0 for a in self.arms}
        self.ema_acc = {a: 0.0 for a in self.arms}  # uncorrected EMA accumulator
        self.ema_n = {a: 0 for a in self.arms}
        self.last_probe: dict[str, float | None] = {a: None for a in self.arms}
        self.p_acc = {a: 0.0 for a in self.arms}  # sum of recorded p since the last probe
        self.p_n = 0  # records in that sum
        # the repetition guard (docs/bandit.md#the-repetition-guard): arms whose compression ratio
        # reaches config.repetitive_ratio; `held` their p when the warm-up ended (an upper bound)
        self.compression = _positive(compression)  # 0: not measured
        self.held: dict[str, float] = {}
        self.hold_decided = False
        # the default policy, train_slope (docs/bandit.md#the-default-policy): per-arm loss sums of
        # the period in progress, the fits, the arms past one epoch, and the posted move
        if not isinstance(period_steps, int) or isinstance(period_steps, bool) or period_steps < 1:
            raise BanditConfigError(
                f"period_steps = {period_steps!r} must be an int >= 1 (probe_every)"
            )
        self.period_steps = period_steps
        self.epoch_size = _positive(epoch_size)  # sequences per epoch of each arm; 0: unknown
        self.period_sum = {a: 0.0 for a in self.arms}
        self.period_n = {a: 0 for a in self.arms}
        self.fits = {a: ArmFit() for a in self.arms}
        # share-steps each arm is owed: the sum over the phase's records of stratified minus
        # posted share (docs/bandit.md#lowered-arms-get-their-share-back)
        self.owed = {a: 0.0 for a in self.arms}
        self._gap: dict[str, float] | None = None  # stratified - posted; None: to recompute
        self.paid: set[str] = set()  # arms posted above stratified to pay back what they are owed
        # fit each row's loss minus its unigram loss (docs/bandit.md#the-control-variate)? Set
        # by the phase's first record: a history without the field never mixes the two signals
        self.control_variate: bool | None = None
        self.slow: set[str] = set()  # arms judged not learnable at the last refit
        self.repeated: dict[str, int] = {}  # arm -> step at which its epochs passed 1
        self.lam = 0.0
        self.target: dict[str, float] | None = None
        self.gain, self.gain_se = 0.0, 0.0
        if prior is None:
            raw = {a: 1.0 for a in self.arms}
        else:
            extra = sorted(set(prior) - set(self.arms))
            if extra:
                raise BanditConfigError(
                    f"prior: unknown arm(s) {', '.join(extra)}; known arms: {', '.join(self.arms)}"
                )
            raw = {a: prior.get(a, 0.0) for a in self.arms}
            for a, v in raw.items():
                if not _real(v) or v < 0:
                    raise BanditConfigError(
                        f"prior: arm {a!r} weight {v!r} must be a finite number >= 0"
                    )
            if math.fsum(raw.values()) <= 0:
                raw = {a: 1.0 for a in self.arms}
        self.prior = project_to_box(raw, self.floors, self.caps)
        logw = {a: (math.log(v) if v > 0 else -math.inf) for a, v in self.prior.items()}
        top = max(logw.values())
        self.logw = {a: v - top for a, v in logw.items()}

    # -- policy -----------------------------------------------------------------------------
    def probabilities(self) -> dict[str, float]:
        """The posted mixture {arm: probability}, sorted by name; always inside the box (the
        phase's caps, lowered for held repetitive arms to their `held` value). train_slope:
        (1 - lam) stratified + lam target (docs/bandit.md#the-default-policy); the other
        rewards: project(softmax(logw))."""
        if self.config.reward == "train_slope":
            s = self.stratified()
            if self.target is None or self.lam <= 0.0:
                return s
            lam = self.lam
            return project_to_box(
                {a: (1.0 - lam) * s[a] + lam * self.target[a] for a in self.arms},
                self.floors,
                self.effective_caps(),
            )
        top = max(self.logw.values())
        w = {a: math.exp(self.logw[a] - top) for a in self.arms}
        tot = math.fsum(w.values())
        return project_to_box(
            {a: w[a] / tot for a in self.arms}, self.floors, self.effective_caps()
        )

    def stratified(self) -> dict[str, float]:
        """Uniform over the active arms projected into the box (effective caps): the default
        policy's baseline (docs/bandit.md#the-default-policy)."""
        return project_to_box({a: 1.0 for a in self.arms}, self.floors, self.effective_caps())

    def repetitive_arms(self) -> list[str]:
        """Active arms whose compression ratio reaches `config.repetitive_ratio` (sorted; none
        when the guard is off): the arms the repetition guard holds after the warm-up."""
        r = self.config.repetitive_ratio
        return [a for a in self.arms if r > 0 and self.compression.get(a, 0.0) >= r]

    def effective_caps(self) -> dict[str, float]:
        """The phase's caps, with each held arm's cap lowered to its held p."""
        return {a: min(c, self.held[a]) if a in self.held else c for a, c in self.caps.items()}

    @property
    def ema_reward(self) -> dict[str, float]:
        """Bias-corrected EMA of each arm's scaled reward, acc / (1 - beta^n); 0.0 before any."""
        b = self.config.ema_beta
        return {
            a: (self.ema_acc[a] / (1.0 - b ** self.ema_n[a]) if self.ema_n[a] else 0.0)
            for a in self.arms
        }

    # -- feedback ---------------------------------------------------------------------------
    def observe(self, record: Mapping[str, Any]) -> bool:
        """Fold one per-step training record into the state; True when logw changed.

        Record fields: "step" (int), "phase_index" (int; or "phase": {"index": int}), "arms"
        {arm: sequences drawn}, "p" {arm: probability recorded when the batch was drawn},
        "arm_loss" {arm: mean train loss, nats}, "arm_unigram_loss" {arm: mean unigram loss of
        its rows, nats} (train_slope's control variate), "probe" {arm: held-out probe loss, nats} or
        None, "batch_size" (int; defaults to the sum of "arms"), optional "epochs" {arm: epochs}.
        Records of another phase (or untagged) and records with step <= self.step are ignored
        (False). Arms not in `self.arms` (retired, unknown) are ignored. Non-finite losses, and
        `train_loss` feedback for an arm whose recorded p is missing or <= 0, are skipped.
        Rewards (docs/bandit.md#rewards): heldout_progress = previous probe - this probe per arm,
        full information (the first probe of a phase only sets the baseline), minus the mean
        over the arms of that probe when `center_progress` (default; without it the trend
        common to every arm pushes late rewards below the reservoir's 20th percentile, where
        all arms score -1); train_loss = g_i = n_i s_i / (B p_i) with s_i the scaled train loss
        (0 for n_i == 0). Raw rewards
        enter the QuantileScaler, then are scaled to [-1, 1]; the EMA sees the scaled value.
        Options (off by default): `progress_per_p` divides each arm's progress by its mean
        recorded p since the previous probe; `easy_arm_ratio` > 0 caps the scaled reward of an
        easy arm (`easy_arms`) at the worst arm's (docs/bandit.md#the-easy-arm-guard).
        No log-weight update during warm-up (step <= phase start + warmup_steps) or when the
        record carries no reward. Raises ValueError for a record without a usable "step", with
        a per-arm field (`ARM_MAPS`) that is not a mapping or with negative or non-integer counts
        (nothing is changed then).
        """
        try:
            step = int(record["step"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"bandit record without an integer 'step': {record!r:.200}") from None
        if _record_phase(record) != self.phase_index or step <= self.step:
            return False
        for key in ARM_MAPS:
            v = record.get(key)
            if v is not None and not isinstance(v, Mapping):
                raise ValueError(
                    f"step {step}: {key!r} is {v!r:.60}, not a mapping {{arm: number}}"
                )
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
        p_rec = record.get("p") or {}
        if all(_real(p_rec.get(a)) for a in self.arms):
            for a in self.arms:
                self.p_acc[a] += float(p_rec[a])
            self.p_n += 1
        warm = step > self.phase_start_step + self.config.warmup_steps  # the warm-up is over
        if warm and not self.hold_decided:
            # hold every repetitive arm at the p it has now (the prior's: the warm-up makes no
            # update), so its share can only fall from here on
            self.hold_decided = True
            p = self.probabilities()
            self.held = {a: p[a] for a in self.repetitive_arms()}
            self._gap = None
        if self.config.reward == "train_slope":
            return self._fold_trend(record, n, step)
        if self.config.reward == "heldout_progress":
            g = self._heldout_rewards(record)
        else:
            g = self._train_loss_rewards(record, n)
        if not g or not warm:
            return False
        self._update(g)
        return True

    def _fold_trend(self, record: Mapping[str, Any], n: dict[str, int], step: int) -> bool:
        """train_slope: add the record's per-arm training losses to the period's sums (arms past
        one epoch excluded from the step their lifetime pulls pass `epoch_size`, their open
        period discarded, and the move recomputed at once with such an arm capped at its
        stratified share); at a period end (step % period_steps == 0) after the warm-up, add
        each arm's period mean at x = ln(mid-step of the period) to its fit and recompute the
        move. Each record adds stratified minus posted share to every arm's `owed`.
        True when the posted mixture's inputs changed (docs/bandit.md#the-default-policy)."""
        # the payback belongs to the learnable test (docs/bandit.md#lowered-arms-get-their-share-back);
        # a posted mixture equal to stratified owes nothing
        if self.config.learnable_ratio > 0 and self.target is not None and self.lam > 0.0:
            if self._gap is None:
                p, s = self.probabilities(), self.stratified()
                self._gap = {a: s[a] - p[a] for a in self.arms}
            for a in self.arms:
                self.owed[a] += self._gap[a]
        newly = [
            a
            for a in self.arms
            if a not in self.repeated
            and self.epoch_size.get(a, 0.0) > 0
            and self.pulls_lifetime[a] > self.epoch_size[a]
        ]
        for a in newly:
            self.repeated[a] = step
            self.period_sum[a], self.period_n[a] = 0.0, 0
        if newly:  # re-cap at once: the target may no longer hold it above its stratified share
            self.repeated = dict(sorted(self.repeated.items()))
            self._refit()
        losses = record.get("arm_loss") or {}
        unigram = record.get("arm_unigram_loss") or {}
        if self.control_variate is None:
            self.control_variate = bool(unigram)
        for a in self.arms:
            v = _finite_or_none(losses.get(a))
            if v is not None and self.control_variate:
                u = _finite_or_none(unigram.get(a))
                v = None if u is None else v - u
            if a in self.repeated or v is None or n[a] <= 0:
                continue
            self.period_sum[a] += v * n[a]
            self.period_n[a] += n[a]
        if step % self.period_steps:
            return False
        added = False
        if step > self.phase_start_step + self.config.warmup_steps:
            x = math.log(step - (self.period_steps - 1) / 2.0)
            for a in self.arms:
                if self.period_n[a] > 0:
                    self.fits[a].add(step, x, self.period_sum[a] / self.period_n[a])
                    added = True
        self.period_sum = {a: 0.0 for a in self.arms}
        self.period_n = {a: 0 for a in self.arms}
        if not added:
            return False
        self._refit()
        self.updates += 1
        self.version += 1
        return True

    def _refit(self) -> None:
        """Recompute target, lam, gain from the fits (proxy/mixture/loss_trend.py conservative_mixture)."""
        if self.config.reward != "train_slope":
            return
        mv = conservative_mixture(
            self.arms,
            self.fits,
            self.floors,
            self.effective_caps(),
            self.stratified(),
            set(self.repeated),
            self.config.confidence_z,
            self.config.min_periods,
            rule=self.config.lambda_rule,
            learnable_ratio=self.config.learnable_ratio,
            slow=self.slow,
            held=set(self.held),
            owed=self.owed,
            period_steps=self.period_steps,
        )
        self.target, self.lam, self.gain, self.gain_se = mv.target, mv.lam, mv.gain, mv.gain_se
        self.slow, self.paid = set(mv.slow), set(mv.paid)
        self._gap = None

    def slopes(self) -> dict[str, tuple[float, float]]:
        """{arm: (b, se_b)} of every arm with a fit of at least 3 points (loss_trend.ArmFit.slope)."""
        fits = {a: self.fits[a].slope() for a in self.arms}
        return {a: (s[0], math.sqrt(s[1])) for a, s in fits.items() if s is not None}

    def explain(self) -> dict:
        """Why the posted mixture is what it is (docs/bandit.md#reading-the-policy), a JSON-ready
        view for `status`, TensorBoard and the plot; never part of `.state.json`.

        Keys: "step", "phase" (index), "reward"; per arm under "arms" {"posted" (p), "stratified"};
        for the EXP3 rewards also per arm "log_weight", "reward_ema" (bias-corrected, scaled) and
        "held" (the repetition hold's share, or None), and "why"; for
        train_slope also "slope" and "slope_se" (nats of loss per e-fold of steps, None before
        3 fitted periods), "periods" (fitted policy periods), "epochs" (lifetime pulls over one
        epoch's windows, None when unknown), "repeated_at" (step, or None), "owed" (share-steps:
        stratified minus posted share summed over the phase's steps), "target" (pi, None
        before any fit), "learnable" (kept at its stratified share or more; None before
        min_periods fitted periods). train_slope also: "z", "min_periods", "period_steps", "rule", "gain",
        "gain_se" and "bound" = gain - z gain_se (nats), "lambda", "open" (lambda > 0), and
        "why", one sentence saying what the policy waits for or why it moved."""
        p, s = self.probabilities(), self.stratified()
        out: dict[str, Any] = {
            "step": self.step,
            "phase": self.phase_index,
            "reward": self.config.reward,
        }
        arms: dict[str, dict] = {a: {"posted": p[a], "stratified": s[a]} for a in self.arms}
        out["arms"] = arms
        if self.config.reward != "train_slope":
            ema = self.ema_reward
            for a in self.arms:
                arms[a].update(log_weight=self.logw[a], reward_ema=ema[a], held=self.held.get(a))
            out["why"] = (
                f"EXP3 on {self.config.reward}: posted = the softmax of the arms' log-weights "
                f"({self.updates} updates this phase) projected into the box"
                + (f"; held for repetition: {', '.join(sorted(self.held))}" if self.held else "")
            )
            return out
        cfg, slopes = self.config, self.slopes()
        evidence = {a: v for a, v in slopes.items() if self.fits[a].n >= cfg.min_periods}
        for a in self.arms:
            e = self.epoch_size.get(a, 0.0)
            b, se = slopes.get(a, (None, None))
            arms[a].update(
                slope=b,
                slope_se=se,
                periods=self.fits[a].n,
                epochs=self.pulls_lifetime[a] / e if e > 0 else None,
                repeated_at=self.repeated.get(a),
                owed=self.owed[a],
                target=None if self.target is None else self.target[a],
                learnable=(a not in self.slow)
                if a in evidence and cfg.learnable_ratio > 0
                else None,
            )
        bound = self.gain - cfg.confidence_z * self.gain_se
        out.update(
            z=cfg.confidence_z,
            min_periods=cfg.min_periods,
            period_steps=self.period_steps,
            rule=cfg.lambda_rule,
            gain=self.gain,
            gain_se=self.gain_se,
            bound=bound,
            **{"lambda": self.lam, "open": self.lam > 0},
        )
        warm_end = self.phase_start_step + cfg.warmup_steps
        ready = sum(self.fits[a].n >= cfg.min_periods for a in self.arms)
        paid = ", ".join(f"{a} {self.owed[a]:.1f}" for a in sorted(self.paid))
        if self.lam > 0 and cfg.learnable_ratio > 0 and self.slow:
            why = (
                f"moved: {', '.join(sorted(self.slow))} learn(s) surely slower than "
                f"{cfg.learnable_ratio:g} times the fastest arm (slope's upper bound at "
                f"z = {cfg.confidence_z:g}); posted = the target, which "
                + (
                    f"gives their share to faster arms and pays back {', '.join(sorted(self.paid))}"
                    f" (lowered before, learning again) the share-steps owed ({paid}) from the "
                    "arms that took them"
                    if self.paid
                    else "takes share only from them"
                )
            )
        elif self.lam > 0 and self.paid:
            why = (
                f"paying back: {', '.join(sorted(self.paid))} learn(s) again after being "
                f"lowered; posted = stratified plus the share-steps owed ({paid}), as fast as "
                "the caps allow, from the arms that took them"
            )
        elif self.lam > 0:
            why = (
                f"moved: the target's modelled gain {self.gain:.4f} nats has a lower bound "
                f"{bound:.4f} > 0 at z = {cfg.confidence_z:g}; posted = {self.lam:.2f} of the "
                "way from stratified to the target"
            )
        elif self.step <= warm_end:
            why = f"warm-up: stratified until step {warm_end}, then one fit point per period"
        elif ready < 2:
            most = max((self.fits[a].n for a in self.arms), default=0)
            why = (
                f"waiting for evidence: {most} of {cfg.min_periods} fitted periods "
                f"({self.period_steps} steps each) on at least two arms; stratified until then"
            )
        elif cfg.learnable_ratio > 0 and self.slow & set(evidence):
            why = (
                f"stratified: {', '.join(sorted(self.slow))} learn(s) surely slower than "
                f"{cfg.learnable_ratio:g} times the fastest arm, but no arm that learns can take "
                "its share (each is held at its stratified share: past one epoch, or at its cap)"
            )
        elif cfg.learnable_ratio > 0 and evidence:
            why = (
                f"stratified: every arm learns at least {cfg.learnable_ratio:g} times as fast as "
                f"the fastest (its slope's upper bound at z = {cfg.confidence_z:g}), so none gives share"
            )
        else:
            why = (
                f"stratified: the target's modelled gain {self.gain:.4f} nats has a lower bound "
                f"{bound:.4f} <= 0 at z = {cfg.confidence_z:g}; it moves once the gain is "
                f"{cfg.confidence_z:g} standard errors clear of zero"
            )
        out["why"] = why
        return out

    def _multiplier(self, record: Mapping[str, Any], a: str) -> float:
        if not self.config.epochs_discount:
            return 1.0
        e = (record.get("epochs") or {}).get(a)
        return 1.0 / (1.0 + e) if _real(e) and e >= 0 else 1.0

    def _fold_scaled(self, raw: dict[str, float]) -> dict[str, float]:
        for a in sorted(raw):
            self.scaler.add(raw[a])
        b = self.config.ema_beta
        scaled = {a: self.scaler.scale(raw[a]) for a in sorted(raw)}
        for a, s in scaled.items():
            self.ema_acc[a] = b * self.ema_acc[a] + (1.0 - b) * s
            self.ema_n[a] += 1
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
        if self.config.progress_per_p and self.p_n:
            raw = {
                a: v * self.p_n / self.p_acc[a] if self.p_acc[a] > 0 else v for a, v in raw.items()
            }
        self.p_acc, self.p_n = {a: 0.0 for a in self.arms}, 0
        if self.config.center_progress and len(raw) > 1:
            mean = math.fsum(raw.values()) / len(raw)
            raw = {a: v - mean for a, v in raw.items()}
        scaled = self._fold_scaled(raw)
        g = {a: s * self._multiplier(record, a) for a, s in scaled.items()}
        easy = self.easy_arms()
        if easy and len(g) > 1:
            worst = min(g.values())
            g = {a: (min(v, worst) if a in easy else v) for a, v in g.items()}
        return g

    def easy_arms(self) -> list[str]:
        """Arms whose last probe loss is below `easy_arm_ratio` times the mean of the other arms'
        last probe losses (sorted names; docs/bandit.md#the-easy-arm-guard): trivially predictable
        sources (lists, repetition) whose held-out progress is not allowed to raise them."""
        r = self.config.easy_arm_ratio
        known = {a: v for a, v in self.last_probe.items() if v is not None}
        if r <= 0 or len(known) < 2:
            return []
        total = math.fsum(known.values())
        return [a for a in sorted(known) if known[a] < r * (total - known[a]) / (len(known) - 1)]

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
        return {
            a: n[a] * s / (bsz * pr[a]) * self._multiplier(record, a) for a, s in scaled.items()
        }

    def _update(self, g: Mapping[str, float]) -> None:
        """logw' = gamma logw + eta g; Exp3.S share; re-centre (docs/bandit.md#update)."""
        lam, eta, alpha = self.config.discount, self.config.eta, self.config.share
        lw = {a: lam * self.logw[a] + eta * g.get(a, 0.0) for a in self.arms}
        k = len(self.arms)
        if k > 1 and alpha > 0:
            top = max(lw.values())
            w = {a: math.exp(lw[a] - top) for a in self.arms}
            lw = {}
            for a in self.arms:
                others = math.fsum(w[b] for b in self.arms if b != a)
                m = (1.0 - alpha) * w[a] + alpha / (k - 1) * others
                lw[a] = math.log(m) + top if m > 0 else -math.inf
        top = max(lw.values())
        self.logw = {a: lw[a] - top for a in self.arms}
        self.updates += 1
        self.version += 1

    # -- arms and phases --------------------------------------------------------------------
    def _per_arm_dicts(self) -> tuple[dict[str, Any], ...]:
        """The phase's per-arm dicts, keyed by arm name, that an arm leaves (`retire`) or joins
        (`add_arm`) with; `logw` apart, which both re-base on its largest value."""
        return (
            self.floors,
            self.caps,
            self.pulls,
            self.pulls_lifetime,
            self.ema_acc,
            self.ema_n,
            self.last_probe,
            self.prior,
            self.p_acc,
            self.period_sum,
            self.period_n,
            self.fits,
            self.owed,
        )

    def retire(self, name: str, reason: str) -> None:
        """Move arm `name` to the retired section (with `reason` and its stats); never pulled again.

        The remaining arms keep their floors and caps and are re-projected; the arm's `owed`
        (negative for a credit) is settled with the arms whose balance has the other sign, in
        proportion to it, so debts with the arm that leaves are cleared. Raises
        BanditConfigError for an unknown arm, the last arm, or when the remaining caps sum
        below 1 (the state is unchanged then). Source: docs/architecture.md#arms.
        """
        if name not in self.arms:
            raise BanditConfigError(
                f"retire: unknown arm {name!r}; active arms: {', '.join(self.arms)}"
            )
        rest = [a for a in self.arms if a != name]
        if not rest:
            raise BanditConfigError(f"retire: {name!r} is the last arm; a run needs at least one")
        try:
            _check_bounds(rest, self.floors, self.caps)
        except BanditConfigError as e:
            raise BanditConfigError(
                f"retiring arm {name!r} leaves infeasible bounds: {e}"
            ) from None
        p = self.probabilities()
        self.retired[name] = {
            "reason": str(reason),
            "retired_at_step": self.step,
            "phase_index": self.phase_index,
            "pulls": self.pulls[name],
            "pulls_lifetime": self.pulls_lifetime[name],
            "ema_reward": self.ema_reward[name],
            "ema_n": self.ema_n[name],
            "p": p[name],
            "logw": _finite_or_none(self.logw[name]),
            "floor": self.floors[name],
            "cap": self.caps[name],
            "ema_acc": self.ema_acc[name],
            "prior": self.prior[name],
            "last_probe": self.last_probe[name],
        }
        self.arms = rest
        # settle the arm's account with the arms on the other side of it, in proportion to their
        # balances: the ledger still sums to zero (docs/bandit.md#lowered-arms-get-their-share-back)
        own = self.owed[name]
        other = {a: abs(self.owed[a]) for a in rest if self.owed[a] * own < 0}
        total = math.fsum(other.values())
        for a, v in other.items():
            self.owed[a] += own * (v / total)
        for d in (*self._per_arm_dicts(), self.logw):
            del d[name]
        self.held.pop(name, None)
        self.repeated.pop(name, None)
        self.slow.discard(name)
        self.paid.discard(name)
        if self.held and math.fsum(self.effective_caps().values()) < 1.0 - BOUND_SLACK:
            self.held = {}  # the holds no longer leave room for a batch: the phase's caps rule
        top = max(self.logw.values())
        self.logw = {a: v - top for a, v in self.logw.items()}
        self._refit()
        self.version += 1

    def add_arm(self, name: str, reason: str, floor: float = 0.0, cap: float = 1.0) -> None:
        """Let arm `name` join from the next record on (an arm added on a restart).

        A RETIRED arm re-joins with its statistics restored by name: pulls_lifetime always; when
        it was retired in this phase after the phase start also its phase pulls, reward EMA,
        probe baseline and log-weight (a retirement in an earlier phase, or at this phase's
        start, keeps only lifetime pulls: a pivot resets the rest for every arm anyway). A NEW arm
        starts with no statistics and the log-weight of
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
        self.p_acc[name] = 0.0
        self.period_sum[name], self.period_n[name], self.fits[name] = 0.0, 0, ArmFit()
        self.owed[name] = 0.0
        self.slow.discard(name)
        self.logw[name], self.prior[name] = average, 0.0
        if old is not None:
            self.pulls_lifetime[name] = int(old["pulls_lifetime"])
            if (
                old.get("phase_index") == self.phase_index
                and "ema_acc" in old
                and old["retired_at_step"] > self.phase_start_step
            ):
                self.pulls[name] = int(old["pulls"])
                self.ema_acc[name], self.ema_n[name] = float(old["ema_acc"]), int(old["ema_n"])
                self.last_probe[name] = _finite_or_none(old.get("last_probe"))
                if old["logw"] is not None:  # a zero-prior arm comes back as an average one
                    self.logw[name] = float(old["logw"])
                self.prior[name] = float(old.get("prior", 0.0))
        top = max(self.logw.values())
        self.logw = {a: self.logw[a] - top for a in self.arms}
        for d in self._per_arm_dicts():
            items: list[tuple[str, Any]] = sorted(d.items())
            d.clear()
            d.update(items)
        if self.hold_decided and name in self.repetitive_arms():
            self.held[name] = self.probabilities()[name]  # held from its first p on
            self.held = dict(sorted(self.held.items()))
        self.added[name] = {"step": self.step, "reason": str(reason), "rejoined": old is not None}
        self._refit()  # the new arm has no fit yet: it stays at its stratified share
        self.version += 1

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
            arms[a] = {
                "pulls": self.pulls[a],
                "pulls_lifetime": self.pulls_lifetime[a],
                "ema_reward": ema[a],
                "ema_n": self.ema_n[a],
                "ema_acc": self.ema_acc[a],
                "p": p[a],
                "logw": _finite_or_none(self.logw[a]),
                "prior": self.prior[a],
                "last_probe": self.last_probe[a],
            }
        return {
            "step": self.step,
            "phase": {
                "label": self.phase_label,
                "index": self.phase_index,
                "started_at_step": self.phase_start_step,
                "updates": self.updates,
                "steps": self.steps,
            },
            "caps": dict(self.caps),
            "floors": dict(self.floors),
            "version": self.version,
            "config": self.config.to_dict(),
            "arms": arms,
            "scaler": self.scaler.to_dict(),
            "retired": copy.deepcopy(self.retired),
            "added": copy.deepcopy(self.added),
            "p_since_probe": {"sum": dict(self.p_acc), "n": self.p_n},
            "repetition": {
                "compression": dict(self.compression),
                "held": dict(self.held),
                "decided": self.hold_decided,
            },
            "trend": {
                "period_steps": self.period_steps,
                "epoch_size": dict(self.epoch_size),
                "period_sum": dict(self.period_sum),
                "period_n": dict(self.period_n),
                "control_variate": self.control_variate,
                "fits": {a: f.to_dict() for a, f in self.fits.items()},
                "repeated": dict(self.repeated),
                "lambda": self.lam,
                "target": None if self.target is None else dict(self.target),
                "gain": self.gain,
                "gain_se": self.gain_se,
                "slow": sorted(self.slow),
                "owed": dict(self.owed),
                "paid": sorted(self.paid),
            },
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Bandit":
        """Rebuild a Bandit from `to_dict` output (after JSON). Raises ValueError when malformed
        (BanditConfigError when its bounds or config are invalid): rebuild it by replaying the
        history then (proxy/mixture/rebuild.py)."""
        try:
            config = BanditConfig.from_dict(d["config"])
            arms = d["arms"]
            ph = d["phase"]
            tr = d.get("trend") or {}
            b = cls(
                list(arms),
                d["floors"],
                d["caps"],
                config,
                prior=None,
                phase_label=ph["label"],
                phase_index=ph["index"],
                phase_start_step=ph["started_at_step"],
                period_steps=int(tr.get("period_steps", 25)),
                epoch_size=tr.get("epoch_size"),
            )
            b.period_sum = {a: float((tr.get("period_sum") or {}).get(a, 0.0)) for a in b.arms}
            b.period_n = {a: int((tr.get("period_n") or {}).get(a, 0)) for a in b.arms}
            b.fits = {
                a: (ArmFit.from_dict(tr["fits"][a]) if a in (tr.get("fits") or {}) else ArmFit())
                for a in b.arms
            }
            b.repeated = {a: int(v) for a, v in (tr.get("repeated") or {}).items()}
            b.lam = float(tr.get("lambda", 0.0))
            b.target = (
                None if tr.get("target") is None else {a: float(v) for a, v in tr["target"].items()}
            )
            b.gain, b.gain_se = float(tr.get("gain", 0.0)), float(tr.get("gain_se", 0.0))
            b.slow = {str(a) for a in tr.get("slow") or ()} & set(b.arms)
            b.owed = {a: float(tr["owed"][a]) for a in b.arms}
            b.paid = {str(a) for a in tr["paid"]} & set(b.arms)
            b.step = int(d["step"])
            b.version = int(d["version"])
            b.updates = int(ph.get("updates", 0))
            b.steps = int(ph.get("steps", 0))
            cv = tr["control_variate"]
            if cv is not None and not isinstance(cv, bool):
                raise TypeError(f"trend.control_variate {cv!r:.40} is not true, false or null")
            b.control_variate = cv
            b.scaler = QuantileScaler.from_dict(d["scaler"])
            b.retired = copy.deepcopy(dict(d.get("retired") or {}))
            b.added = copy.deepcopy(dict(d.get("added") or {}))
            since = d.get("p_since_probe") or {}
            b.p_n = int(since.get("n", 0))
            b.p_acc = {a: float((since.get("sum") or {}).get(a, 0.0)) for a in b.arms}
            rep = d.get("repetition") or {}
            b.compression = {a: float(v) for a, v in (rep.get("compression") or {}).items()}
            b.held = {a: float(v) for a, v in (rep.get("held") or {}).items()}
            b.hold_decided = bool(rep.get("decided", False))
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
            raise ValueError(
                f"bandit state malformed ({e!r}); rebuild it by replaying the history"
            ) from None
        return b
