"""`python -m proxy sample PATH|--run-dir DIR`: text from a checkpoint (docs/architecture.md#processes).

Loads the run's config and tokenizer and the checkpoint's weights only (worker/sampling.py
`load_weights_only`) into a GPT with no optimizer, generates all `--samples` in one batch, and
prints each with the prompt and the continuation apart (proxy/observation/sample_format.py, as in
the run's log), then the time it took. torch is imported here, lazily: the proxy's hot path never
imports it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from proxy.commands.tool_threads import add_threads_arg, set_torch_threads, tool_threads
from proxy.observation.sample_format import format_sample
from proxy.run_files.checkpoint_lookup import (
    checkpoint_path_problem,
    manifest_entry,
    newest_valid,
    no_checkpoint_problem,
    run_dir_of,
    run_dir_problem,
)
from shared.checkpoint.file_format import CheckpointError
from shared.data.tokenizer import RunTokenizer
from shared.exit_codes import EXIT_FAILED, EXIT_USAGE
from shared.run.config import SAMPLE_TEMPERATURE, SAMPLE_TOP_K, ConfigError, load_run_config
from shared.run.layout import RunLayout


def add_sample_args(p) -> None:
    """`sample [PATH] [--run-dir DIR] [--prompt TEXT] [--tokens N] [--samples N]
    [--temperature T] [--top-k K] [--seed S]`."""
    p.add_argument(
        "path",
        nargs="?",
        help="step_NNNNNN.bin (default: the newest valid checkpoint of --run-dir)",
    )
    p.add_argument(
        "--run-dir",
        help="run directory: run.json and tokenizer.json (default: the checkpoint's folder)",
    )
    p.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    p.add_argument(
        "--tokens",
        type=int,
        default=100,
        help="tokens to generate per sample (default: %(default)s)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="continuations to generate, all in one batch (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=SAMPLE_TEMPERATURE,
        help="softmax temperature, >= 0; lower is more conservative, 0 is greedy (the same as "
        "--top-k 1) (default: %(default)s)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=SAMPLE_TOP_K,
        help="sample among the K most likely tokens; 0 = all (default: %(default)s)",
    )
    add_threads_arg(p)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed: the same seed gives the same text (default: %(default)s)",
    )


def cmd_sample(a) -> int:
    """Print `--samples` continuations of `--prompt`; exit 0, 1 when the checkpoint fails a
    rule (or every checkpoint of the run does), 2 on bad input: a bad value, a PATH that is no
    checkpoint file, a run directory that is not one or has no checkpoint yet (each named, with
    the next step; proxy/run_files/checkpoint_lookup.py words them for every command)."""
    t_start = time.perf_counter()
    if a.path and not a.run_dir and Path(a.path).is_dir():  # `sample RUN_DIR`: its newest
        a.run_dir, a.path = a.path, None
    run_dir = Path(a.run_dir) if a.run_dir else (run_dir_of(Path(a.path)) if a.path else None)
    if run_dir is None:
        print("sample: give a checkpoint PATH or --run-dir", file=sys.stderr)
        return EXIT_USAGE
    bad = [
        f"--{name} {value}: {rule}"
        for name, value, ok, rule in (
            ("tokens", a.tokens, a.tokens >= 1, "must be >= 1"),
            ("samples", a.samples, a.samples >= 1, "must be >= 1"),
            ("threads", a.threads, a.threads is None or a.threads >= 1, "must be >= 1"),
            ("temperature", a.temperature, a.temperature >= 0, "must be >= 0 (0: greedy)"),
            ("top-k", a.top_k, a.top_k >= 0, "must be >= 0 (0: no limit)"),
        )
        if not ok
    ]
    if bad:
        print("sample: " + "; ".join(bad), file=sys.stderr)
        return EXIT_USAGE
    greedy = a.temperature == 0
    if greedy:  # the most likely token each time, as --top-k 1 gives
        a.temperature, a.top_k = 1.0, 1
    layout = RunLayout(run_dir)
    problem = (
        checkpoint_path_problem(Path(a.path), "--run-dir DIR for its newest valid checkpoint")
        if a.path
        else None
    ) or run_dir_problem(run_dir)
    if problem is not None:
        print(f"sample: {problem[1]}", file=sys.stderr)
        return problem[0]
    try:
        cfg = load_run_config(layout.run_json)
        tok = RunTokenizer.load(layout.tokenizer)
        path, skipped = (Path(a.path), []) if a.path else newest_valid(run_dir)  # checksummed
        for line in skipped:
            print(f"sample: {line}", file=sys.stderr)
        if path is None:
            code, message = no_checkpoint_problem(run_dir)
            print(f"sample: {message}", file=sys.stderr)
            return code
        entry = manifest_entry(path)  # also for a quarantined rejected/step_*.bin
        ids = tok.encode(a.prompt).astype("int64")
        if len(ids) == 0:
            print("sample: --prompt is empty after tokenization", file=sys.stderr)
            return EXIT_USAGE
        import torch  # heavy: only `sample` needs it, so it is imported only here

        from worker.sampling import generate_batched, load_weights_only

        set_torch_threads(tool_threads(a.threads))
        threads = torch.get_num_threads()  # what torch really uses
        step, model = load_weights_only(path, cfg, entry.checksum if entry else None)
    except ConfigError as e:
        print(f"sample: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as e:  # the file fails a rule: as `inspect` and `export` say it
        print(f"sample: {e}", file=sys.stderr)
        return EXIT_FAILED
    t_gen = time.perf_counter()
    g = torch.Generator().manual_seed(a.seed)
    idx = torch.from_numpy(ids).view(1, -1).repeat(a.samples, 1)
    out = generate_batched(model, idx, a.tokens, a.temperature, a.top_k or None, g)
    t_end = time.perf_counter()
    how = "greedy" if greedy else f"temperature {a.temperature}, top-k {a.top_k}"
    print(f"# {path.name} (step {step:,}), {how}, seed {a.seed}")
    for i in range(a.samples):
        print(
            format_sample(
                f"sample {i + 1}/{a.samples}",
                a.prompt,
                tok.decode(out[i, len(ids) :].tolist()),
                max_lines=None,
            )
        )
    print(
        f"# {a.samples} x {a.tokens} tokens in {t_end - t_gen:.2f} s "
        f"({a.samples * a.tokens / max(t_end - t_gen, 1e-9):,.0f} tokens/s, {threads} "
        f"thread{'s' if threads > 1 else ''}); {t_end - t_start:.2f} s in all with loading"
    )
    return 0
