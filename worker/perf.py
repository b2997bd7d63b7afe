"""Throughput accounting: tokens/s and model FLOPs utilisation (MFU).

MFU = achieved training FLOP/s (the model's FLOPs per token x tokens/s, all ranks together) /
(peak FLOP/s of one device x world size). The peak comes from a per-device table on CUDA (dense
bf16 tensor-core figures from the vendors' data sheets) and, on CPU, from a short fp32 matmul
timed once per machine (`measure_cpu_matmul_peak`: no data sheet figure there can be trusted),
kept off a (re)start's critical path by `PeakFlops`.

What it is not: the timing of steps (worker/trainer.py) or the progress line (proxy/observation/progress.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

from shared.atomic_io import atomic_write_bytes, read_json

# Dense (no sparsity) bf16 peak FLOP/s per device, by a substring of torch.cuda.get_device_name().
# Order matters: the first match wins (e.g. "H100 PCIe" before "H100").
CUDA_BF16_PEAK: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM / NVL
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A10G", 70e12),  # nominally 125 TFLOP/s with sparsity; 70 dense
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16 tensor cores (V100 has no bf16)
    ("T4", 65e12),  # fp16
)


def cuda_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s, source) of a CUDA device from `CUDA_BF16_PEAK`; (None, why) if unknown."""
    name = torch.cuda.get_device_name(device)
    for key, peak in CUDA_BF16_PEAK:
        if key in name:
            return peak, f"table: {name} bf16 dense {peak / 1e12:.0f} TFLOP/s"
    return None, f"{name} is not in worker/perf.py CUDA_BF16_PEAK; MFU not reported"


def measure_cpu_matmul_peak(
    n: int = 1024, seconds: float = 0.5, warmup_s: float = 0.2, per_round: int = 3
) -> float:
    """FLOP/s of an (n x n) @ (n x n) fp32 matmul on this process's CPU threads: the CPU's
    peak for MFU. After `warmup_s` of untimed matmuls (BLAS thread pool, caches, clock
    ramp-up), rounds of `per_round` matmuls are timed for about `seconds`; the peak is the
    best round's rate, the median of its matmuls being what a round measures (a single
    matmul's timer jitter cannot inflate it, a busy moment only lowers that round). A peak
    still measured too low (the whole window contended) gives an MFU above 1 (see `mfu`)."""
    g = torch.Generator().manual_seed(0)  # leave the global RNG untouched
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    end = time.perf_counter() + warmup_s
    torch.mm(a, b, out=c)
    while time.perf_counter() < end:
        torch.mm(a, b, out=c)
    best = 0.0
    end = time.perf_counter() + seconds
    while True:
        times = []
        for _ in range(per_round):
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            times.append(time.perf_counter() - t0)
        med = sorted(times)[len(times) // 2]
        if med > 0:
            best = max(best, 2.0 * n**3 / med)
        if time.perf_counter() > end:
            return best


def device_peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s of ONE device, how it was obtained) for MFU."""
    if device.type == "cuda":
        return cuda_peak_flops(device)
    peak = measure_cpu_matmul_peak()
    return peak, _matmul_source("measured", peak)


def _matmul_source(how: str, peak: float) -> str:
    return f"{how}: fp32 1024^3 matmul {peak / 1e9:.1f} GFLOP/s"


def _cpu_cache_key() -> str:
    try:
        found = re.search(r"^model name[^:\n]*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        found = None
    model = found.group(1).strip() if found else "unknown-cpu"
    return f"{model}|threads={torch.get_num_threads()}|torch={torch.__version__}"


class PeakFlops:
    """Peak FLOP/s of ONE device for MFU, obtained without delaying the first step.

    `value` (float or None while unknown) and `source` (how it was obtained). CUDA: the table,
    at once. CPU: the per-machine cache file `cache` if it holds this CPU's figure, else None
    until `measure_later()` has timed the matmul (and cached it)."""

    def __init__(self, device: torch.device, cache: Path) -> None:
        self.device, self.value, self.source = device, None, "not measured yet"
        self._cache = cache
        self._key = None
        if device.type == "cuda":
            self.value, self.source = cuda_peak_flops(device)
            return
        self._key = _cpu_cache_key()
        hit = read_json(cache, {}, garbage="default", expect=dict).get(self._key)
        if isinstance(hit, (int, float)) and hit > 0:
            self.value = float(hit)
            self.source = _matmul_source("measured earlier on this machine (cached)", hit)

    def measure_later(self) -> None:
        """CPU without a cached figure: time the matmul now, then cache it. Called between two
        updates (after the first), in the training thread, so training is not competing for the
        cores while the peak is timed (a peak timed under load is too low and would put MFU
        above 100 %); it costs about 0.7 s once per machine, thread count and torch version."""
        if self.value is not None or self.device.type == "cuda" or self._key is None:
            return
        self._key, key = None, self._key  # once
        peak = measure_cpu_matmul_peak()
        self.value, self.source = peak, _matmul_source("measured", peak)
        try:  # best effort: an unwritable cache only costs the measurement next time
            self._cache.parent.mkdir(parents=True, exist_ok=True)
            d = read_json(self._cache, {}, garbage="default", expect=dict)
            d[key] = peak
            atomic_write_bytes(self._cache, json.dumps(d).encode(), durable=False)
        except OSError:
            pass


def mfu(
    flops_per_token: float, tokens_per_s: float, peak_per_device: float | None, world_size: int = 1
) -> float | None:
    """Model FLOPs utilisation (a fraction, 1 = the peak) or None when the peak is unknown.
    Not clamped here: a value above 1 says the peak is wrong, and the proxy leaves it out."""
    if not peak_per_device or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak_per_device * world_size)
