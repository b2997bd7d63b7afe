"""The train-loss EMA shown by the progress line, `status`, the summary, `plot` and TensorBoard:
one implementation, bias-corrected as Adam's moments are (Kingma & Ba 2015, "Adam", Algorithm 1;
docs/history.md#the-loss-ema).

    m_t = BETA * m_{t-1} + (1 - BETA) * x_t,  m_0 = 0;   ema_t = m_t / (1 - BETA ** t)

Non-finite losses (a NaN step) are skipped: t counts the finite ones.

What it is not: the raw mean of the last steps (`recent_mean`, printed beside it by the summary).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeGuard

BETA = 0.95  # about the last 20 steps weigh most


def finite_number(x) -> TypeGuard[int | float]:
    """True for a finite int or float; False for bools, None, NaN, infinities and the rest."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class LossEma:
    """A running bias-corrected EMA of losses. `update(x)` returns the EMA after `x` (None while
    no finite loss was seen); `value` is the same without a new loss."""

    def __init__(self) -> None:
        self.m, self.t = 0.0, 0

    def update(self, x) -> float | None:
        """Take loss `x` (ignored unless a finite number); returns the EMA."""
        if finite_number(x):
            self.m = BETA * self.m + (1 - BETA) * float(x)
            self.t += 1
        return self.value

    @property
    def value(self) -> float | None:
        return self.m / (1 - BETA**self.t) if self.t else None

    @classmethod
    def over(cls, records: Iterable[dict]) -> LossEma:
        """The EMA of the "loss" of `records` (dicts, in step order)."""
        e = cls()
        for r in records:
            e.update(r.get("loss"))
        return e


def loss_ema(records: Iterable[dict]) -> float | None:
    """The bias-corrected EMA of the finite "loss" values of `records`; None if none."""
    return LossEma.over(records).value


def recent_mean(records: list[dict], n: int) -> tuple[float | None, int]:
    """(the plain mean of the finite losses of the last `n` records, how many there were):
    what the losses really were, beside the EMA. (None, 0) when there is none."""
    xs = [r["loss"] for r in records[-n:] if finite_number(r.get("loss"))]
    return (sum(xs) / len(xs), len(xs)) if xs else (None, 0)
