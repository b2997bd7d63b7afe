"""Operator tools for one checkpoint file: ``inspect`` and ``export`` (docs/checkpoint-format.md).

  python -m proxy inspect PATH                        header, size, checksum, table, norms
  python -m proxy export PATH --to model.safetensors  the weights, named, for other tools
  python -m proxy export PATH|--from-run RUN --format hf --to DIR   a transformers GPT-2 folder
                                                      (proxy/hf_export.py)

What it is: read-only views of a ``step_NNNNNN.bin`` (numpy; safetensors imported only by
``export``; no torch). The run's config (``run.json``) is looked up beside the file, or one
folder up (a file moved to ``rejected/``), or given with ``--run-dir``.

What it is not: resume (proxy/supervisor.py) or the format itself (shared/checkpoint_format.py).
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

from shared.config import ConfigError, RunConfig, load_run_config
from shared.exit_codes import EXIT_FAILED as EXIT_INVALID  # the checkpoint fails a rule
from shared.exit_codes import EXIT_USAGE  # bad arguments: no config for export, output in the way


def add_inspect_args(p) -> None:
    """Arguments of ``inspect``: PATH [--run-dir DIR]."""
    p.add_argument("path", help="a step_NNNNNN.bin file")
    p.add_argument("--run-dir", default=None,
                   help="run directory whose run.json describes the model (default: the "
                        "file's folder, or the one above it)")


def add_export_args(p) -> None:
    """Arguments of ``export``: [PATH | --from-run RUN] --to OUT [--format safetensors|hf]
    [--run-dir DIR] [--force]."""
    p.add_argument("path", nargs="?", default=None,
                   help="a step_NNNNNN.bin file (or give --from-run RUN instead)")
    p.add_argument("--from-run", default=None, metavar="RUN",
                   help="export the newest valid checkpoint of run directory RUN (checksums "
                        "checked against its manifest)")
    p.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors: one file, float32 tensors under the project's parameter "
                        "names and shapes (default); hf: a Hugging Face transformers folder "
                        "(config.json, model.safetensors in GPT-2 layout, generation_config.json, "
                        "tokenizer.json, tokenizer_config.json) that "
                        "AutoModelForCausalLM/AutoTokenizer.from_pretrained(OUT) load")
    p.add_argument("--to", required=True, metavar="OUT",
                   help="output: a .safetensors file (--format safetensors) or a folder "
                        "(--format hf; created, or replaced with --force)")
    p.add_argument("--run-dir", default=None,
                   help="run directory whose run.json gives the parameter names and shapes "
                        "(default: the file's folder, or the one above it; --from-run's RUN)")
    p.add_argument("--force", action="store_true",
                   help="overwrite OUT (a file, or a non-empty folder) if it exists")


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


def manifest_entry(path: Path):
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


def read_weights(path: Path, cfg: RunConfig):
    """(step, weights float32 (n_params,)) of a checkpoint validated against `cfg` (with the
    manifest checksum when the manifest has an entry), or None after printing the rule it
    broke (docs/checkpoint-format.md#validity)."""
    from shared.checkpoint_format import CheckpointError, load_checkpoint
    entry = manifest_entry(path)
    try:
        step, w, _, _ = load_checkpoint(path, cfg.n_params, entry.checksum if entry else None)
    except CheckpointError as e:
        print(f"INVALID    (rule: {e.rule}) {e}")
        return None
    return step, w


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
    entry = manifest_entry(path)
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
        with np.errstate(over="ignore", invalid="ignore"):  # a corrupt file's norm is inf, said
            l2 = float(np.linalg.norm(arr))
        print(f"|{name}|".ljust(11) + f"L2 {l2:.6g}  "
              f"max|x| {float(np.abs(arr).max()):.6g}  "
              f"non-finite {int(arr.size - np.isfinite(arr).sum()):,}")
    if cfg is not None:
        print(f"\nparameter table ({cfg.preset}, vocabulary {cfg.vocab_size}):")
        print(f"{'name':<40} {'shape':<16} {'offset':>12} {'|w|':>10}")
        for name, shp, off in parameter_table(cfg.model, cfg.vocab_size):
            size_ = int(np.prod(shp))
            with np.errstate(over="ignore", invalid="ignore"):
                l2 = float(np.linalg.norm(w[off:off + size_]))
            print(f"{name:<40} {str(tuple(shp)):<16} {off:>12,} {l2:>10.4f}")
    return 0 if ok else EXIT_INVALID


def _bad_output(to: str, fmt: str) -> str | None:
    """Why `--to` cannot be the output of format `fmt` (a sentence with the fix), else None:
    a safetensors export is one file (a name ending in '/' or an existing folder is not), an
    hf export a folder (a name ending in .safetensors is not: a tool looking for the file would
    find a directory)."""
    p = Path(to)
    if fmt == "safetensors" and (to.endswith("/") or p.is_dir()):
        return ("a folder; --format safetensors writes one file: give a file name "
                f"(e.g. {p / 'model.safetensors'}), or --format hf for a folder")
    if fmt == "hf" and p.suffix in (".safetensors", ".bin", ".pt"):
        return (f"ends in {p.suffix} but --format hf writes a folder (config.json, "
                "model.safetensors, tokenizer ...): give a folder name, or --format safetensors")
    return None


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
    from shared.config import parameter_table
    if (a.path is None) == (a.from_run is None):
        print("export: give a checkpoint PATH or --from-run RUN (one of them)")
        return EXIT_USAGE
    out = Path(a.to)
    if (why := _bad_output(a.to, a.format)) is not None:
        print(f"export: --to {a.to}: {why}")
        return EXIT_USAGE
    if a.path is not None and not Path(a.path).is_file():
        p = Path(a.path)
        print(f"export: {p}: " + ("a directory; give a checkpoint file, or --from-run "
                                  f"{p} for its newest valid checkpoint" if p.is_dir()
                                  else "no such checkpoint file"))
        return EXIT_USAGE
    if a.from_run is not None:
        path = _newest_valid(Path(a.from_run))
        if path is None:
            print(f"export: {a.from_run} has no valid checkpoint (see `python -m proxy status "
                  f"--run-dir {a.from_run}`)")
            return EXIT_INVALID
        a.run_dir = a.run_dir or a.from_run
    else:
        path = Path(a.path)
    cfg, where = _find_config(path, a.run_dir)
    if cfg is None:
        print(f"export: {path}: cannot name the parameters: {where}; pass --run-dir DIR "
              f"(the run that wrote it)")
        return EXIT_USAGE
    if a.format == "hf":
        from proxy.commands.hf_export import export_hf
        return export_hf(a, path, cfg, where, out)
    if out.exists() and not a.force:
        print(f"export: {out} exists; pass --force to overwrite it")
        return EXIT_USAGE
    got = read_weights(path, cfg)
    if got is None:
        return EXIT_INVALID
    step, w = got
    tensors = {}
    for name, shp, off in parameter_table(cfg.model, cfg.vocab_size):
        size = int(np.prod(shp))
        tensors[name] = w[off:off + size].reshape(shp)  # a view: contiguous, no copy
    meta = {"format": "pt", "step": str(step), "n_params": str(cfg.n_params),
            "preset": cfg.preset, "vocab_size": str(cfg.vocab_size), "source": path.name}
    from shared.atomic_io import atomic_write_bytes
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # as --format hf and plot --out do
    except OSError as e:
        print(f"export: --to {out}: cannot make its folder {out.parent} ({e.strerror})")
        return EXIT_USAGE
    atomic_write_bytes(out, save(tensors, metadata=meta))  # tmp + fsync + rename: never torn
    print(f"exported {path.name} (step {step:,}, {cfg.n_params:,} parameters, "
          f"{len(tensors)} tensors) to {out}")
    return 0


def _newest_valid(run_dir: Path) -> Path | None:
    """The newest valid checkpoint of `run_dir` (manifest checksums checked), or None."""
    from shared.checkpoint_format import CheckpointError, find_latest_valid
    from shared.checkpoint_manifest import manifest_checksums, read_manifest
    cfg, _ = _find_config(run_dir / "run.json", str(run_dir))
    try:
        info, _ = find_latest_valid(run_dir, cfg.n_params if cfg else None,
                                    manifest_checksums(read_manifest(run_dir)))
    except CheckpointError:
        return None
    return info.path if info else None
