"""`.samples.json` and `.state.json` (docs/architecture.md#the-run-directory); `.loss.json` is
`shared/run/loss_history.py`.

`.samples.json` = {"phase": {...}, "audits": [...]}: the sample audits of the current phase, the
last `keep` of them, rewritten atomically per audit (it is small and bounded).
`.state.json` = the bandit's `to_dict()` at the step of the checkpoint it goes with, written
atomically when that checkpoint is durable.
"""

from __future__ import annotations

from pathlib import Path

from shared.atomic_io import Garbage, atomic_write_json, read_json


class SamplesLog:
    """The bounded audit log of the current phase. Audits past `upto_step` (after a rewind) are
    moved to `archive/rewound-samples.json`, never dropped."""

    def __init__(self, path: Path, phase: dict, keep: int = 50) -> None:
        self.path, self.keep = Path(path), keep
        d = read_json(self.path, None, garbage="aside")
        if not isinstance(d, dict) or not isinstance(d.get("audits"), list):
            d = {"phase": phase, "audits": []}
        self.data = d

    def trim_after(self, step: int, archive_path: Path) -> None:
        late = [a for a in self.data["audits"] if a.get("step", 0) > step]
        if late:
            old = read_json(archive_path, [], garbage="aside")
            archive_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(archive_path, old + late)
            self.data["audits"] = [a for a in self.data["audits"] if a.get("step", 0) <= step]
            self.save()

    def add(self, audit: dict) -> None:
        audit = {k: v for k, v in audit.items() if k != "type"}
        self.data["audits"] = (self.data["audits"] + [audit])[-self.keep :]
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, self.data)


def write_state(path: Path, snapshot: dict) -> None:
    atomic_write_json(path, snapshot)


def read_state(path: Path, garbage: Garbage = "aside") -> dict | None:
    """`.state.json`, or None when it is missing. A garbage file is moved aside with a warning
    (the proxy rebuilds the state from the history: docs/history.md#torn-tail-repair), or with
    `garbage="default"` left alone (a reader that must not disturb a live run: `status`)."""
    d = read_json(path, None, garbage=garbage)
    return d if isinstance(d, dict) else None


def read_audits(path: Path, garbage: Garbage = "aside") -> list[dict]:
    """The audits in `.samples.json`, [] when there are none; a garbage file is moved aside with
    a warning, as the proxy's own reader does (`SamplesLog`), or with `garbage="default"` left
    alone (a reader that must not disturb the run)."""
    d = read_json(path, {}, garbage=garbage)
    return (d.get("audits") if isinstance(d, dict) else None) or []
