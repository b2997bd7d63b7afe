"""Zombie arms (docs/architecture.md#arms): arms whose source is gone or changed since the run was created.

At the start of every incarnation the proxy matches each arm of `data/arms.json` to its
configured source by NAME and fingerprint. The cheap `source_fingerprint` (file list, sizes,
mtimes) is compared first; when it differs, the content fingerprint (sha256 of the text or token
file) decides, so a touched-but-identical source is not a zombie. A zombie is reported by name,
marked retired in `data/arms.json` ({"step", "reason"}: the worker never loads it again) and
retired in the bandit from that step on (a "retire" entry of the arm-change log,
proxy/arm_changes.py, applied by `MixtureController.apply_changes`): it is never
pulled, and its statistics stay in the state under `retired`.

What it is not: the bandit's retire arithmetic (`proxy/bandit.py`).
"""
from __future__ import annotations

import logging

from proxy.arm_changes import ArmChange, append_changes, stamp_changes
from shared.arm_data import read_arm_index
from shared.arms import ArmSourceError, content_fingerprint, source_fingerprint
from shared.config import ArmSpec
from shared.run_layout import RunLayout

log = logging.getLogger("proxy.zombies")


def check_source(spec: ArmSpec, fingerprint: str, source_fp: str) -> str | None:
    """Why the arm's source no longer matches (a sentence naming the arm), or None when it does.

    `fingerprint`: the content fingerprint stored at creation; `source_fp`: the stored cheap one
    ("" when the run predates it: then the content fingerprint is checked every time)."""
    try:
        if source_fp and source_fingerprint(spec) == source_fp:
            return None
        now = content_fingerprint(spec)
    except ArmSourceError as e:
        return f"source gone ({e})"
    except OSError as e:
        return f"source unreadable ({e})"
    if now != fingerprint:
        return f"source changed (fingerprint {fingerprint[:19]} at creation, now {now[:19]})"
    return None


def find_zombies(layout: RunLayout, specs: list[ArmSpec]) -> dict[str, str]:
    """Active arms whose source is gone or changed: {name: reason}. Arms already retired are
    not checked again. Reads `data/arms.json` (ArmSourceError when it is missing)."""
    index = read_arm_index(layout, include_retired=True)
    by_name = {s.name: s for s in specs}
    out = {}
    for name in sorted(index):
        a = index[name]
        if a.retired or name not in by_name:
            continue
        why = check_source(by_name[name], a.fingerprint, a.source_fingerprint)
        if why:
            out[name] = why
    return out


def handle_zombies(layout: RunLayout, specs: list[ArmSpec], resume_step: int) -> list[ArmChange]:
    """The start-of-incarnation check: stamp pending arm changes with `resume_step`, find new
    zombies, report each by name (a warning), retire them at `resume_step` (proxy/arm_changes.py
    log); returns the whole arm-change log for the MixtureController."""
    changes = stamp_changes(layout, resume_step)
    zombies = find_zombies(layout, specs)
    for name, why in zombies.items():
        log.warning("arm %s is a zombie: %s; it is retired from step %d on (kept in .state.json "
                    "under 'retired', never pulled again); restore its source and start a new "
                    "run or fork to train on it again", name, why, resume_step)
    if zombies:
        changes = append_changes(layout, [(resume_step, "retire", n, why)
                                          for n, why in zombies.items()])
    return changes
