"""File the step reports a dead proxy never read (docs/history.md#reports-a-dead-proxy-never-read):
before the first incarnation resets the handshake (which deletes `.reports.jsonl`), the reports
that continue the history without a gap are appended to `.loss.json`, each marked "filed_late";
the usual rewind then removes whatever lies past the checkpoint loaded.
"""

from __future__ import annotations

import logging

from shared.run.handshake import ReportReader
from shared.run.layout import RunLayout
from shared.run.loss_history import LossHistory

log = logging.getLogger("proxy")


def salvage_step_reports(layout: RunLayout, history: LossHistory, phases: list) -> None:
    """Append to `history` the step reports in `.reports.jsonl` that continue it without a gap.

    `phases`: proxy.mixture.Phase list (oldest first); a record of step s gets the phase whose
    start_step < s, as the live proxy would have filed it."""
    last = history.last_step or 0
    recs = []
    for r in ReportReader(layout).read():
        if r.get("type") != "step" or r.get("step") != last + 1:
            continue
        rec = {k: v for k, v in r.items() if k != "type"}
        ph = [p for p in phases if p.start_step < rec["step"]] or phases[:1]
        if ph:
            rec["phase"] = {"label": ph[-1].label, "index": ph[-1].index}
        rec["filed_late"] = "filed from .reports.jsonl by the next proxy (the previous one died)"
        recs.append(rec)
        last += 1
    if recs:
        history.append_many(recs)
        history.flush()
        log.warning(
            "%s: filed %d step reports (steps %d..%d) that the previous proxy never read "
            "(it died); nothing was lost",
            layout.loss.name,
            len(recs),
            recs[0]["step"],
            recs[-1]["step"],
        )
