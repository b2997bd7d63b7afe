"""`phases.json`: one entry per bandit life between pivots (docs/pivots.md). The only module that
reads or writes the file.

What it is not: the bandit's reset at a pivot (proxy/mixture/controller.py `next_phase`) or the
pivot's state machine (proxy/supervision/pivots.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shared.atomic_io import atomic_write_json, read_json
from shared.run.config import ConfigError
from shared.run.layout import RunLayout


@dataclass
class Phase:
    """One entry of `phases.json`: a bandit life between pivots (docs/pivots.md)."""

    index: int
    label: str
    start_step: int  # records from start_step + 1 on belong to this phase
    caps: dict[str, float] = field(default_factory=dict)
    floors: dict[str, float] = field(default_factory=dict)
    prior: dict[str, float] | None = None
    lifetime_pulls: dict[str, int] = field(default_factory=dict)


def bounds_text(bounds: dict | None) -> str:
    """Caps or floors as the messages write them: "a=0.3,b=0.1", or "none"."""
    return ",".join(f"{k}={v:g}" for k, v in sorted((bounds or {}).items())) or "none"


def read_phases(layout: RunLayout) -> list[Phase]:
    """All phases, oldest first. Raises ConfigError naming the file when unreadable."""
    try:
        d = read_json(layout.phases, expect=dict, missing_ok=False)
        return [Phase(**p) for p in d["phases"]]
    except FileNotFoundError:
        raise ConfigError(
            f"{layout.phases}: missing; recreate it as "
            '{"phases": [{"index": 0, "label": "initial", "start_step": 0}]}'
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{layout.phases}: unreadable ({getattr(e, 'reason', e)}); restore it from a backup, or "
            "rewrite it: one entry per phase (index, label, start_step, caps, "
            "floors), as each record of .loss.json names its phase "
            "(docs/pivots.md)"
        ) from e


def phase_at(layout: RunLayout, step: int) -> Phase:
    """The phase in force after update `step`: the last one of phases.json starting at or
    before it (the first phase when none does). Raises ConfigError as `read_phases` does."""
    phases = read_phases(layout)
    return ([p for p in phases if p.start_step <= step] or phases[:1])[-1]


def write_phases(layout: RunLayout, phases: list[Phase]) -> None:
    atomic_write_json(layout.phases, {"phases": [dataclasses.asdict(p) for p in phases]})


def copy_phases(src: RunLayout, dst: RunLayout, step: int) -> None:
    """Write into `dst` the phases of `src` that started at or before checkpoint `step` (at least
    the first), each entry as the source stores it, fields this version does not know included
    (an audit fork, proxy/commands/fork.py). Raises OSError or ValueError when the source's file
    is missing or not JSON."""
    d = read_json(src.phases, expect=dict, missing_ok=False)
    d["phases"] = [p for p in d["phases"] if p["start_step"] <= step] or d["phases"][:1]
    atomic_write_json(dst.phases, d)


def phase_entries(layout: RunLayout) -> list[dict]:
    """The raw entries of `phases.json`, oldest first; [] when it is missing or unreadable (for
    readers that must not fail on it: `status`, `plot`)."""
    d = read_json(layout.phases, {}, garbage="default")
    phases = d.get("phases") if isinstance(d, dict) else None
    return [p for p in phases if isinstance(p, dict)] if isinstance(phases, list) else []
