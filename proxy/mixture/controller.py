"""The mixture controller: folds the worker's step records into the bandit and posts one policy
per period (docs/bandit.md#determinism; docs/handshake.md).

Period v covers updates v*P+1 .. (v+1)*P (P = probe_every). Its policy is the bandit's
probabilities after folding every record up to step (v-1)*P: a fixed lag of one period. The
policy of update k is therefore a pure function of the history before k, the seed and the config,
and a resume rebuilds every policy it needs by replaying `.loss.json` from the phase start.
"""

from __future__ import annotations

from proxy.mixture.arm_changes import ArmChange, arms_present_at
from proxy.mixture.bandit import Bandit, BanditConfig
from proxy.run_files.phases import Phase
from proxy.run_files.state_snapshots import SNAPSHOT_FORMAT


def bandit_record(rec: dict) -> dict:
    """The fields of a `.loss.json` record that the bandit folds (docs/bandit.md#drawing-a-batch)."""
    arms = rec.get("arms", {})  # not a mapping: Bandit.observe names the field
    return {
        "step": rec["step"],
        "phase_index": rec["phase"]["index"],
        "arms": arms,
        "p": rec.get("p", {}),
        "arm_loss": rec.get("arm_loss", {}),
        "arm_unigram_loss": rec.get("arm_unigram_loss", {}),
        "probe": rec.get("probe"),
        "batch_size": (sum(arms.values()) if isinstance(arms, dict) else 0) or 1,
    }


KEEP_POLICIES = 4  # posted policies kept behind the newest (the worker needs the current one)


