"""`python -m proxy fork --from RUN_DIR[:STEP] --run-dir NEW_DIR`: an audit fork (docs/operations.md).

A new run directory that starts from checkpoint STEP of another run (default: its newest valid
one) with that run's history up to it, so two configurations can be compared from the same
weights. Copied: run.json, tokenizer.json, data/ (hard links where the file system allows, else
copies; `tokens` arms keep pointing at their own source file; `data/arms.json` and run.json's
arm list as they were at STEP: arms added later are left out, arms removed later are active),
phases.json (the phases that started at or before STEP), the checkpoint file and its manifest
entry (pinned), and the `.loss.json` records 1..STEP. `.state.json` is not copied: the new run's
proxy rebuilds the bandit by replaying the copied history (docs/bandit.md#determinism). Then
`python -m proxy run --run-dir NEW_DIR` (optionally after `pivot`) resumes from the checkpoint.

The source run may be live: every file copied is written atomically there (or, for `.loss.json`,
read tolerantly up to STEP), so a fork never sees a torn file.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import sys
from pathlib import Path

from proxy.mixture.arm_changes import arms_as_of, specs_of
from proxy.run_files.phases import copy_phases
from shared.atomic_io import atomic_write_json
from shared.checkpoint.directory import scan_for_resume
from shared.checkpoint.file_format import CheckpointError, checkpoint_name, parse_checkpoint_name
from shared.checkpoint.manifest import (
    manifest_checksums,
    read_manifest,
    record_checkpoint,
)
from shared.checkpoint.read import validate_checkpoint
from shared.data.arms import ArmSourceError
from shared.data.token_files import read_arm_index_doc, write_arm_index_doc
from shared.exit_codes import EXIT_USAGE
from shared.run.config import ConfigError, load_run_config
from shared.run.layout import RunLayout
from shared.run.loss_history import LossHistory, iter_records


class ForkError(RuntimeError):
    """The fork cannot be made; the message names the path, the value and the fix."""


def parse_from(text: str) -> tuple[Path, int | None]:
    """ "RUN_DIR", "RUN_DIR:STEP" or a checkpoint file "RUN_DIR/step_NNNNNN.bin" -> (run
    directory, step or None). A directory that exists is taken whole (even with a ':' in its
    name). Raises ForkError for a STEP that is not a number."""
    p = Path(text)
    if p.is_dir():
        return p, None
    step = parse_checkpoint_name(p.name)
    if step is not None:
        return p.parent, step
    head, sep, tail = text.rpartition(":")
    if sep and head:
        if tail.isdigit():
            return Path(head), int(tail)
        raise ForkError(
            f"--from {text}: step {tail!r} is not a number; give RUN_DIR:STEP (e.g. "
            f"{head}:100) or a checkpoint file (RUN_DIR/{checkpoint_name(100)})"
        )
    return p, None


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def fork_run(src_dir: Path, step: int | None, new_dir: Path) -> int:
    """Make the audit fork; returns the checkpoint step it starts from.

    Raises ForkError when the source is not a run, the step has no valid checkpoint, or the new
    directory already holds a run (or anything else)."""
    src, dst = RunLayout(src_dir), RunLayout(new_dir)
    try:
        cfg = load_run_config(src.run_json)
    except ConfigError as e:
        raise ForkError(f"--from {src_dir}: {e}") from None
    if dst.root.exists() and any(dst.root.iterdir()):
        raise ForkError(
            f"--run-dir {dst.root}: exists and is not empty; an audit fork needs a new directory"
        )
    entries = read_manifest(src.root)
    checks = manifest_checksums(entries)
    if step is None:
        info, _ = scan_for_resume(src.root, cfg.n_params, checks)
        if info is None:
            raise ForkError(f"--from {src_dir}: no valid checkpoint to fork from")
        step = info.step
    ck = src.root / checkpoint_name(step)
    try:
        validate_checkpoint(ck, cfg.n_params, checks.get(step))
    except CheckpointError as e:
        raise ForkError(
            f"--from {src_dir}:{step}: {e}; checkpoints in the manifest: {sorted(entries)}"
        ) from None
    try:
        arms = arms_as_of(read_arm_index_doc(src), step)  # the arms of STEP
    except ArmSourceError as e:
        raise ForkError(f"--from {src_dir}: {e}") from None
    dst.ensure()
    shutil.copy2(src.tokenizer, dst.tokenizer)
    for f in sorted(src.data.iterdir()):
        if f.is_file() and f.name != src.arms_index.name:
            _link_or_copy(f, dst.data / f.name)
    write_arm_index_doc(dst, arms)
    cfg.arms = specs_of(arms, cfg.arms)
    copy_phases(src, dst, step)
    _link_or_copy(ck, dst.root / ck.name)
    entry = entries.get(step)
    if entry is not None:
        record_checkpoint(dst.root, dataclasses.replace(entry, pinned=True))
    with LossHistory(dst.loss) as h:  # streamed in batches: memory flat in the history
        records = itertools.takewhile(lambda r: r["step"] <= step, iter_records(src.loss))
        while batch := list(itertools.islice(records, 4096)):
            h.append_many(batch)
        last = h.last_step
    if last is not None and last != step:
        print(f"fork: warning: the source history ends at step {last}, not {step}", file=sys.stderr)
    atomic_write_json(
        dst.fork_json,
        {"from": str(src.root.resolve()), "step": step, "checkpoint": ck.name},
    )
    atomic_write_json(dst.run_json, cfg.to_json())  # last: its presence marks a complete run
    return step


def cmd_fork(a) -> int:
    try:
        src, step = parse_from(a.from_run)
        s = fork_run(src, step, Path(a.run_dir))
    except ForkError as e:
        print(f"fork refused: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(
        f"fork: {a.run_dir} starts from {src}/{checkpoint_name(s)} (step {s}) with its "
        f"history; run it with: python -m proxy run --run-dir {a.run_dir}"
    )
    return 0


def add_fork_args(p) -> None:
    """`fork --from RUN_DIR[:STEP] --run-dir NEW`."""
    p.add_argument(
        "--from",
        dest="from_run",
        required=True,
        metavar="RUN_DIR[:STEP]",
        help="the run to fork and its checkpoint step (default: its newest valid one)",
    )
    p.add_argument(
        "--run-dir", required=True, metavar="NEW", help="the new run directory (must not exist)"
    )
