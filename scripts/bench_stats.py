"""Paired A/B statistics for the benchmarks in scripts/ (docs/operations.md#benchmarks).

A benchmark on a shared machine sees the load of other processes come and go. Timing A for a
while, then B, lets a burst land on one side only; taking each side's best round flatters
whichever side got the quiet moment. So every benchmark here interleaves A and B in rounds
(A B, B A, A B, ...: the order alternates so neither side always goes first), forms one ratio per
round from the two measurements taken side by side, and reports the median of those paired
ratios with their spread (the lowest and highest, and the interquartile range when there are
enough rounds). A decision against a target uses a 95 % confidence interval of that median
(order statistics of the paired ratios, a distribution-free interval: Conover, "Practical
Nonparametric Statistics", 3rd ed., section 3.2): met when the whole interval is on the right
side of the target, not met when it is all on the wrong side, "cannot decide" when it straddles
the target. Fewer than MIN_ROUNDS (6) rounds cannot reach 95 % (the whole range of 5 covers the
median with 94 %, of 2 with 50 %), so they never decide.

Every benchmark ends with one line per figure (`result_line`):

    RESULT {"figure": ..., "ratio": ..., "low": ..., "high": ..., "target": ..., "met": true|false|null}

A script hands each line to `add_result` (`PairedRatio.report` does it itself) and they are
printed together as the last lines of its output, after everything else it prints
(`print_results`, also run at exit). `met` always agrees with low, high and the target
(`decide`); a figure that is one exact count, not a measurement (bytes written), decides from its
single value (`exact_result_line`).

Sides that must not share a process (glibc's malloc settings, a warm allocator, imported
modules) run as fresh processes through `run_json`, which returns the JSON object a child prints
on its last line of output.

What it is not: a timer for a single function (each benchmark measures its own thing) or a
test (benchmarks print numbers and never fail on them).
"""
from __future__ import annotations

import atexit
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_ROUNDS = 6   # the fewest paired rounds whose range is a 95 % interval of the median


def median_ci(values: Sequence[float], conf: float = 0.95) -> tuple[float, float]:
    """(low, high): a distribution-free confidence interval for the median of `values`, the
    k-th smallest and k-th largest value where k is the largest rank with
    P(Binomial(n, 1/2) < k) <= (1 - conf) / 2 (k = 1, the whole range, below 6 values at
    95 %). Raises ValueError on an empty sequence."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        raise ValueError("median_ci of no values")
    alpha, k, tail = (1 - conf) / 2, 1, 0.0
    while True:                                  # tail = P(B <= k - 1) for B ~ Bin(n, 1/2)
        nxt = tail + math.comb(n, k - 1) / 2 ** n
        if nxt > alpha or k > n // 2:
            break
        tail, k = nxt, k + 1
    k = max(1, k - 1)
    return v[k - 1], v[n - k]


def decide(low: float, high: float, target: float, lower_is_better: bool = True) -> bool | None:
    """True when the interval [low, high] lies on the good side of `target` (at or below it
    when lower is better), False when it lies wholly on the other side, None (cannot decide)
    when it straddles the target."""
    if lower_is_better:
        return True if high <= target else (False if low > target else None)
    return True if low >= target else (False if high < target else None)


def result_line(figure: str, ratios: Sequence[float], target: float | None,
                lower_is_better: bool = True) -> str:
    """The `RESULT {...}` line for one figure: the median of `ratios`, its 95 % interval
    (`median_ci`), the target and the verdict (`decide`; null without a target or with fewer
    than MIN_ROUNDS ratios)."""
    low, high = (round(x, 4) for x in median_ci(ratios))   # decided on what is printed
    met = None if target is None or len(ratios) < MIN_ROUNDS else \
        decide(low, high, target, lower_is_better)
    return "RESULT " + json.dumps({"figure": figure, "ratio": round(statistics.median(ratios), 4),
                                   "low": low, "high": high,
                                   "target": target, "met": met, "rounds": len(ratios)})


def exact_result_line(figure: str, value: float, target: float | None,
                      lower_is_better: bool = True) -> str:
    """The `RESULT {...}` line for a figure that is an exact count, not a timing (bytes written
    over a file's size): low = high = the value, and it decides against the target at once."""
    value = round(value, 4)   # decided on what is printed
    met = None if target is None else decide(value, value, target, lower_is_better)
    return "RESULT " + json.dumps({"figure": figure, "ratio": value,
                                   "low": value, "high": value,
                                   "target": target, "met": met, "rounds": 1, "exact": True})


RESULTS: list[str] = []   # RESULT lines not yet printed, in the order they were added


def add_result(line: str) -> None:
    """Keep a `RESULT {...}` line (from `result_line`) for `print_results`. Raises ValueError
    on a line that is not one."""
    if not line.startswith("RESULT {"):
        raise ValueError(f"add_result: not a RESULT line: {line[:60]!r}")
    RESULTS.append(line)


def print_results() -> None:
    """Print the kept RESULT lines, once, as the script's last lines (run at exit too)."""
    sys.stdout.flush()
    while RESULTS:
        print(RESULTS.pop(0), flush=True)


atexit.register(print_results)


def verdict_text(ratios: Sequence[float], target: float, lower_is_better: bool = True) -> str:
    """'meets the target', 'misses the target' or 'cannot decide (...)' in words."""
    low, high = median_ci(ratios)
    if len(ratios) < MIN_ROUNDS:
        return (f"cannot decide: {len(ratios)} rounds (at least {MIN_ROUNDS} are needed for a "
                f"95 % interval; range {low:.3f}..{high:.3f}, target {target})")
    met = decide(low, high, target, lower_is_better)
    if met is None:
        return (f"cannot decide: the 95 % interval {low:.3f}..{high:.3f} straddles the target "
                f"{target}")
    return ("meets" if met else "misses") + f" the target {target} (95 % interval " \
        f"{low:.3f}..{high:.3f})"


def run_json(args: Sequence[str], env: dict | None = None, timeout: float | None = None) -> dict:
    """Run `python args...` as a fresh process from the repository root and return the JSON
    object on its last line of stdout. Raises RuntimeError with the child's stderr tail when
    it fails or prints no JSON."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, check=False,
                       text=True, timeout=timeout)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(args)} exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(lines[-1])


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

    def paired_se(self) -> float:
        """Standard error of the mean log ratio (0 with one round): exp(mean +- 2 se) is the
        mean's interval on the ratio scale."""
        logs = [math.log(r) for r in self.ratios if r > 0]
        return statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0

    def report(self, figure: str, target: float | None, lower_is_better: bool = True) -> str:
        """The summary line and the verdict in words, for printing; the `RESULT` line goes to
        `add_result` (printed with the others as the script's last lines)."""
        lo, hi = median_ci(self.ratios)
        gm = math.exp(statistics.fmean(math.log(r) for r in self.ratios if r > 0))
        se = self.paired_se()
        text = (self.line(figure, "" if target is None else str(target))
                + f"\n  95 % interval of the median {lo:.3f}..{hi:.3f}; geometric mean "
                  f"{gm:.3f} (paired s.e. of log ratio {se:.3f})")
        if target is not None:
            text += "\n  " + verdict_text(self.ratios, target, lower_is_better)
        add_result(result_line(figure, self.ratios, target, lower_is_better))
        return text + "\n  (its RESULT line is printed with the others at the end)"


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