class MixtureController:
    """Bandit + posted policies for one phase. `policies`: period -> {arm: probability}."""

    def __init__(
        self,
        arm_names: list[str],
        phase: Phase,
        reward: str,
        warmup: int,
        period: int,
        changes: list[ArmChange] | None = None,
        compression: dict[str, float] | None = None,
        epoch_size: dict[str, float] | None = None,
    ) -> None:
        """`arm_names`: every arm the run has had (data/arms.json, retired ones included).
        `changes`: the arm-change log (proxy/mixture/arm_changes.py): arm joins and retirements (zombies,
        arms left out on a restart), each applied once every record up to its step is folded,
        in the live run and in a replay alike, so replay still reproduces `.state.json`
        exactly. `epoch_size`: each arm's training windows per epoch (training tokens / block),
        for the default policy's repetition rule (docs/bandit.md#repetition); `compression`: each
        arm's compression ratio (shared/data/token_files.py `arm_compression`), for the repetition guard
        (docs/bandit.md#the-repetition-guard). The bandit starts with the arms present at the
        phase start (`arms_present_at`) and the changes up to the phase start applied. Raises
        BanditConfigError (bounds)."""
        self.phase = phase
        self.period = period
        present = arms_present_at(arm_names, list(changes or []), phase.start_step)
        self.changes = sorted(
            (c for c in (changes or []) if c.step is not None), key=lambda c: c.id
        )  # pending ones (step null) wait for a start
        self.applied: set[int] = set()
        self.bandit = Bandit(
            present,
            {a: v for a, v in phase.floors.items() if a in present},
            {a: v for a, v in phase.caps.items() if a in present},
            BanditConfig(reward=reward, warmup_steps=warmup),
            prior=(
                {a: v for a, v in phase.prior.items() if a in present}
                if phase.prior is not None
                else None
            ),
            phase_label=phase.label,
            phase_index=phase.index,
            phase_start_step=phase.start_step,
            compression=compression,
            period_steps=period,
            epoch_size=epoch_size,
        )
        for a, n in phase.lifetime_pulls.items():
            if a in self.bandit.pulls_lifetime:
                self.bandit.pulls_lifetime[a] = int(n)
        self.folded_through = phase.start_step
        self.policies: dict[int, dict[str, float]] = {}
        self.next_period = phase.start_step // period  # the first period not posted yet
        self.apply_changes(self.folded_through)
        self._post_ready()

    def apply_changes(self, upto_step: int) -> list[str]:
        """Apply, in log order, every arm change with step <= `upto_step` not applied yet: a
        retire of an active arm (Bandit.retire), an add of an arm not active (Bandit.add_arm:
        a retired arm re-joins with its statistics, a new one starts fresh, with the phase's
        bounds for it). Policies of periods with steps after the change's step are re-posted,
        the one in progress included (a retired arm has p = 0 by omission). Returns the names changed. Raises
        BanditConfigError when the remaining caps cannot hold a batch (Bandit.retire)."""
        done = []
        for c in self.changes:
            if c.id in self.applied or c.step > upto_step:  # type: ignore[operator]  # stamped
                continue
            self.applied.add(c.id)
            if c.action == "retire" and c.arm in self.bandit.arms:
                self.bandit.retire(c.arm, c.reason)
            elif c.action == "add" and c.arm not in self.bandit.arms:
                self.bandit.add_arm(
                    c.arm,
                    c.reason,
                    self.phase.floors.get(c.arm, 0.0),
                    self.phase.caps.get(c.arm, 1.0),
                )
            else:
                continue
            p = self.bandit.probabilities()
            for v in self.policies:  # every period with steps after the change, the current too
                if (v + 1) * self.period > c.step:  # type: ignore[operator]  # stamped
                    self.policies[v] = dict(p)
            done.append(c.arm)
        return done

    def _post_ready(self) -> None:
        while (self.next_period - 1) * self.period <= self.folded_through:
            self.policies[self.next_period] = self.bandit.probabilities()
            self.next_period += 1
        for v in [v for v in self.policies if v < self.next_period - KEEP_POLICIES]:
            del self.policies[v]  # only the periods a resume or the worker can still need

    def to_snapshot(self) -> dict:
        """Everything a resume at `folded_through` needs, JSON-safe: the bandit, the posted
        policies still in use and the counters (proxy/run_files/state_snapshots.py stores it)."""
        return {
            "format": SNAPSHOT_FORMAT,
            "step": self.folded_through,
            "phase_index": self.phase.index,
            "phase_start": self.phase.start_step,
            "next": self.next_period,
            "policies": {str(v): p for v, p in self.policies.items()},
            "applied_changes": sorted(self.applied),
            "bandit": self.bandit.to_dict(),
        }

    def restore(self, snap: dict) -> None:
        """Continue from `to_snapshot()` output of the same phase (exact: Bandit.from_dict)."""
        old, self.bandit = self.bandit, Bandit.from_dict(snap["bandit"])
        # properties of the arms' data, not of the history: arms added since the snapshot have theirs
        self.bandit.compression, self.bandit.epoch_size = old.compression, old.epoch_size
        self.folded_through = int(snap["step"])
        self.next_period = int(snap["next"])
        self.policies = {int(v): p for v, p in snap["policies"].items()}
        if "applied_changes" in snap:
            self.applied = {int(i) for i in snap["applied_changes"]}
        else:  # snapshots written before joins existed: retirements are all that could apply
            self.applied = {
                c.id
                for c in self.changes
                if c.action == "retire"
                and c.arm not in self.bandit.arms
                and c.step <= self.folded_through  # type: ignore[operator]  # stamped
            }

    def observe(self, rec: dict) -> None:
        """Fold one `.loss.json` record (in step order) and post any policy that became ready.
        Raises ValueError for a record without an integer phase index or with a per-arm field
        that is not a mapping (Bandit.observe)."""
        if rec["step"] <= self.folded_through:
            return
        index = rec.get("phase", {}).get("index") if isinstance(rec.get("phase"), dict) else None
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(
                f"step {rec['step']}: phase {rec.get('phase')!r:.60} has no integer index"
            )
        if len(self.applied) < len(self.changes):
            self.apply_changes(rec["step"] - 1)
        if index == self.phase.index:
            self.bandit.observe(bandit_record(rec))
        self.folded_through = rec["step"]
        self._post_ready()

    def next_phase(
        self, label: str, caps: dict[str, float], floors: dict[str, float], start_step: int
    ) -> Phase:
        """The phases.json entry of a polish pivot at `start_step` (docs/bandit.md#polish-pivot):
        index + 1, the new bounds, prior = this bandit's probabilities now (projected into the
        new box when the new controller is built), and each arm's lifetime pulls (retired arms
        included) so counts run on across phases."""
        b = self.bandit
        return Phase(
            index=self.phase.index + 1,
            label=label,
            start_step=start_step,
            caps=dict(caps),
            floors=dict(floors),
            prior=b.probabilities(),
            lifetime_pulls={
                **{a: r["pulls_lifetime"] for a, r in b.retired.items()},
                **b.pulls_lifetime,
            },
        )

    def policies_from(self, first_period: int) -> dict[str, dict]:
        """Posted policies for periods >= first_period, as the handshake stores them."""
        return {
            str(v): {
                "period": v,
                "first_step": v * self.period + 1,
                "phase_index": self.phase.index,
                "p": p,
            }
            for v, p in self.policies.items()
            if v >= first_period
        }
