"""Finding a checkpoint's run: its `run.json` (beside it, one folder up for a file in
`rejected/`, or a given run directory), its manifest entry, and a run's newest valid checkpoint
(docs/checkpoint-format.md#validity). Read-only; used by `inspect`, `export` and `sample`.

What it is not: the format or the manifest themselves (shared/checkpoint/file_format.py,
shared/checkpoint/manifest.py), or resume (proxy/supervision/resume_planning.py).
"""

from __future__ import annotations

from pathlib import Path

from shared.checkpoint.directory import list_checkpoints, scan_for_resume
from shared.checkpoint.file_format import CheckpointError, parse_checkpoint_name
from shared.checkpoint.manifest import ManifestEntry, manifest_checksums, read_manifest
from shared.exit_codes import EXIT_FAILED, EXIT_USAGE
from shared.run.config import ConfigError, RunConfig, load_run_config
from shared.run.layout import RunLayout, missing_run_json
from shared.run.loss_history import tail_records


def run_dir_problem(root: Path) -> tuple[int, str] | None:
    """(exit code, message) when `root` is not a run directory (missing, a file, no run.json:
    shared/run/layout.py `missing_run_json` words it), else None. The one check behind every
    command that takes a run directory (`status`, `sample`, `export --from-run`, `plot`,
    `pivot`), so each says the same thing with the same exit code, 2 (docs/operations.md#errors)."""
    if RunLayout(root).run_json.exists():
        return None
    return EXIT_USAGE, missing_run_json(root)


def checkpoint_path_problem(path: Path, instead: str) -> tuple[int, str] | None:
    """(2, message) when `path`, given as a checkpoint file, does not exist or is a directory,
    else None (a file: the checkpoint's own rules judge it). `instead` is what the command takes
    for a run directory DIR (`--from-run DIR for its newest valid checkpoint`), named in the
    fix with the path for DIR."""
    if path.is_dir():
        return EXIT_USAGE, (
            f"{path}: a directory, not a checkpoint file; give a step_NNNNNN.bin file, or "
            + instead.replace("DIR", str(path))
        )
    if not path.exists():
        run = path.parent if RunLayout(path.parent).run_json.exists() else "DIR"
        return EXIT_USAGE, (
            f"{path}: no such checkpoint file; `python -m proxy status --run-dir {run}` names "
            "the run's checkpoints"
        )
    return None


def no_checkpoint_problem(run_dir: Path) -> tuple[int, str]:
    """(exit code, message) for a run directory without a valid checkpoint: none written yet
    (2: says the step of the first one and how to get there), or every one fails a rule (1:
    names the newest and its rule; `status` lists them)."""
    present = list_checkpoints(run_dir)
    if present:
        newest = Path(present[-1][1]).name
        return EXIT_FAILED, (
            f"{run_dir}: no valid checkpoint: none of its {len(present)} checkpoint file(s) "
            f"passes the rules (newest {newest}); `python -m proxy status --run-dir {run_dir}` "
            "names each one's fault (docs/checkpoint-format.md#validity)"
        )
    layout = RunLayout(run_dir)
    recs = tail_records(layout.loss)
    step = recs[-1]["step"] if recs else 0
    try:
        every = load_run_config(layout.run_json).checkpoint_every
    except (ConfigError, OSError, ValueError):
        every = None
    first = (
        ""
        if not every
        else f"the first is written at step {every:,} (--checkpoint-every)"
        if step < every
        else f"one is written every {every:,} steps (--checkpoint-every)"
    )
    return EXIT_USAGE, (
        f"{run_dir}: no checkpoint yet: trained to step {step:,}"
        + (f", {first}" if first else "")
        + f"; wait for it while the run trains, or start it with `python -m proxy run "
        f"--run-dir {run_dir}`"
    )


def run_dir_of(path: Path) -> Path:
    """The run directory of checkpoint `path`: its folder, or the one above for a file
    quarantined in rejected/ (docs/checkpoint-format.md#validity)."""
    up = path.parent.parent
    if not RunLayout(path.parent).run_json.exists() and RunLayout(up).run_json.exists():
        return up
    return path.parent


def find_config(path: Path, run_dir: str | None) -> tuple[RunConfig | None, str]:
    """(config, where) for the checkpoint at ``path``; (None, why) when none is at hand."""
    rj = RunLayout(Path(run_dir) if run_dir else run_dir_of(path)).run_json
    if not rj.exists():
        return None, "no run.json beside the file" + ("" if run_dir else " or one folder up")
    try:
        return load_run_config(rj), str(rj)
    except (ConfigError, OSError, ValueError) as e:
        return None, f"{rj}: unreadable ({e})"


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


def newest_valid(run_dir: Path) -> tuple[Path | None, list[str]]:
    """(the newest valid checkpoint of `run_dir` (manifest checksums checked) or None, one
    line per newer checkpoint passed over, newest first: "skipped NAME, newer but invalid
    (rule R): why"), so a command that uses an older file says which it did not use and why."""
    cfg, _ = find_config(RunLayout(run_dir).run_json, str(run_dir))
    try:
        info, rejected = scan_for_resume(
            run_dir, cfg.n_params if cfg else None, manifest_checksums(read_manifest(run_dir))
        )
    except CheckpointError:
        return None, []
    skipped = [
        f"skipped {Path(e.path).name if e.path else '?'}, newer but invalid (rule {e.rule}): {e}"
        for e in rejected
    ]
    return (info.path if info else None), skipped
