"""The exact KL projection of arm weights onto the box of per-arm floors and caps.

What it is: `project_to_box(q, floors, caps)` = argmin_p KL(p || q) subject to
floor <= p <= cap and sum p = 1, solved exactly (docs/bandit.md#policy-softmax-then-the-projection-onto-the-box).
What it is not: the checks of the bounds themselves (proxy/mixture/arm_bounds.py) or the bandit that
calls it (proxy/mixture/bandit.py). Plain Python floats with `math.fsum`, so the result is the same
bit for bit on every run.
"""

from __future__ import annotations

import bisect
import math
from typing import Mapping

from proxy.mixture.arm_bounds import BanditConfigError, check_bounds, is_real


def clip(x: float, lo: float, hi: float) -> float:
    """`x` limited to [lo, hi]."""
    return lo if x < lo else hi if x > hi else x


def _solve_box(q: list[float], lo: list[float], hi: list[float], target: float) -> list[float]:
    """p_i = clip(c q_i, lo_i, hi_i) with sum p = target; all q_i > 0. c from the breakpoints."""
    if target <= math.fsum(lo):
        return list(lo)
    if target >= math.fsum(hi):
        return list(hi)
    k = len(q)
    lb = [lo[i] / q[i] for i in range(k)]
    ub = [hi[i] / q[i] for i in range(k)]

    def f(c: float) -> float:
        return math.fsum(clip(c * q[i], lo[i], hi[i]) for i in range(k))

    # f is continuous, piecewise linear and non-decreasing, f(0) = sum lo < target < f(inf).
    bps = sorted({0.0, *lb, *ub})
    j = bisect.bisect_left(bps, target, key=f)  # the first breakpoint reaching target; j >= 1
    prev, b = bps[j - 1], bps[min(j, len(bps) - 1)]
    # Within [prev, b] the free set is fixed, so c solves one linear equation exactly:
    # c = rest / sum(q_free). Written as p_i = rest * q_i / sum(q_free) so tiny q cannot overflow c.
    at_floor = [i for i in range(k) if lb[i] >= b]
    at_cap = [i for i in range(k) if ub[i] <= prev]
    free = [i for i in range(k) if lb[i] < b and ub[i] > prev]
    p = [hi[i] if ub[i] <= prev else lo[i] for i in range(k)]
    sq = math.fsum(q[i] for i in free)
    if sq > 0:
        rest = target - math.fsum(lo[i] for i in at_floor) - math.fsum(hi[i] for i in at_cap)
        for i in free:
            p[i] = clip(rest * (q[i] / sq), lo[i], hi[i])
    return _renormalise(p, q, lo, hi, target)


def _renormalise(
    p: list[float], q: list[float], lo: list[float], hi: list[float], target: float
) -> list[float]:
    """Remove the rounding residue target - sum(p), staying within [lo, hi].

    The residue goes first to arms strictly inside their bounds, in proportion to q (the exact
    KL correction), then, if none can take it, to arms with room in proportion to the room.
    """
    k = len(p)
    for _ in range(2 * k + 2):
        err = target - math.fsum(p)
        if err == 0.0:
            break
        inside = [i for i in range(k) if lo[i] < p[i] < hi[i]]
        si = math.fsum(q[i] for i in inside)
        if inside and si > 0:
            new = [clip(p[i] + err * (q[i] / si), lo[i], hi[i]) for i in inside]
            if all(x == p[i] for x, i in zip(new, inside)):
                break  # below one ulp everywhere: done
            for x, i in zip(new, inside):
                p[i] = x
            continue
        room = [(hi[i] - p[i]) if err > 0 else (p[i] - lo[i]) for i in range(k)]
        total = math.fsum(room)
        if total <= 0:
            break
        share = min(1.0, abs(err) / total)
        sign = 1.0 if err > 0 else -1.0
        new = [clip(p[i] + sign * room[i] * share, lo[i], hi[i]) for i in range(k)]
        if new == p:
            break
        p = new
    return p


def project_to_box(
    q: Mapping[str, float], floors: Mapping[str, float], caps: Mapping[str, float]
) -> dict[str, float]:
    """The KL projection of weights `q` onto the box: argmin_p KL(p || q), floor <= p <= cap, sum 1.

    `q`: non-negative finite weights per arm (need not sum to 1). Floors/caps missing for an arm
    default to 0/1. Solution (docs/bandit.md#policy-softmax-then-the-projection-onto-the-box): p_i
    = clip(c q_i, floor_i, cap_i) with the
    one c > 0 that makes sum p = 1, found exactly by sorting the breakpoints floor_i/q_i and
    cap_i/q_i and solving the linear piece that crosses 1; the result is renormalised within
    bounds so sum p = 1 to rounding. Arms with q_i == 0 stay at their floor (KL forbids more)
    unless the positive arms all at their caps still fall short of 1; then the shortfall is
    spread over the zero arms as if they had equal infinitesimal weight (the limit of the KL
    solution). All q zero: the box projection of the uniform distribution.
    Raises BanditConfigError for infeasible bounds or unknown arms, ValueError for a negative,
    NaN or infinite weight. Example: q=[.90,.05,.03,.02], floors [.05,.05,.10,.05],
    caps [.5,.6,.6,.6] gives p=[.50,.25,.15,.10].
    """
    names = sorted(q)
    if not names:
        raise BanditConfigError("project_to_box: no arms")
    for kind, given in (("floors", floors), ("caps", caps)):
        extra = sorted(set(given) - set(names))
        if extra:
            raise BanditConfigError(
                f"{kind}: unknown arm(s) {', '.join(extra)}; known arms: {', '.join(names)}"
            )
    lo_d = {n: floors.get(n, 0.0) for n in names}
    hi_d = {n: caps.get(n, 1.0) for n in names}
    check_bounds(names, lo_d, hi_d)
    for n in names:
        if not is_real(q[n]) or q[n] < 0:
            raise ValueError(
                f"project_to_box: arm {n!r} weight {q[n]!r} is not a finite number >= 0"
            )
    top = max(float(q[n]) for n in names)
    qn = {n: (float(q[n]) / top if top > 0 else 0.0) for n in names}  # max 1: no overflow
    pos = [n for n in names if qn[n] > 0]
    zero = [n for n in names if qn[n] <= 0]
    out: dict[str, float] = {}
    cap_pos = math.fsum(hi_d[n] for n in pos)
    floor_zero = math.fsum(lo_d[n] for n in zero)
    if pos and cap_pos + floor_zero >= 1.0:
        vals = _solve_box(
            [qn[n] for n in pos], [lo_d[n] for n in pos], [hi_d[n] for n in pos], 1.0 - floor_zero
        )
        out.update(zip(pos, vals))
        out.update((n, float(lo_d[n])) for n in zero)
    else:
        out.update((n, float(hi_d[n])) for n in pos)
        vals = _solve_box(
            [1.0] * len(zero), [lo_d[n] for n in zero], [hi_d[n] for n in zero], 1.0 - cap_pos
        )
        out.update(zip(zero, vals))
    return {n: out[n] for n in names}
