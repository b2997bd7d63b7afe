"""The mixture controller: folds the worker's step records into the bandit and posts one policy
per period (BANDIT.md "Determinism"; SPEC section 6 "Handshake").

Period v covers updates v*P+1 .. (v+1)*P (P = probe_every). Its policy is the bandit's
probabilities after folding every record up to step (v-1)*P: a fixed lag of one period. The
policy of update k is therefore a pure function of the history before k, the seed and the config,
and a resume rebuilds every policy it needs by replaying `.loss.json` from the phase start.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from proxy.bandit import Bandit, BanditConfig


@dataclass
class Phase:
    """One entry of `phases.json`: a bandit life between pivots (SPEC section 8)."""

    index: int
    label: str
    start_step: int                      # records from start_step + 1 on belong to this phase
    caps: dict[str, float] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)
    prior: dict[str, float] | None = None
    lifetime_pulls: dict[str, int] = field(default_factory=dict)


def bandit_record(rec: dict) -> dict:
    """The fields of a `.loss.json` record that the bandit folds (BANDIT.md "Drawing a batch")."""
    return {"step": rec["step"], "phase_index": rec["phase"]["index"], "arms": rec.get("arms", {}),
            "p": rec.get("p", {}), "arm_loss": rec.get("arm_loss", {}), "probe": rec.get("probe"),
            "batch_size": sum(rec.get("arms", {}).values()) or 1}


KEEP_POLICIES = 4  # posted policies kept behind the newest (the worker needs the current one)


class MixtureController:
    """Bandit + posted policies for one phase. `policies`: period -> {arm: probability}."""

    def __init__(self, arm_names: list[str], phase: Phase, reward: str, warmup: int,
                 period: int, retirements: dict[str, tuple[int, str]] | None = None) -> None:
        """`retirements`: zombie arms, name -> (step S, reason): the arm is retired once every
        record up to S is folded (SPEC section 7 "Zombie arms"), in the live run and in a
        replay alike, so replay still reproduces `.state.json` exactly."""
        self.phase = phase
        self.period = period
        self.bandit = Bandit(arm_names, phase.floors, phase.caps,
                             BanditConfig(reward=reward, warmup_steps=warmup),
                             prior=phase.prior, phase_label=phase.label,
                             phase_index=phase.index, phase_start_step=phase.start_step)
        for a, n in phase.lifetime_pulls.items():
            if a in self.bandit.pulls_lifetime:
                self.bandit.pulls_lifetime[a] = int(n)
        self.folded_through = phase.start_step
        self.policies: dict[int, dict[str, float]] = {}
        self._next = phase.start_step // period
        self.retirements = dict(retirements or {})
        self.apply_retirements(self.folded_through)
        self._post_ready()

    def apply_retirements(self, upto_step: int) -> list[str]:
        """Retire every arm whose retirement step is <= `upto_step` and that is still active;
        policies of periods starting after its retirement step are re-posted without it (p = 0
        by omission). Returns the names retired now. Raises BanditConfigError when the remaining
        caps cannot hold a batch (Bandit.retire)."""
        done = []
        for name in sorted(self.retirements):
            at, reason = self.retirements[name]
            if at <= upto_step and name in self.bandit.arms:
                self.bandit.retire(name, reason)
                p = self.bandit.probabilities()
                for v in self.policies:
                    if v * self.period + 1 > at:
                        self.policies[v] = dict(p)
                done.append(name)
        return done

    def _post_ready(self) -> None:
        while (self._next - 1) * self.period <= self.folded_through:
            self.policies[self._next] = self.bandit.probabilities()
            self._next += 1
        for v in [v for v in self.policies if v < self._next - KEEP_POLICIES]:
            del self.policies[v]  # only the periods a resume or the worker can still need

    def to_snapshot(self) -> dict:
        """Everything a resume at `folded_through` needs, JSON-safe: the bandit, the posted
        policies still in use and the counters (proxy/state_snapshots.py stores it)."""
        return {"step": self.folded_through, "phase_index": self.phase.index,
                "phase_start": self.phase.start_step, "next": self._next,
                "policies": {str(v): p for v, p in self.policies.items()},
                "bandit": self.bandit.to_dict()}

    def restore(self, snap: dict) -> None:
        """Continue from `to_snapshot()` output of the same phase (exact: Bandit.from_dict)."""
        self.bandit = Bandit.from_dict(snap["bandit"])
        self.folded_through = int(snap["step"])
        self._next = int(snap["next"])
        self.policies = {int(v): p for v, p in snap["policies"].items()}

    def observe(self, rec: dict) -> None:
        """Fold one `.loss.json` record (in step order) and post any policy that became ready."""
        if rec["step"] <= self.folded_through:
            return
        if self.retirements:
            self.apply_retirements(rec["step"] - 1)
        if rec["phase"]["index"] == self.phase.index:
            self.bandit.observe(bandit_record(rec))
        self.folded_through = rec["step"]
        self._post_ready()

    def policies_from(self, first_period: int) -> dict[str, dict]:
        """Posted policies for periods >= first_period, as the handshake stores them."""
        return {str(v): {"period": v, "first_step": v * self.period + 1,
                         "phase_index": self.phase.index, "p": p}
                for v, p in self.policies.items() if v >= first_period}
