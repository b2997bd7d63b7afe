"""Hugging Face export: a checkpoint as a `transformers` GPT-2 model directory.

  python -m proxy export RUN/step_000600.bin --format hf --to DIR
  python -m proxy export --from-run RUN --format hf --to DIR     (the newest valid checkpoint)

writes DIR/config.json, model.safetensors, generation_config.json, tokenizer.json and
tokenizer_config.json, which `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load as they are.

Why it is exact: the project's GPT (worker/model.py, docs/architecture.md#the-worker) is GPT-2's
architecture with an untied head: pre-norm blocks, LayerNorm eps 1e-5, exact (erf) GELU
(`nn.GELU()` = HF's "gelu", not the tanh "gelu_new"), learned positions, biases on, no head
bias, q/k/v split in that order from one c_attn. HF's GPT-2 stores its four projections as
Conv1D weights of shape (in, out), the transpose of nn.Linear's (out, in); those four are
transposed here, everything else is copied under the same name.

Tokenizer: the run's BPE `tokenizer.json` is already a `tokenizers` file; the bytes tokenizer
(ids = the UTF-8 bytes, shared/data/tokenizer.py) is written as a `tokenizers` byte-level BPE with no
merges whose 256 tokens are the GPT-2 byte-to-unicode characters with id = byte value, so both
encode every string to the same ids as the project.

What it is not: the plain safetensors export (proxy/commands/export.py, project names and
layout), or a loader. It needs numpy and safetensors only (no torch, no transformers, no
tokenizers); the round trip through `transformers` is tests/test_hf_export.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from shared.atomic_io import current_umask, fsync_dir
from shared.run.config import SAMPLE_TEMPERATURE, SAMPLE_TOP_K, RunConfig, parameter_table

# nn.Linear (out, in) in the project; Conv1D (in, out) in HF GPT-2: transposed on export.
CONV1D_SUFFIXES = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, used by worker/model.py
GENERATION = {
    "do_sample": True,
    "temperature": SAMPLE_TEMPERATURE,
    "top_k": SAMPLE_TOP_K,
    "max_new_tokens": 100,
}
NO_SPECIAL_TOKENS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


class HFExportError(RuntimeError):
    """The export cannot be written; the message names the path and the fix."""


def named_tensors(cfg: RunConfig, weights: np.ndarray) -> dict[str, np.ndarray]:
    """The project's parameters as views of the flat float32 `weights`, named and shaped by
    `shared.run.config.parameter_table` (the model's `state_dict` names)."""
    return {
        name: weights[off : off + int(np.prod(shp))].reshape(shp)
        for name, shp, off in parameter_table(cfg.model, cfg.vocab_size)
    }


def hf_tensors(cfg: RunConfig, weights: np.ndarray) -> dict[str, np.ndarray]:
    """GPT2LMHeadModel's state dict from the checkpoint's flat weights.

    weights: float32 (n_params,) in `shared.run.config.parameter_table` order. Returns name ->
    float32 C-contiguous array; the four Conv1D weights are (in, out), the rest keep the
    project's shapes (`lm_head.weight` (vocab, n_embd) is its own tensor, never tied to
    `transformer.wte.weight`). Raises ValueError when `weights` has the wrong length.
    """
    if weights.shape != (cfg.n_params,):
        raise ValueError(
            f"weights have shape {weights.shape}, expected ({cfg.n_params},) for "
            f"{cfg.preset} with vocabulary {cfg.vocab_size}"
        )
    return {
        name: np.ascontiguousarray(a.T if name.endswith(CONV1D_SUFFIXES) else a, dtype=np.float32)
        for name, a in named_tensors(cfg, weights).items()
    }


def generation_config(cfg: RunConfig) -> dict:
    """generation_config.json: GENERATION, with max_new_tokens at most half the context, so a
    prompt plus the generated tokens fit in n_positions (transformers refuses longer inputs)
    even for the small presets; no special tokens (the run's tokenizers have none)."""
    new = min(GENERATION["max_new_tokens"], max(1, cfg.model.block_size // 2))
    return {**GENERATION, "max_new_tokens": new, **NO_SPECIAL_TOKENS}


def hf_config(cfg: RunConfig, step: int) -> dict:
    """config.json for GPT2LMHeadModel: the shape of `cfg.model`, untied head, exact GELU.

    The run's tokenizers have no special tokens, so bos/eos are null (generation runs to
    max_new_tokens). Dropouts are the run's (0 at inference anyway)."""
    s = cfg.model
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": s.block_size,
        "n_ctx": s.block_size,
        "n_embd": s.n_embd,
        "n_layer": s.n_layer,
        "n_head": s.n_head,
        "n_inner": 4 * s.n_embd,
        "activation_function": "gelu",
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "use_cache": True,
        "tie_word_embeddings": False,
        **NO_SPECIAL_TOKENS,
        "torch_dtype": "float32",
        "andrea": {
            "preset": cfg.preset,
            "step": step,
            "n_params": cfg.n_params,
            "tokenizer": cfg.tokenizer,
        },
    }


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the `tokenizers` ByteLevel alphabet):
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards."""
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    moved = iter(range(256, 512))  # the other bytes, in order
    return {b: chr(b) if b in keep else chr(next(moved)) for b in range(256)}


def bytes_tokenizer_json() -> dict:
    """A `tokenizers` tokenizer.json equal to the project's bytes tokenizer: encode(text) is
    text's UTF-8 bytes as ids 0..255, decode the inverse (shared/data/tokenizer.py)."""
    level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": level,
        "post_processor": None,
        "decoder": level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {c: b for b, c in bytes_to_unicode().items()},
            "merges": [],
        },
    }


def tokenizer_config(cfg: RunConfig) -> dict:
    """tokenizer_config.json: a PreTrainedTokenizerFast over tokenizer.json, no special tokens,
    no space clean-up on decode (so decode equals the project's)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.model.block_size,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {},
    }


def write_hf_dir(
    out: Path,
    cfg: RunConfig,
    run_tokenizer: Path,
    step: int,
    weights: np.ndarray,
    source: str,
    force: bool = False,
) -> list[str]:
    """Write the HF model directory `out` atomically; returns the file names written.

    Everything is written to a temporary folder beside `out`, fsynced, then renamed to `out`
    (an existing `out` is replaced only with `force`; an empty one always), so a kill leaves
    either the old folder or the complete new one. run_tokenizer: the run's tokenizer.json
    (BPE: copied; bytes: replaced by `bytes_tokenizer_json`). Raises HFExportError when `out`
    is a non-empty folder without `force`, or a file.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise HFExportError(f"{out} is a file; --format hf writes a folder: give a new path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HFExportError(f"{out} exists and is not empty; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0o700 would keep it private
        meta = {
            "format": "pt",
            "step": str(step),
            "n_params": str(cfg.n_params),
            "preset": cfg.preset,
            "source": source,
        }
        files = {
            "model.safetensors": save(hf_tensors(cfg, weights), metadata=meta),
            "config.json": json.dumps(hf_config(cfg, step), indent=2).encode(),
            "generation_config.json": json.dumps(generation_config(cfg), indent=2).encode(),
            "tokenizer.json": json.dumps(bytes_tokenizer_json()).encode()
            if cfg.tokenizer == "bytes"
            else Path(run_tokenizer).read_bytes(),
            "tokenizer_config.json": json.dumps(tokenizer_config(cfg), indent=2).encode(),
        }
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        fsync_dir(tmp)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
        os.rename(tmp, out)
        fsync_dir(out.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(files)
