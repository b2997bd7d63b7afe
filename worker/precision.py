"""Arithmetic of the training step: bf16 autocast or plain fp32, and which AdamW kernel.

`--precision` (worker option, passed through by `python -m proxy run --precision`):

  auto  bf16 autocast on CUDA when the GPU has native bf16 (Ampere and newer), else fp32;
        fp32 on CPU
  bf16  torch.autocast(device_type=<the device's type>, dtype=torch.bfloat16), on CPU too
  fp32  no autocast anywhere (and, on CUDA, no TF32: fp32 matmuls are true fp32; with bf16 the
        trainer enables TF32 for the fp32 matmuls left outside autocast)

Whatever the precision, the weights (`GPT.flat`), AdamW's m and v and the checkpoint file stay
float32: autocast only changes the dtype the forward's matmuls (and their backward) compute in;
the parameters it casts are temporary bf16 copies, the gradients land in the fp32 `.grad`.

`autocast(device, precision)` is the one place the training code opens an autocast region: the
training forward, the held-out probes (which feed the bandit) and nothing else (sample audits
generate in fp32). `resolve_precision` is the one place `auto` is decided.

The AdamW kernel (`use_fused_adamw`): torch's fused one on CUDA and CPU (one pass over all
parameters; on CPU 0.010 s per andrea-12m update, foreach 0.049 s), foreach on other devices.

What it is not: the model (worker/model.py) or the optimizer's flat buffers (worker/optim.py).
"""

from __future__ import annotations

import psutil
import torch

from shared.run.worker_options import PRECISIONS
from worker import fault_injection


def resolve_precision(requested: str, device: torch.device) -> str:
    """The precision a worker on `device` trains in for `--precision requested`: "bf16" or
    "fp32". Raises ValueError for an unknown value, or for bf16 on a CUDA device without native
    bf16 (V100, T4: autocast would silently fall back or run emulated kernels)."""
    if requested not in PRECISIONS:
        raise ValueError(f"--precision {requested!r}: choose one of {', '.join(PRECISIONS)}")
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if requested == "auto":
        return "bf16" if cuda_bf16 else "fp32"
    if requested == "bf16" and device.type == "cuda" and not cuda_bf16:
        raise ValueError(
            f"--precision bf16: {torch.cuda.get_device_name(device)} has no native "
            "bf16; use --precision fp32 (or auto)"
        )
    return requested


def autocast(device: torch.device, precision: str):
    """The autocast context for a forward pass in resolved `precision` ("bf16" or "fp32") on
    `device`: bf16 autocast of the device's type, or a disabled (no-op) autocast for fp32."""
    return torch.autocast(
        device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16"
    )


def use_fused_adamw(device: torch.device) -> bool:
    """Fused AdamW on CUDA and CPU, foreach elsewhere; a test may pin either
    (worker/fault_injection.py `fused_adamw_override`)."""
    pinned = fault_injection.fused_adamw_override()
    return pinned if pinned is not None else device.type in ("cuda", "cpu")


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of `device` in bytes: the GPU's on CUDA, the host's (psutil) on a CPU;
    None when it cannot be told."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        if device.type == "cpu":
            return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - unknown is not an error; nothing is checked then
        return None
    return None
