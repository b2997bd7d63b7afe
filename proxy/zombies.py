"""Zombie arms (SPEC section 7): arms whose source is gone or changed since the run was created.

At the start of every incarnation the proxy matches each arm of `data/arms.json` to its
configured source by NAME and fingerprint. The cheap `source_fingerprint` (file list, sizes,
mtimes) is compared first; when it differs, the content fingerprint (sha256 of the text or token
file) decides, so a touched-but-identical source is not a zombie. A zombie is reported by name,
marked retired in `data/arms.json` ({"step", "reason"}: the worker never loads it again) and
retired in the bandit from that step on (`MixtureController.apply_retirements`): it is never
pulled, and its statistics stay in the state under `retired`.

What it is not: the bandit's retire arithmetic (`proxy/bandit.py`).
"""
from __future__ import annotations

import json
import logging

from shared.arm_data import read_arm_index
from shared.arms import ArmSourceError, content_fingerprint, source_fingerprint
from shared.atomic_io import atomic_write_json
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


def retire_arms(layout: RunLayout, zombies: dict[str, str], step: int) -> None:
    """Mark `zombies` ({name: reason}) retired at `step` in `data/arms.json` (atomic rewrite)."""
    d = json.loads(layout.arms_index.read_text())
    for a in d["arms"]:
        if a["name"] in zombies and not a.get("retired"):
            a["retired"] = {"step": int(step), "reason": zombies[a["name"]]}
    atomic_write_json(layout.arms_index, d)


def retirements(layout: RunLayout, resume_step: int) -> dict[str, tuple[int, str]]:
    """Every retired arm as {name: (step, reason)}, the step clamped to `resume_step` (a resume
    from an older checkpoint must not train on the arm past it either); the clamp is written
    back so later replays agree."""
    d = json.loads(layout.arms_index.read_text())
    out, changed = {}, False
    for a in d["arms"]:
        r = a.get("retired")
        if r:
            if r["step"] > resume_step:
                r["step"], changed = resume_step, True
            out[a["name"]] = (int(r["step"]), str(r["reason"]))
    if changed:
        atomic_write_json(layout.arms_index, d)
    return out


def handle_zombies(layout: RunLayout, specs: list[ArmSpec], resume_step: int) -> dict[str, tuple[int, str]]:
    """The start-of-incarnation check: find new zombies, report each by name (a warning), retire
    them at `resume_step`; returns all retirements for the MixtureController."""
    zombies = find_zombies(layout, specs)
    for name, why in zombies.items():
        log.warning("arm %s is a zombie: %s; it is retired from step %d on (kept in .state.json "
                    "under 'retired', never pulled again); restore its source and start a new "
                    "run or fork to train on it again", name, why, resume_step)
    if zombies:
        retire_arms(layout, zombies, resume_step)
    return retirements(layout, resume_step)

