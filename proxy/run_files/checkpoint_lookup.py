"""Finding a checkpoint's run: its `run.json` (beside it, one folder up for a file in
`rejected/`, or a given run directory), its manifest entry, and a run's newest valid checkpoint
(docs/checkpoint-format.md#validity). Read-only; used by `inspect`, `export` and `sample`.

What it is not: the format or the manifest themselves (shared/checkpoint_format.py,
shared/checkpoint_manifest.py), or resume (proxy/supervision/resume_planning.py).
"""

from __future__ import annotations

from pathlib import Path

from shared.checkpoint_format import CheckpointError, find_latest_valid, parse_checkpoint_name
from shared.checkpoint_manifest import ManifestEntry, manifest_checksums, read_manifest
from shared.config import ConfigError, RunConfig, load_run_config


def find_config(path: Path, run_dir: str | None) -> tuple[RunConfig | None, str]:
    """(config, where) for the checkpoint at ``path``; (None, why) when none is at hand."""
    candidates = [Path(run_dir)] if run_dir else [path.parent, path.parent.parent]
    for d in candidates:
        rj = d / "run.json"
        if rj.exists():
            try:
                return load_run_config(rj), str(rj)
            except (ConfigError, OSError, ValueError) as e:
                return None, f"{rj}: unreadable ({e})"
    return None, "no run.json beside the file" + ("" if run_dir else " or one folder up")


def manifest_entry(path: Path) -> ManifestEntry | None:
    """The manifest entry for ``path`` from its folder's checkpoints.json, or None."""
    step = parse_checkpoint_name(path.name)
    if step is None:
        return None
    # a quarantined file (rejected/step_...bin) is described by the run directory's manifest
    for d in (path.parent, path.parent.parent):
        entries = read_manifest(d)
        if step in entries and entries[step].file == path.name:
            return entries[step]
    return None


def newest_valid(run_dir: Path) -> Path | None:
    """The newest valid checkpoint of `run_dir` (manifest checksums checked), or None."""
    cfg, _ = find_config(run_dir / "run.json", str(run_dir))
    try:
        info, _ = find_latest_valid(
            run_dir, cfg.n_params if cfg else None, manifest_checksums(read_manifest(run_dir))
        )
    except CheckpointError:
        return None
    return info.path if info else None
