"""`.samples.json` and `.state.json` (docs/architecture.md#the-run-directory); `.loss.json` is `shared/loss_history.py`.

`.samples.json` = {"phase": {...}, "audits": [...]}: the sample audits of the current phase, the
last `keep` of them, rewritten atomically per audit (it is small and bounded).
`.state.json` = the bandit's `to_dict()` at the step of the checkpoint it goes with, written
atomically when that checkpoint is durable.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from shared.atomic_io import atomic_write_json

log = logging.getLogger("proxy.sidecars")


def read_json_tolerant(path: Path, default):
    """JSON content of `path`, or `default` when missing; a garbage file is moved aside to
    `<name>.corrupt-<time>` with a warning naming it (docs/architecture.md#bad-input-and-faults), never a crash."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return default
    except (ValueError, UnicodeDecodeError) as e:
        aside = Path(f"{path}.corrupt-{int(time.time())}")
        Path(path).replace(aside)
        log.warning("%s: unreadable (%s); moved aside to %s and starting it afresh",
                    path, e, aside.name)
        return default


class SamplesLog:
    """The bounded audit log of the current phase. Audits past `upto_step` (after a rewind) are
    moved to `archive/rewound-samples.json`, never dropped."""

    def __init__(self, path: Path, phase: dict, keep: int = 50) -> None:
        self.path, self.keep = Path(path), keep
        d = read_json_tolerant(self.path, None)
        if not isinstance(d, dict) or not isinstance(d.get("audits"), list):
            d = {"phase": phase, "audits": []}
        self.data = d

    def trim_after(self, step: int, archive_path: Path) -> None:
        late = [a for a in self.data["audits"] if a.get("step", 0) > step]
        if late:
            old = read_json_tolerant(archive_path, [])
            archive_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(archive_path, old + late)
            self.data["audits"] = [a for a in self.data["audits"] if a.get("step", 0) <= step]
            self.save()

    def add(self, audit: dict) -> None:
        audit = {k: v for k, v in audit.items() if k != "type"}
        self.data["audits"] = (self.data["audits"] + [audit])[-self.keep:]
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, self.data)


def write_state(path: Path, snapshot: dict) -> None:
    atomic_write_json(path, snapshot)
