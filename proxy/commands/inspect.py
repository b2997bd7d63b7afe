"""`python -m proxy inspect PATH`: a checkpoint's header, size, checksum, parameter table and
norms (docs/checkpoint-format.md). Read-only; numpy, no torch.

What it is not: `export` (proxy/commands/export.py) or the format (shared/checkpoint/file_format.py).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from proxy.commands.tool_threads import add_threads_arg
from proxy.run_files.checkpoint_lookup import checkpoint_path_problem, find_config, manifest_entry
from shared.checkpoint.file_format import CheckpointError, expected_size
from shared.checkpoint.read import load_checkpoint, read_header
from shared.exit_codes import EXIT_FAILED as EXIT_INVALID  # the checkpoint fails a rule
from shared.run.config import parameter_table


def add_inspect_args(p) -> None:
    """Arguments of ``inspect``: PATH [--run-dir DIR]."""
    add_threads_arg(p)
    p.add_argument("path", help="a step_NNNNNN.bin file")
    p.add_argument(
        "--run-dir",
        help="run directory whose run.json describes the model (default: the "
        "file's folder, or the one above it)",
    )


def cmd_inspect(a) -> int:
    """Print a checkpoint's header, size check, checksum status (its crc32 against the manifest
    entry), parameter table and norms. Returns 0 when every rule passes, EXIT_INVALID (1)
    otherwise, EXIT_USAGE (2) when PATH does not exist or is a directory
    (docs/operations.md#errors); prints, never raises, for a bad file."""
    path = Path(a.path)
    problem = checkpoint_path_problem(
        path, "`python -m proxy status --run-dir DIR` for its checkpoints"
    )
    if problem is not None:
        print(f"inspect: {problem[1]}")
        return problem[0]
    try:  # the header, then the whole file: either may fail a rule
        step, n = read_header(path)
        size = path.stat().st_size
        want_size = expected_size(max(n, 0))
        print(f"file       {path}\nheader     step {step:,}, n_params {n:,}")
        print(
            f"size       {size:,} bytes, expected {want_size:,} (8 + 12 x n_params): "
            + ("ok" if size == want_size else "MISMATCH")
        )
        cfg, where = find_config(path, a.run_dir)
        print(
            f"config     {where if cfg else 'none: ' + where}"
            + (f" ({cfg.preset}, {cfg.n_params:,} parameters)" if cfg else "")
        )
        entry = manifest_entry(path)
        # rule 8 (values) is reported below, with the non-finite counts, not refused
        step, w, m, v = load_checkpoint(path, cfg.n_params if cfg else None, values=False)
    except CheckpointError as e:
        print(f"INVALID    (rule: {e.rule}) {e}")
        return EXIT_INVALID
    crc = zlib.crc32(struct.pack("<ii", step, n))
    for arr in (w, m, v):
        crc = zlib.crc32(arr, crc)  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs omit it
    got = "crc32:%08x" % crc
    ok = entry is None or entry.checksum == got
    if entry is None:
        status = "no manifest entry (another writer's file, or the manifest was lost)"
    else:
        status = (
            f"{'match' if ok else 'MISMATCH: manifest records ' + entry.checksum}; "
            f"written for {entry.reason}, pinned {'yes' if entry.pinned else 'no'}"
        )
    print(f"checksum   {got}: {status}")
    print(f"valid      {'yes' if ok else 'NO (rule: checksum)'}")
    for name, arr in (("weights", w), ("m", m), ("v", v)):
        with np.errstate(over="ignore", invalid="ignore"):  # a corrupt file's norm is inf, said
            l2 = float(np.linalg.norm(arr))
        print(
            f"|{name}|".ljust(11) + f"L2 {l2:.6g}  "
            f"max|x| {float(np.abs(arr).max()):.6g}  "
            f"non-finite {int(arr.size - np.isfinite(arr).sum()):,}"
        )
    if cfg is not None:
        print(f"\nparameter table ({cfg.preset}, vocabulary {cfg.vocab_size}):")
        print(f"{'name':<40} {'shape':<16} {'offset':>12} {'|w|':>10}")
        for name, shp, off in parameter_table(cfg.model, cfg.vocab_size):
            size_ = int(np.prod(shp))
            with np.errstate(over="ignore", invalid="ignore"):
                l2 = float(np.linalg.norm(w[off : off + size_]))
            print(f"{name:<40} {str(tuple(shp)):<16} {off:>12,} {l2:>10.4f}")
    return 0 if ok else EXIT_INVALID
