"""The train-loss EMA shown by the progress line, `status`, the summary, `plot` and TensorBoard:
one implementation, bias-corrected as Adam's moments are (Kingma & Ba 2015, "Adam", Algorithm 1;
docs/history.md#the-loss-ema).

    m_t = BETA * m_{t-1} + (1 - BETA) * x_t,  m_0 = 0;   ema_t = m_t / (1 - BETA ** t)

so ema_1 = x_1 and every value is a weighted mean of the losses seen (weights summing to one),
never pulled towards zero or towards one old value early in a run. Non-finite losses (a NaN step)
are skipped: t counts the finite ones. BETA = 0.95: about the last 20 steps weigh most.

What it is not: the raw mean of the last steps (`recent_mean`, printed beside it by the summary).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

BETA = 0.95


class LossEma:
    """A running bias-corrected EMA of losses. `update(x)` returns the EMA after `x` (None while
    no finite loss was seen); `value` is the same without a new loss."""

    def __init__(self, beta: float = BETA) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"beta {beta}: must be in [0, 1)")
        self.beta, self.m, self.t = beta, 0.0, 0

    def update(self, x) -> float | None:
        """Take loss `x` (ignored unless a finite number); returns the EMA."""
        if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
            self.m = self.beta * self.m + (1 - self.beta) * float(x)
            self.t += 1
        return self.value

    @property
    def value(self) -> float | None:
        return self.m / (1 - self.beta**self.t) if self.t else None

    @classmethod
    def over(cls, records: Iterable[dict], beta: float = BETA) -> LossEma:
        """The EMA of the "loss" of `records` (dicts, in step order)."""
        e = cls(beta)
        for r in records:
            e.update(r.get("loss"))
        return e


def loss_ema(records: Iterable[dict]) -> float | None:
    """The bias-corrected EMA of the finite "loss" values of `records`; None if none."""
    return LossEma.over(records).value


def recent_mean(records: list[dict], n: int) -> tuple[float | None, int]:
    """(the plain mean of the finite losses of the last `n` records, how many there were):
    what the losses really were, beside the EMA. (None, 0) when there is none."""
    xs = [
        r["loss"]
        for r in records[-n:]
        if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])
    ]
    return (sum(xs) / len(xs), len(xs)) if xs else (None, 0)
