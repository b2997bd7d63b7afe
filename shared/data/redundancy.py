"""How repetitive an arm's token stream is: its zstd compression ratio (docs/bandit.md#the-repetition-guard).

What it is: `compression_ratio(tokens)`, measured once per arm when the run is made (and on
demand for runs made before it), which the bandit's repetition guard compares with
`BanditConfig.repetitive_ratio` (typical values: docs/data.md#compression-ratio).
What it is not: a quality filter (nothing is dropped) or the guard itself (proxy/mixture/bandit.py).
"""

from __future__ import annotations

import numpy as np
import zstandard

SAMPLE_CHUNKS = 16  # chunks evenly spaced over the arm
CHUNK_TOKENS = 65536  # tokens per chunk (each compressed on its own)
ZSTD_LEVEL = 3
REPETITIVE_RATIO = 20.0  # the guard's default threshold (BanditConfig.repetitive_ratio)


def compression_ratio(tokens: np.ndarray) -> float:
    """Mean zstd (level 3) compression ratio of up to SAMPLE_CHUNKS chunks of CHUNK_TOKENS
    tokens evenly spaced over `tokens` (1-D integer array or memmap, any length >= 1; an arm
    shorter than one chunk is one chunk). Each chunk is serialised in the narrowest dtype that
    holds the sample's largest id and compressed alone. Unitless, >= about 1 (incompressible);
    reads at most 1 Mi tokens, a few milliseconds. Deterministic: the same tokens give the same
    number (rounded to 4 decimals, as arms.json keeps it). Raises ValueError for an empty array."""
    n = len(tokens)
    if n == 0:
        raise ValueError("compression_ratio: no tokens")
    w = min(CHUNK_TOKENS, n)
    k = SAMPLE_CHUNKS if n >= 2 * w else 1
    starts = np.linspace(0, n - w, k).round().astype(np.int64)
    chunks = [np.asarray(tokens[s : s + w]) for s in starts]
    # the narrowest unsigned dtype of the sample's largest id: the bytes tokenizer's ids are
    # compressed as bytes, a BPE's as uint16, so the ratio does not count zero bytes
    dt = np.min_scalar_type(max(int(c.max()) for c in chunks))
    z = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    raws = (c.astype(dt).tobytes() for c in chunks)
    return round(float(np.mean([len(r) / len(z.compress(r)) for r in raws])), 4)
