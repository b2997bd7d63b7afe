"""Paired A/B statistics for the benchmarks in scripts/ (docs/operations.md#benchmarks).

A benchmark on a shared machine sees the load of other processes come and go. Timing A for a
while, then B, lets a burst land on one side only; taking each side's best round flatters
whichever side got the quiet moment. So every benchmark here interleaves A and B in rounds
(A B, B A, A B, ...: the order alternates so neither side always goes first), forms one ratio per
round from the two measurements taken side by side, and reports the median of those paired
ratios with their spread (the lowest and highest, and the interquartile range when there are
enough rounds). A decision against a target uses the median.

What it is not: a timer for a single function (each benchmark measures its own thing) or a
test (benchmarks print numbers and never fail on them).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable


@dataclass
class PairedRatio:
    """Per-round ratios `ratio_fn(a_i, b_i)` and their summary."""

    ratios: list[float]
    a: list[float]
    b: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def spread(self) -> str:
        """'min..max' of the paired ratios, plus the interquartile range with >= 4 rounds."""
        r = sorted(self.ratios)
        text = f"{r[0]:.3f}..{r[-1]:.3f}"
        if len(r) >= 4:
            q = statistics.quantiles(r, n=4)
            text += f", IQR {q[0]:.3f}..{q[2]:.3f}"
        return text

    def line(self, what: str, target: str = "") -> str:
        """One line for the report: the median paired ratio, its spread and the rounds."""
        t = f"   (target {target})" if target else ""
        return (f"{what} = {self.median:.3f} median of {len(self.ratios)} paired rounds "
                f"[{self.spread()}]{t}")


def interleaved(run_a: Callable[[], float], run_b: Callable[[], float], rounds: int,
                ratio_fn: Callable[[float, float], float],
                report: Callable[[int, float, float, float], None] | None = None) -> PairedRatio:
    """Run `run_a` and `run_b` once per round, alternating which goes first, and pair them.

    run_a, run_b: each returns one measurement (seconds, tokens/s, ...: whatever `ratio_fn`
    expects). ratio_fn(a, b): the round's ratio. report(i, a, b, ratio): called after each
    round (printing progress). Raises ValueError when rounds < 1."""
    if rounds < 1:
        raise ValueError(f"rounds = {rounds}: must be >= 1")
    a_vals, b_vals, ratios = [], [], []
    for i in range(rounds):
        if i % 2 == 0:
            a, b = run_a(), run_b()
        else:
            b = run_b()
            a = run_a()
        a_vals.append(a)
        b_vals.append(b)
        ratios.append(ratio_fn(a, b))
        if report is not None:
            report(i + 1, a, b, ratios[-1])
    return PairedRatio(ratios, a_vals, b_vals)
