"""How much memory one micro-batch needs at least, so that a batch that cannot fit is refused
with a fix instead of hanging or being killed by the kernel (docs/configuration.md#batch-and-accumulation).

The estimate is a floor, on purpose: it may only refuse what surely cannot fit. Per transformer
layer it counts the activations kept for the backward, 34 x d bytes per token at 16 bits
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2,
without the attention-score term 5 x heads x T, which fused attention does not store), doubled
for fp32; plus the output head's fp32 logits and their gradient (2 x V x 4 bytes per token).
Weights, optimizer state and allocator slack come on top and are not counted.

What it is not: a profiler. No torch here; the worker supplies the device's memory.
"""

from __future__ import annotations

from shared.run.config import ConfigError, ModelShape

GIB = 1024**3


def activation_bytes(
    shape: ModelShape, vocab_size: int, micro_batch: int, precision: str, compiled: bool = False
) -> int:
    """Lower bound, in bytes, of the activations of one forward/backward of `micro_batch`
    sequences of `shape.block_size` tokens; `precision` "bf16" (16-bit activations) or "fp32".
    `compiled` (torch.compile): 24 instead of 34 x d per token and layer, since inductor
    recomputes element-wise outputs (GELU, LayerNorm) in the backward instead of keeping them."""
    tokens = micro_batch * shape.block_size
    width = 1 if precision == "bf16" else 2
    per_layer = (24 if compiled else 34) * shape.n_embd * width
    return tokens * (shape.n_layer * per_layer + 2 * vocab_size * 4)


def check_micro_batch_fits(
    shape: ModelShape,
    vocab_size: int,
    micro_batch: int,
    rank_slice: int,
    precision: str,
    device_bytes: int | None,
    device: str,
    compiled: bool = False,
) -> None:
    """Raise ConfigError when even the lower bound of `activation_bytes` for `micro_batch`
    exceeds `device_bytes` (the device's total memory; None: unknown, nothing checked). The
    message names the sizes and the largest micro-batch dividing `rank_slice` (the rank's
    sequences per update) whose bound stays under half the device, which trains the same batch
    by gradient accumulation."""
    if not device_bytes:
        return
    need = activation_bytes(shape, vocab_size, micro_batch, precision, compiled)
    if need <= device_bytes:
        return
    per_sequence = activation_bytes(shape, vocab_size, 1, precision, compiled)  # linear in it
    top = min(rank_slice, (device_bytes // 2) // per_sequence)
    best = next((m for m in range(top, 0, -1) if rank_slice % m == 0), None)
    fix = (
        f"pass --micro-batch-size {best} (the same batch of {rank_slice:,} sequences per "
        "rank, by gradient accumulation)"
        if best
        else "not even one sequence fits: use a smaller preset or context"
    )
    raise ConfigError(
        f"a micro-batch of {micro_batch:,} sequences x {shape.block_size} tokens needs at least "
        f"{need / GIB:,.1f} GiB of activations ({precision}), more than the {device_bytes / GIB:,.1f} "
        f"GiB of {device}; {fix}"
    )
