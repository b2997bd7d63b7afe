"""Watching for collapse: each sample audit scored per arm for repetition, the checkpoint before
a bad audit held (pinned), the alarm raised on two bad audits in a row, and the run stopped with
`--stop-on-collapse`. The scores, thresholds and holds are docs/bandit.md#watching-for-collapse.
The supervisor keeps one watch for all its incarnations, so a worker's restart keeps the hold.

What it is not: the audit itself (worker/trainer.py `sample_audit`) or the manifest's pins
(shared/checkpoint/manifest.py `set_pinned`).
"""

from __future__ import annotations

import collections
import logging
import re
import time

from shared.checkpoint.directory import list_checkpoints
from shared.checkpoint.manifest import editing_manifest, set_pinned
from shared.run.layout import RunLayout

log = logging.getLogger("proxy.collapse")

_PIECE = re.compile(r"\w+|[^\w\s]")
MIN_PIECES = 6  # shorter samples are not judged (too little text to tell)
MIN_DISTINCT2 = 0.3  # a sample is degenerate below this distinct-2 (a ratio in [0, 1]) ...
MAX_TOP_SHARE = 0.6  # ... or above this top n-gram share


def repetition_scores(text: str) -> dict:
    """{"pieces", "distinct_1", "distinct_2", "top_ngram_share", "top_ngram"} for one sample.

    distinct_k = unique k-grams / k-grams (1.0 when there are none); top_ngram_share = max over
    n = 1..4 of (count of the most frequent n-gram) * n / pieces, capped at 1."""
    pieces = _PIECE.findall(text)
    n = len(pieces)
    counts = {
        k: collections.Counter(tuple(pieces[i : i + k]) for i in range(n - k + 1))
        for k in range(1, 5)
    }
    top_share, top = 0.0, ""
    for k, grams in counts.items():
        for g, c in grams.most_common(1):  # none when there are no k-grams
            if c > 1 and (share := min(1.0, c * k / n)) > top_share:
                top_share, top = share, " ".join(g)
    return {
        "pieces": n,
        "distinct_1": len(counts[1]) / n if n else 1.0,
        "distinct_2": len(counts[2]) / (n - 1) if n > 1 else 1.0,
        "top_ngram_share": top_share,
        "top_ngram": top,
    }


class CollapseWatch:
    """Scores audits and raises the collapse alarm (docs/bandit.md#watching-for-collapse).

    stop_on_collapse: the caller stops the run when `on_audit` returns an alarm and this is set.
    """

    def __init__(self, layout: RunLayout, stop_on_collapse: bool = False) -> None:
        self.layout = layout
        self.stop_on_collapse = stop_on_collapse
        self.bad_in_a_row = 0
        self.first_bad_step: int | None = None
        self.held: str | None = None  # the checkpoint pinned for the first bad audit
        self.release: int | None = None  # its step, when the watch itself pinned it
        self.pending: dict | None = None  # alarm not yet written into a history record
        self.alarms: list[dict] = []

    def degenerate(self, s: dict) -> bool:
        return s["pieces"] >= MIN_PIECES and (
            s["distinct_2"] < MIN_DISTINCT2 or s["top_ngram_share"] > MAX_TOP_SHARE
        )

    def score(self, audit: dict) -> dict:
        """Per-arm scores and the verdict: {"arms": {arm: scores}, "bad_arms": [...], "bad"}."""
        arms = {
            a: repetition_scores(v.get("text", ""))
            for a, v in sorted(audit.get("arms", {}).items())
        }
        bad_arms = [a for a, s in arms.items() if self.degenerate(s)]
        return {
            "arms": arms,
            "bad_arms": bad_arms,
            "bad": bool(arms) and 2 * len(bad_arms) >= len(arms),
        }

    def on_audit(self, audit: dict) -> dict | None:
        """Score one audit (stored in it under "collapse"); returns the alarm when this is the
        second bad audit in a row, else None. Pins the checkpoint (see `pin_before`)."""
        verdict = self.score(audit)
        audit["collapse"] = verdict
        step = int(audit["step"])
        if not verdict["bad"]:
            if self.release is not None:
                try:
                    set_pinned(self.layout.root, self.release, pinned=False)
                except OSError as e:  # a full disk, a lock not had in 30 s: kept, not lost
                    log.warning("could not release the hold on step %d: %s", self.release, e)
            self.bad_in_a_row, self.first_bad_step, self.held, self.release = 0, None, None, None
            return None
        self.bad_in_a_row += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
            self.held, self.release = self.pin_before(step)
        if self.bad_in_a_row < 2:
            log.warning(
                "sample audit at step %d looks degenerate (arms %s); one more and the "
                "collapse alarm goes off; %s",
                step,
                ", ".join(verdict["bad_arms"]),
                f"holding {self.held} (pinned) until the next audit"
                if self.held
                else "no checkpoint before it to hold",
            )
            return None
        # the writer is asynchronous: a checkpoint before the first audit may be filed only now
        pinned = self.held or self.pin_before(self.first_bad_step)[0]
        alarm = {
            "kind": "collapse",
            "audit_steps": [self.first_bad_step, step],
            "bad_arms": verdict["bad_arms"],
            "pinned_checkpoint": pinned,
            "scores": {
                a: {k: v for k, v in s.items() if k != "top_ngram"}
                for a, s in verdict["arms"].items()
            },
            "stop": self.stop_on_collapse,
            "time": time.time(),
        }
        log.error(
            "COLLAPSE ALARM: sample audits at steps %d and %d are degenerate (arms %s: %s); %s%s",
            self.first_bad_step,
            step,
            ", ".join(verdict["bad_arms"]),
            "; ".join(
                f"{a} distinct-2 {verdict['arms'][a]['distinct_2']:.2f}, top n-gram "
                f"{verdict['arms'][a]['top_ngram']!r} {verdict['arms'][a]['top_ngram_share']:.0%}"
                for a in verdict["bad_arms"]
            ),
            f"pinned {pinned} (the last checkpoint before them)"
            if pinned
            else "no checkpoint before them to pin",
            "; stopping the run (--stop-on-collapse)" if self.stop_on_collapse else "",
        )
        self.alarms.append(alarm)
        self.pending = alarm
        self.bad_in_a_row, self.first_bad_step, self.held, self.release = 0, None, None, None
        return alarm

    def pin_before(self, step: int) -> tuple[str | None, int | None]:
        """Pin the newest checkpoint with a step < `step` that is on disk and in the manifest,
        under the manifest's lock (retention cannot retire it meanwhile). Returns its file name
        (None when there is none) and its step when this call pinned it (None when it was
        pinned already, so the watch never releases an operator's or a fork's pin). A manifest
        that cannot be written or locked is logged and pins nothing: the watch is advice, and
        never stops the run on its own account."""
        try:
            with editing_manifest(self.layout.root) as entries:
                on_disk = {s for s, _ in list_checkpoints(self.layout.root)}
                cands = sorted(s for s in entries if s < step and s in on_disk)
                if not cands:
                    return None, None
                entry = entries[cands[-1]]
                was, entry.pinned = entry.pinned, True
                return entry.file, None if was else entry.step
        except OSError as e:  # a full disk, a lock not had in 30 s: the run goes on
            log.warning("could not pin the checkpoint before step %d: %s", step, e)
            return None, None

    def annotate(self, record: dict) -> None:
        """Put a pending alarm into a `.loss.json` record about to be appended ("alarm")."""
        if self.pending is not None:
            record["alarm"] = self.pending
            self.pending = None
