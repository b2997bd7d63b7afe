"""`python -m proxy export`: a checkpoint's weights for other tools (docs/checkpoint-format.md):
a safetensors file under the project's names, or with `--format hf` a transformers GPT-2 folder
(proxy/commands/hf_export.py). Read-only; numpy and safetensors, no torch. The run's config is
found as proxy/run_files/checkpoint_lookup.py `find_config` says.

What it is not: `inspect` (proxy/commands/inspect.py), resume (proxy/supervision/) or the format
itself (shared/checkpoint/file_format.py).
"""

from __future__ import annotations

from pathlib import Path

from safetensors.numpy import save

from proxy.commands.hf_export import HFExportError, named_tensors, write_hf_dir
from proxy.commands.tool_threads import add_threads_arg
from proxy.run_files.checkpoint_lookup import (
    checkpoint_path_problem,
    find_config,
    manifest_entry,
    newest_valid,
    no_checkpoint_problem,
    run_dir_problem,
)
from shared.atomic_io import atomic_write_bytes
from shared.checkpoint.file_format import CheckpointError
from shared.checkpoint.read import load_weights
from shared.exit_codes import EXIT_FAILED as EXIT_INVALID  # the checkpoint fails a rule
from shared.exit_codes import EXIT_USAGE  # bad arguments: no config for export, output in the way
from shared.run.layout import RunLayout


def add_export_args(p) -> None:
    """Arguments of ``export``: [PATH | --from-run RUN] --to OUT [--format safetensors|hf]
    [--run-dir DIR] [--force]."""
    add_threads_arg(p)
    p.add_argument(
        "path",
        nargs="?",
        help="a step_NNNNNN.bin file (or give --from-run RUN instead)",
    )
    p.add_argument(
        "--from-run",
        metavar="RUN",
        help="export the newest valid checkpoint of run directory RUN (checksums "
        "checked against its manifest)",
    )
    p.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="safetensors: one file, float32 tensors under the project's parameter "
        "names and shapes (default); hf: a Hugging Face transformers folder "
        "(config.json, model.safetensors in GPT-2 layout, generation_config.json, "
        "tokenizer.json, tokenizer_config.json) that "
        "AutoModelForCausalLM/AutoTokenizer.from_pretrained(OUT) load",
    )
    p.add_argument(
        "--to",
        required=True,
        metavar="OUT",
        help="output: a .safetensors file (--format safetensors) or a folder "
        "(--format hf; created, or replaced with --force)",
    )
    p.add_argument(
        "--run-dir",
        help="run directory whose run.json gives the parameter names and shapes "
        "(default: the file's folder, or the one above it; --from-run's RUN)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="overwrite OUT (a file, or a non-empty folder) if it exists",
    )


def _bad_output(to: str, fmt: str) -> str | None:
    """Why `--to` cannot be the output of format `fmt` (a sentence with the fix), else None: a
    safetensors export is one file, an hf export a folder."""
    p = Path(to)
    if fmt == "safetensors" and (to.endswith("/") or p.is_dir()):
        return (
            "a folder; --format safetensors writes one file: give a file name "
            f"(e.g. {p / 'model.safetensors'}), or --format hf for a folder"
        )
    if fmt == "hf" and p.suffix in (".safetensors", ".bin", ".pt"):
        return (
            f"ends in {p.suffix} but --format hf writes a folder (config.json, "
            "model.safetensors, tokenizer ...): give a folder name, or --format safetensors"
        )
    return None


def cmd_export(a) -> int:
    """Write the checkpoint's weights, validated first, to a safetensors file atomically: one
    float32 tensor per parameter, named and shaped by ``shared.run.config.parameter_table``
    (e.g. ``transformer.wte.weight`` (vocab, n_embd)); metadata: step, n_params, preset, vocab
    size and the source file. Returns 0, EXIT_INVALID (1) for a bad checkpoint (or a --from-run
    whose every checkpoint is), EXIT_USAGE (2) for bad input (docs/operations.md#errors) or OUT
    in the way without --force."""
    if (a.path is None) == (a.from_run is None):
        print("export: give a checkpoint PATH or --from-run RUN (one of them)")
        return EXIT_USAGE
    out = Path(a.to)
    if (why := _bad_output(a.to, a.format)) is not None:
        print(f"export: --to {a.to}: {why}")
        return EXIT_USAGE
    problem = (
        checkpoint_path_problem(Path(a.path), "--from-run DIR for its newest valid checkpoint")
        if a.path is not None
        else run_dir_problem(Path(a.from_run))
    )
    if problem is not None:
        print(f"export: {problem[1]}")
        return problem[0]
    if a.from_run is not None:
        path, skipped = newest_valid(Path(a.from_run))
        for line in skipped:
            print(f"export: {line}")
        if path is None:
            code, message = no_checkpoint_problem(Path(a.from_run))
            print(f"export: {message}")
            return code
        a.run_dir = a.run_dir or a.from_run
    else:
        path = Path(a.path)
    cfg, where = find_config(path, a.run_dir)
    if cfg is None:
        print(
            f"export: {path}: cannot name the parameters: {where}; pass --run-dir DIR "
            f"(the run that wrote it)"
        )
        return EXIT_USAGE
    if a.format == "hf":
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not a.force:
            print(
                f"export: {out} exists"
                + (" and is not empty" if out.is_dir() else "")
                + "; pass --force to replace it"
            )
            return EXIT_USAGE
    elif out.exists() and not a.force:
        print(f"export: {out} exists; pass --force to overwrite it")
        return EXIT_USAGE
    # read once, only the weights kept: memory is 4 x n_params bytes, not 12 (load_weights)
    entry = manifest_entry(path)
    try:
        step, w = load_weights(path, cfg.n_params, entry.checksum if entry else None)
    except CheckpointError as e:
        print(f"INVALID    (rule: {e.rule}) {e}")
        return EXIT_INVALID
    if a.format == "hf":
        run = RunLayout(Path(where).parent)  # the folder whose run.json described the checkpoint
        try:
            names = write_hf_dir(out, cfg, run.tokenizer, step, w, path.name, a.force)
        except (HFExportError, OSError) as e:
            print(f"export: {e}")
            return EXIT_USAGE
        print(
            f"exported {path.name} (step {step:,}, {cfg.n_params:,} parameters, {cfg.preset}, "
            f"{cfg.tokenizer} tokenizer) as a Hugging Face GPT-2 folder {out}: "
            f"{', '.join(names)}\nload it with: AutoModelForCausalLM.from_pretrained("
            f"{str(out)!r}) and AutoTokenizer.from_pretrained({str(out)!r})"
        )
        return 0
    tensors = named_tensors(cfg, w)  # views: contiguous, no copy
    meta = {
        "format": "pt",
        "step": str(step),
        "n_params": str(cfg.n_params),
        "preset": cfg.preset,
        "vocab_size": str(cfg.vocab_size),
        "source": path.name,
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # as --format hf and plot --out do
    except OSError as e:
        print(f"export: --to {out}: cannot make its folder {out.parent} ({e.strerror})")
        return EXIT_USAGE
    atomic_write_bytes(out, save(tensors, metadata=meta))  # tmp + fsync + rename: never torn
    print(
        f"exported {path.name} (step {step:,}, {cfg.n_params:,} parameters, "
        f"{len(tensors)} tensors) to {out}"
    )
    return 0
