"""`python -m proxy sample PATH|--run-dir DIR`: text from a checkpoint (SPEC section 6).

Loads the run's config and tokenizer, the checkpoint's weights (validated; checksum checked when
the manifest has one) into a GPT, and prints continuations of a prompt. torch is imported here,
lazily: the proxy's hot path never imports it.
"""
from __future__ import annotations

import sys
from pathlib import Path

from shared.config import ConfigError, load_run_config
from shared.run_layout import RunLayout


def add_sample_parser(sub) -> None:
    p = sub.add_parser("sample", help="generate text from a checkpoint")
    p.add_argument("path", nargs="?", default=None, help="step_NNNNNN.bin (default: the newest "
                   "valid checkpoint of --run-dir)")
    p.add_argument("--run-dir", default=None, help="run directory (default: the file's folder)")
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--tokens", type=int, default=100, help="tokens to generate per sample")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)


def cmd_sample(a) -> int:
    """Print `--samples` continuations of `--prompt`; exit 2 on bad input (named), 0 otherwise."""
    from shared.checkpoint_format import CheckpointError, find_latest_valid, load_checkpoint, \
        parse_checkpoint_name
    from shared.checkpoint_manifest import manifest_checksums, read_manifest
    from shared.tokenizer import RunTokenizer
    run_dir = Path(a.run_dir) if a.run_dir else (Path(a.path).parent if a.path else None)
    if run_dir is None:
        print("sample: give a checkpoint PATH or --run-dir", file=sys.stderr)
        return 2
    if a.tokens < 1 or a.samples < 1 or a.temperature <= 0 or a.top_k < 0:
        print("sample: --tokens and --samples must be >= 1, --temperature > 0, --top-k >= 0",
              file=sys.stderr)
        return 2
    layout = RunLayout(run_dir)
    try:
        cfg = load_run_config(layout.run_json)
        tok = RunTokenizer.load(layout.tokenizer)
        sums = manifest_checksums(read_manifest(run_dir))
        if a.path:
            path = Path(a.path)
        else:
            info, _ = find_latest_valid(run_dir, cfg.n_params, sums)
            if info is None:
                print(f"sample: {run_dir} has no valid checkpoint", file=sys.stderr)
                return 2
            path = info.path
        step, w, _, _ = load_checkpoint(path, cfg.n_params, sums.get(parse_checkpoint_name(path.name)))
    except (ConfigError, CheckpointError) as e:
        print(f"sample: {e}", file=sys.stderr)
        return 2
    import torch
    from worker.model import GPT
    model = GPT(cfg.model, cfg.vocab_size)
    with torch.no_grad():
        model.flat.copy_(torch.from_numpy(w))
    model.eval()
    ids = tok.encode(a.prompt).astype("int64")
    if len(ids) == 0:
        print("sample: --prompt is empty after tokenization", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(a.seed)
    idx = torch.from_numpy(ids).view(1, -1).repeat(a.samples, 1)
    out = model.generate(idx, a.tokens, a.temperature, a.top_k or None, g)
    print(f"# {path.name} (step {step:,}), temperature {a.temperature}, top-k {a.top_k}")
    for i in range(a.samples):
        print(f"--- sample {i + 1}\n{a.prompt}{tok.decode(out[i, len(ids):].tolist())}")
    return 0
