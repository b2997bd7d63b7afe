"""Operator tools for one checkpoint file: ``inspect`` and ``export`` (issue 3, SPEC 4).

  python -m proxy inspect PATH                        header, size, checksum, table, norms
  python -m proxy export PATH --to model.safetensors  the weights, named, for other tools

What it is: read-only views of a ``step_NNNNNN.bin`` (numpy; safetensors imported only by
``export``; no torch). The run's config (``run.json``) is looked up beside the file, or one
folder up (a file moved to ``rejected/``), or given with ``--run-dir``.

What it is not: resume (proxy/supervisor.py) or the format itself (shared/checkpoint_format.py).
"""
from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

from shared.config import ConfigError, RunConfig, load_run_config

EXIT_INVALID = 1     # the checkpoint (or its config) fails a rule
EXIT_USAGE = 2       # bad arguments: missing config for export, output in the way


def add_inspect_args(p) -> None:
    """Arguments of ``inspect``: PATH [--run-dir DIR]."""
    p.add_argument("path", help="a step_NNNNNN.bin file")
    p.add_argument("--run-dir", default=None,
                   help="run directory whose run.json describes the model (default: the "
                        "file's folder, or the one above it)")


def add_export_args(p) -> None:
    """Arguments of ``export``: PATH --to OUT.safetensors [--run-dir DIR] [--force]."""
    p.add_argument("path", help="a step_NNNNNN.bin file")
    p.add_argument("--to", required=True, metavar="OUT.safetensors",
                   help="output file (safetensors, float32, tensors named as the model's "
                        "parameters)")
    p.add_argument("--run-dir", default=None,
                   help="run directory whose run.json gives the parameter names and shapes "
                        "(default: the file's folder, or the one above it)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


def _find_config(path: Path, run_dir: str | None) -> tuple[RunConfig | None, str]:
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


def _manifest_entry(path: Path):
    """The manifest entry for ``path`` from its folder's checkpoints.json, or None."""
    from shared.checkpoint_format import parse_checkpoint_name
    from shared.checkpoint_manifest import read_manifest
    step = parse_checkpoint_name(path.name)
    if step is None:
        return None
    # a quarantined file (rejected/step_...bin) is described by the run directory's manifest
    for d in (path.parent, path.parent.parent):
        entries = read_manifest(d)
        if step in entries and entries[step].file == path.name:
            return entries[step]
    return None


def cmd_inspect(a) -> int:
    """Print a checkpoint's header, size check, checksum status, parameter table and norms.

    Reads the file once (one readinto), computes its crc32 and compares it with the manifest
    entry when there is one. Returns 0 when every rule passes, EXIT_INVALID (1) otherwise;
    prints, never raises, for a bad file.
    """
    import numpy as np
    from shared.checkpoint_format import (CheckpointError, expected_size, load_checkpoint,
                                          read_header)
    from shared.config import parameter_table
    path = Path(a.path)
    try:
        step, n = read_header(path)
    except CheckpointError as e:
        print(f"INVALID    (rule: {e.rule}) {e}")
        return EXIT_INVALID
    size = path.stat().st_size
    want_size = expected_size(max(n, 0))
    print(f"file       {path}\nheader     step {step:,}, n_params {n:,}")
    print(f"size       {size:,} bytes, expected {want_size:,} (8 + 12 x n_params): "
          + ("ok" if size == want_size else "MISMATCH"))
    cfg, where = _find_config(path, a.run_dir)
    print(f"config     {where if cfg else 'none: ' + where}"
          + (f" ({cfg.preset}, {cfg.n_params:,} parameters)" if cfg else ""))
    entry = _manifest_entry(path)
    try:
        step, w, m, v = load_checkpoint(path, cfg.n_params if cfg else None)
    except CheckpointError as e:
        print(f"INVALID    (rule: {e.rule}) {e}")
        return EXIT_INVALID
    crc = zlib.crc32(struct.pack("<ii", step, n))
    for arr in (w, m, v):
        crc = zlib.crc32(arr, crc)
    got = "crc32:%08x" % crc
    ok = entry is None or entry.checksum == got
    if entry is None:
        status = "no manifest entry (another writer's file, or the manifest was lost)"
    else:
        status = (f"{'match' if ok else 'MISMATCH: manifest records ' + entry.checksum}; "
                  f"written for {entry.reason}, pinned {'yes' if entry.pinned else 'no'}")
    print(f"checksum   {got}: {status}")
    print(f"valid      {'yes' if ok else 'NO (rule: checksum)'}")
    for name, arr in (("weights", w), ("m", m), ("v", v)):
        print(f"|{name}|".ljust(11) + f"L2 {float(np.linalg.norm(arr)):.6g}  "
              f"max|x| {float(np.abs(arr).max()):.6g}  "
              f"non-finite {int(arr.size - np.isfinite(arr).sum()):,}")
    if cfg is not None:
        print(f"\nparameter table ({cfg.preset}, vocabulary {cfg.vocab_size}):")
        print(f"{'name':<40} {'shape':<16} {'offset':>12} {'|w|':>10}")
        for name, shp, off in parameter_table(cfg.model, cfg.vocab_size):
            size_ = int(np.prod(shp))
            print(f"{name:<40} {str(tuple(shp)):<16} {off:>12,} "
                  f"{float(np.linalg.norm(w[off:off + size_])):>10.4f}")
    return 0 if ok else EXIT_INVALID


def cmd_export(a) -> int:
    """Write the checkpoint's weights to a safetensors file, one tensor per parameter.

    Tensors are float32, named and shaped by ``shared.config.parameter_table`` (the model's
    ``state_dict`` names, e.g. ``transformer.wte.weight`` (vocab, n_embd)); metadata holds
    step, n_params, preset and the source file. The checkpoint is validated first (with the
    manifest checksum when there is an entry). The output is written to a temporary beside it
    and renamed. Returns 0, EXIT_INVALID (1) for a bad checkpoint, EXIT_USAGE (2) when the
    config is missing or OUT exists without --force.
    """
    import numpy as np
    from safetensors.numpy import save
    from shared.checkpoint_format import CheckpointError, load_checkpoint
    from shared.config import parameter_table
    path, out = Path(a.path), Path(a.to)
    cfg, where = _find_config(path, a.run_dir)
    if cfg is None:
        print(f"export: {path}: cannot name the parameters: {where}; pass --run-dir DIR "
              f"(the run that wrote it)")
        return EXIT_USAGE
    if out.exists() and not a.force:
        print(f"export: {out} exists; pass --force to overwrite it")
        return EXIT_USAGE
    entry = _manifest_entry(path)
    try:
        step, w, _, _ = load_checkpoint(path, cfg.n_params, entry.checksum if entry else None)
    except CheckpointError as e:
        print(f"INVALID    (rule: {e.rule}) {e}")
        return EXIT_INVALID
    tensors = {}
    for name, shp, off in parameter_table(cfg.model, cfg.vocab_size):
        size = int(np.prod(shp))
        tensors[name] = w[off:off + size].reshape(shp)  # a view: contiguous, no copy
    meta = {"format": "pt", "step": str(step), "n_params": str(cfg.n_params),
            "preset": cfg.preset, "vocab_size": str(cfg.vocab_size), "source": path.name}
    from shared.atomic_io import atomic_write_bytes
    atomic_write_bytes(out, save(tensors, metadata=meta))  # tmp + fsync + rename: never torn
    print(f"exported {path.name} (step {step:,}, {cfg.n_params:,} parameters, "
          f"{len(tensors)} tensors) to {out}")
    return 0
