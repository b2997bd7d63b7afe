"""The data pipeline: draw each update's batch from the arms, deterministically (docs/architecture.md#the-worker).

For update k, a generator seeded by (run seed, k) draws the GLOBAL batch: which arm each of the B
sequences comes from (from the policy p in force for k) and where in the arm's train split its
window starts. Rank r takes rows [r*B/W, (r+1)*B/W). So the batch is a pure function of (seed, k,
p), the same for any world size, and a resumed run draws exactly what the uninterrupted run drew.

Held-out probe windows are fixed per arm (evenly spaced over the held-out ranges, never trained
on); training windows start anywhere a whole window fits inside one train segment, a gap between
held-out ranges (docs/data.md#the-held-out-split). Token files: uint16 or uint32 (ArmData.dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.data.arms import ArmSourceError
from shared.data.token_files import TOKEN_FILE_REMEDY, ArmData
from shared.run.config import AUDIT_PROMPT_TOKENS


def step_generator(seed: int, step: int, stream: int = 0) -> np.random.Generator:
    """numpy Generator for update `step`; `stream` separates independent uses (0 = batch)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, stream])))


DROPOUT_STREAM = 1  # beside step_generator's stream 0 (the batch): torch's dropout masks


def dropout_seed(seed: int, step: int, rank: int, micro_batch: int) -> int:
    """The seed (an int in [0, 2**64)) for torch's global RNG before micro-batch `micro_batch`
    of update `step` on rank `rank`: dropout draws its masks there, so they follow from the run
    seed and the step alone and a resumed run draws the masks an uninterrupted one drew
    (docs/architecture.md, Determinism; for the same world size and micro-batch size)."""
    state = np.random.SeedSequence([seed, step, DROPOUT_STREAM, rank, micro_batch])
    return int(state.generate_state(1, np.uint64)[0])


@dataclass
class Batch:
    tokens: torch.Tensor  # int64 (b, T + 1) windows of this rank: inputs x, then targets y
    arm_index: np.ndarray  # int (b,) index into the sorted arm names, this rank's rows
    counts: dict[str, int]  # sequences per arm in the GLOBAL batch
    unigram_loss: np.ndarray  # float64 (b,): each row's mean unigram loss of its targets, nats

    @property
    def x(self) -> torch.Tensor:
        """int64 (b, T): the inputs, a view of `tokens`."""
        return self.tokens[:, :-1]

    @property
    def y(self) -> torch.Tensor:
        """int64 (b, T): the next-token targets, a view of `tokens`."""
        return self.tokens[:, 1:]


