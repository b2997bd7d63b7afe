"""Fast text generation for `python -m proxy sample`: weights only, batched, no KV cache.

What it is: `load_weights_only` (the checkpoint's weights region, never m and v, into a GPT
whose parameters are views of one buffer; no optimizer is built) and `generate_batched` (every
sample of a prompt in one batch; each new token runs the trunk over the context window and the
output head over the LAST position only, which on a small model is most of the work saved:
the head is the widest matmul, (T, n_embd) x (n_embd, vocab)).

The training loop's sample audit (worker/trainer.py) generates with it too, its arms as one batch.
What it is not: a KV cache: the whole window is recomputed per token, which keeps the code the
model's own forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn import functional as F

from shared.checkpoint.read import load_weights
from shared.run.config import SAMPLE_TEMPERATURE, SAMPLE_TOP_K
from worker.model import GPT


def load_weights_only(
    path: Path, cfg, checksum: str | None = None
) -> tuple[int, "torch.nn.Module"]:
    """(step, GPT in eval mode) from checkpoint `path` of the run described by `cfg`.

    The file is opened once, checked (name, header, size, n_params, and with `checksum`, the
    manifest's "crc32:%08x" for it, over the whole file: docs/checkpoint-format.md#validity;
    not rule 8: a diverged model's samples are the operator's to see) and its weights region
    (4 x n_params bytes after the 8-byte header) read straight into the model's flat weights
    (``shared.checkpoint.read.load_weights``): the checksum covers the bytes used, even when the
    run retires or replaces the file meanwhile. Raises CheckpointError."""
    model = GPT(cfg.model, cfg.vocab_size, init_weights=False)  # filled at once below
    flat = model.flat.detach()
    if flat.device.type == "cpu" and flat.dtype == torch.float32 and sys.byteorder == "little":
        step, _ = load_weights(path, cfg.n_params, checksum, out=flat.numpy(), values=False)
    else:
        step, w = load_weights(path, cfg.n_params, checksum, values=False)
        with torch.no_grad():
            model.flat.copy_(torch.from_numpy(w))
    return step, model.eval()


@torch.inference_mode()
def generate_batched(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = SAMPLE_TEMPERATURE,
    top_k: int | None = SAMPLE_TOP_K,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> torch.Tensor:
    """Sample continuations of every row of `idx` at once.

    idx: int64 (B, T0) token ids (one row per sample). Returns int64 (B, T0 + max_new_tokens).
    temperature > 0 divides the logits; top_k keeps the k most likely tokens (None or 0: all).
    The context is the last `block_size` tokens; sampling uses `generator` (CPU) so a seed
    gives the same text on any device: one generator for the batch, or a list of B, one per
    row (the sample audit: each arm's text depends only on its prompt and its own seed).
    Raises ValueError when the list's length is not B."""
    if isinstance(generator, list) and len(generator) != idx.size(0):
        raise ValueError(f"generate_batched: {len(generator)} generators for {idx.size(0)} rows")
    t = model.transformer
    block = model.shape.block_size
    B, T0 = idx.shape
    out = torch.empty(B, T0 + max_new_tokens, dtype=torch.long, device=idx.device)
    out[:, :T0] = idx
    for i in range(T0, T0 + max_new_tokens):
        ctx = out[:, max(0, i - block) : i]
        pos = torch.arange(ctx.size(1), device=idx.device)
        x = t.wte(ctx) + t.wpe(pos)
        for blk in t.h:
            x = blk(x)
        logits = model.lm_head(t.ln_f(x[:, -1, :])) / max(temperature, 1e-6)
        if top_k:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
        probs = F.softmax(logits, dim=-1).cpu()
        if isinstance(generator, list):
            nxt = torch.cat(
                [torch.multinomial(p, 1, generator=g) for p, g in zip(probs.split(1), generator)]
            )
        else:
            nxt = torch.multinomial(probs, 1, generator=generator)
        out[:, i] = nxt.view(-1).to(idx.device)
    return out
