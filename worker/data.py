"""The data pipeline: draw each update's batch from the arms, deterministically (docs/architecture.md#the-worker).

For update k, a generator seeded by (run seed, k) draws the GLOBAL batch: which arm each of the B
sequences comes from (from the policy p in force for k) and where in the arm's train split its
window starts. Rank r takes rows [r*B/W, (r+1)*B/W). So the batch is a pure function of (seed, k,
p), the same for any world size, and a resumed run draws exactly what the uninterrupted run drew.

Held-out probe windows are fixed per arm (evenly spaced in the held-out split, never trained on).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.arm_data import ArmData


def step_generator(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    """numpy Generator for update `step`; `stream` separates independent uses (0 = batch)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, stream])))


@dataclass
class Batch:
    x: torch.Tensor          # int64 (b, T) inputs of this rank
    y: torch.Tensor          # int64 (b, T) next-token targets
    arm_index: np.ndarray    # int (b,) index into the sorted arm names, this rank's rows
    counts: dict[str, int]   # sequences per arm in the GLOBAL batch


class ArmSampler:
    """Token windows from each arm. `arms` maps name -> ArmData; names are used in sorted order."""

    def __init__(self, run_dir: Path, arms: dict[str, ArmData], block_size: int) -> None:
        self.names = sorted(arms)
        self.block = block_size
        self.tokens = {n: arms[n].tokens(run_dir) for n in self.names}
        self.train_end = {n: arms[n].heldout_start for n in self.names}

    def draw(self, seed: int, step: int, probs: dict[str, float], batch_size: int,
             rank: int = 0, world_size: int = 1) -> Batch:
        """The batch of update `step` for `rank`. probs: arm name -> probability (sum 1)."""
        g = step_generator(seed, step)
        p = np.array([max(0.0, float(probs.get(n, 0.0))) for n in self.names], dtype=np.float64)
        p = p / p.sum()
        arm_idx = g.choice(len(self.names), size=batch_size, p=p)
        starts = np.empty(batch_size, dtype=np.int64)
        for i, a in enumerate(arm_idx):  # one draw per row, in row order: independent of ranks
            starts[i] = g.integers(0, self.train_end[self.names[a]] - self.block - 1)
        counts = {n: int((arm_idx == i).sum()) for i, n in enumerate(self.names)}
        per = batch_size // world_size
        rows = range(rank * per, (rank + 1) * per)
        buf = np.stack([np.asarray(self.tokens[self.names[arm_idx[i]]][starts[i]:starts[i] + self.block + 1],
                                   dtype=np.int64) for i in rows])
        t = torch.from_numpy(buf)
        return Batch(t[:, :-1], t[:, 1:], arm_idx[rank * per:(rank + 1) * per], counts)

    def heldout_windows(self, name: str, n: int) -> torch.Tensor:
        """The fixed probe set of arm `name`: int64 (n, block+1), evenly spaced, non-overlapping."""
        toks = self.tokens[name]
        start, end = self.train_end[name], len(toks)
        span = (end - start - self.block - 1) // max(1, n)
        return torch.from_numpy(np.stack([
            np.asarray(toks[start + i * span:start + i * span + self.block + 1], dtype=np.int64)
            for i in range(n)]))

    def prompt(self, name: str, n_tokens: int = 16) -> np.ndarray:
        """Fixed audit prompt of arm `name`: the first tokens of its held-out split."""
        s = self.train_end[name]
        return np.asarray(self.tokens[name][s:s + n_tokens], dtype=np.int64)