class ArmSampler:
    """Token windows from each arm. `arms` maps name -> ArmData; names are used in sorted order."""

    def __init__(
        self,
        run_dir: Path,
        arms: dict[str, ArmData],
        block_size: int,
        vocab_size: int | None = None,
    ) -> None:
        self.names = sorted(arms)
        self.block = block_size
        self.vocab_size = vocab_size  # token ids must be below it (checked per drawn window)
        self.paths = {n: arms[n].token_path(run_dir) for n in self.names}
        self.tokens = {n: arms[n].tokens(run_dir) for n in self.names}
        self.train_end = {n: arms[n].heldout_start for n in self.names}
        self.heldout = {n: arms[n].heldout_ranges() for n in self.names}
        self.n_tokens = {n: arms[n].n_tokens for n in self.names}
        self._train = {
            n: _starts(_gaps(self.heldout[n], arms[n].n_tokens), block_size) for n in self.names
        }
        self._unigram: dict[str, np.ndarray] = {}  # made on an arm's first draw

    def draw(
        self,
        seed: int,
        step: int,
        probs: dict[str, float],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> Batch:
        """The batch of update `step` for `rank`. probs: arm name -> probability (sum 1)."""
        g = step_generator(seed, step)
        p = np.array([max(0.0, float(probs.get(n, 0.0))) for n in self.names], dtype=np.float64)
        p = p / p.sum()
        arm_idx = g.choice(len(self.names), size=batch_size, p=p)
        starts = np.empty(batch_size, dtype=np.int64)
        for i, a in enumerate(arm_idx):  # one draw per row, in row order: independent of ranks
            seg, cum = self._train[self.names[a]]
            starts[i] = _nth_start(seg, cum, int(g.integers(0, int(cum[-1]))))
        counts = {n: int((arm_idx == i).sum()) for i, n in enumerate(self.names)}
        per = batch_size // world_size
        mine = slice(rank * per, (rank + 1) * per)
        names = [self.names[a] for a in arm_idx[mine]]
        buf = self._window_array(names, starts[mine].tolist())
        unigram = self.unigram_losses(buf, arm_idx[mine])
        return Batch(torch.from_numpy(buf), arm_idx[mine], counts, unigram)

    def unigram_losses(self, windows: np.ndarray, arm_index: np.ndarray) -> np.ndarray:
        """float64 (rows,): row i's mean loss, in nats, of its targets `windows[i, 1:]` (int64
        (rows, T + 1)) under arm `arm_index[i]`'s unigram model (`unigram_table`). A fixed
        function of the row, so an arm's mean of it does not change over a run: the default
        policy subtracts it from each row's training loss as a control variate
        (docs/bandit.md#the-control-variate)."""
        y = windows[:, 1:]
        out = np.empty(len(y), dtype=np.float64)
        for i in np.unique(arm_index):
            n = self.names[int(i)]
            if n not in self._unigram:
                segments = _gaps(self.heldout[n], self.n_tokens[n])
                self._unigram[n] = unigram_table(self.tokens[n], segments, self.vocab_size)
            rows = arm_index == i
            out[rows] = self._unigram[n][y[rows]].mean(axis=1)
        return out

    def _window_array(self, names: list[str], starts: list[int]) -> np.ndarray:
        """int64 (rows, block+1): row i the window of arm `names[i]` at token `starts[i]`, its
        ids checked (`_check_ids`)."""
        buf = np.stack(
            [
                np.asarray(self.tokens[n][s : s + self.block + 1], dtype=np.int64)
                for n, s in zip(names, starts)
            ]
        )
        self._check_ids(buf, names, starts)
        return buf

    def _check_ids(self, buf: np.ndarray, names: list[str], starts: list[int]) -> None:
        """Raise ArmSourceError naming the arm, its file and the offset when a window of `buf`
        (int64 (rows, block+1)) holds a token id >= vocab_size: the file was overwritten after
        creation (its size still matches). Costs one max over the batch; the embedding would
        otherwise fail with an IndexError that names nothing."""
        if self.vocab_size is None or not buf.size or int(buf.max()) < self.vocab_size:
            return
        row = int(np.argmax(buf.max(axis=1) >= self.vocab_size))
        col = int(np.argmax(buf[row] >= self.vocab_size))
        n = names[row]
        raise ArmSourceError(
            f"arm {n!r}: token file {self.paths[n]} holds token id {int(buf[row, col]):,} at "
            f"token offset {starts[row] + col:,}, outside the run's vocabulary of "
            f"{self.vocab_size:,}: the file was changed after the run was created; "
            f"{TOKEN_FILE_REMEDY}"
        )

    def heldout_starts(self, name: str, n: int) -> list[int]:
        """Token offsets of the `n` probe windows of arm `name`: evenly spaced over the window
        starts of its held-out ranges (each window, block+1 tokens, lies inside one range)."""
        seg, cum = _starts(self.heldout[name], self.block)
        span = int(cum[-1]) // max(1, n)
        return [_nth_start(seg, cum, i * span) for i in range(n)]

    def heldout_windows(self, name: str, n: int) -> torch.Tensor:
        """The fixed probe set of arm `name`: int64 (n, block+1) at `heldout_starts(name, n)`."""
        return torch.from_numpy(self._window_array([name] * n, self.heldout_starts(name, n)))

    def prompt(self, name: str, n_tokens: int = AUDIT_PROMPT_TOKENS) -> np.ndarray:
        """Fixed audit prompt of arm `name`: the first tokens of its held-out split."""
        s = self.train_end[name]
        out = np.asarray(self.tokens[name][s : s + n_tokens], dtype=np.int64)
        self._check_ids(out.reshape(1, -1), [name], [s])
        return out


UNIGRAM_SAMPLE_TOKENS = 1 << 22  # tokens counted for an arm's unigram model, at most
UNIGRAM_CHUNK_TOKENS = 1 << 16  # in chunks of this many, evenly spaced over its train split


def unigram_table(
    tokens: np.ndarray, segments: list[tuple[int, int]], vocab_size: int | None
) -> np.ndarray:
    """float64 (V,): the loss, in nats, of each token id under the add-one smoothed unigram
    model, -ln((c_t + 1) / (N + V)), with counts c_t over the train `segments` [a, b) of
    `tokens` (1-D integer array or memmap). A split longer than UNIGRAM_SAMPLE_TOKENS is
    counted on chunks of UNIGRAM_CHUNK_TOKENS evenly spaced over it, so it reads at most 4 Mi
    tokens whatever the arm's size; the same tokens give the same table. V is `vocab_size`,
    or 1 + the largest id counted when None. Raises ValueError when `vocab_size` is None and
    the split is sampled: an id the chunks miss would fall outside the table."""
    total = sum(b - a for a, b in segments)
    if total > UNIGRAM_SAMPLE_TOKENS and vocab_size is None:
        raise ValueError(
            f"unigram_table: a train split of {total:,} tokens is counted on a sample "
            f"(over {UNIGRAM_SAMPLE_TOKENS:,}), so the vocabulary cannot be read from it: "
            "pass vocab_size (the run's, RunConfig.vocab_size)"
        )
    if total <= UNIGRAM_SAMPLE_TOKENS:
        pieces = [(a, b) for a, b in segments]
    else:  # chunk starts in the train split's own coordinate, mapped back to token offsets
        w = UNIGRAM_CHUNK_TOKENS
        seg_start = np.cumsum([0] + [b - a for a, b in segments])
        pieces = []
        for u in np.linspace(0, total - w, UNIGRAM_SAMPLE_TOKENS // w).round().astype(np.int64):
            j = int(np.searchsorted(seg_start, u, side="right")) - 1
            a, b = segments[j]
            lo = a + int(u - seg_start[j])
            pieces.append((lo, min(b, lo + w)))
    c = np.zeros(vocab_size or 0, dtype=np.float64)
    for a, b in pieces:
        counts = np.bincount(np.asarray(tokens[a:b], dtype=np.int64))
        if len(counts) > len(c) and vocab_size is None:
            c = np.concatenate([c, np.zeros(len(counts) - len(c))])
        n = min(len(c), len(counts))  # ids >= vocab_size: `_check_ids` refuses their windows
        c[:n] += counts[:n]
    return -np.log((c + 1.0) / (c.sum() + len(c)))


def _gaps(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The train segments of an arm of `n` tokens: [0, n) minus the held-out `ranges`."""
    out, at = [], 0
    for a, b in ranges:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < n:
        out.append((at, n))
    return out


def _starts(segments: list[tuple[int, int]], block: int):
    """(segments, cumulative counts) of window starts: a segment [a, b) offers b - a - block - 1
    starts (a window and its next-token target fit inside it). Raises ValueError if none."""
    seg = [(a, b) for a, b in segments if b - a - block - 1 > 0]
    cum = np.cumsum([b - a - block - 1 for a, b in seg], dtype=np.int64)
    if not len(cum):
        raise ValueError(f"no window of {block + 1} tokens fits in segments {segments}")
    return seg, cum


def _nth_start(seg: list[tuple[int, int]], cum: np.ndarray, u: int) -> int:
    """The token offset of window start number `u` (0-based) of `_starts`'s (seg, cum)."""
    j = int(np.searchsorted(cum, u, side="right"))
    return int(seg[j][0]) + u - (int(cum[j - 1]) if j else 0)
