"""Per-arm probability bounds (floors and caps) of the data-mixture bandit: parsing and checks.

What it is: the operator's `--caps`/`--floors` text turned into {arm: probability}, and the
rules every bound set must meet before training starts (docs/bandit.md#bounds): each value a
probability, floor <= cap per arm, sum(floors) <= 1 <= sum(caps), known arm names only.
What it is not: the projection onto the box (proxy/mixture/box_projection.py) or the bandit
(proxy/mixture/bandit.py). Pure Python: no files, no torch.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from proxy.run_files.loss_ema import finite_number as is_real  # bools are not numbers here

BOUND_SLACK = 1e-9  # tolerance on sum(floors) <= 1 <= sum(caps)


class BanditConfigError(ValueError):
    """A bad operator setting (arm name, floor, cap, prior, config value), refused before training.

    Messages name the arm, the offending value, the rule and the fix
    (docs/architecture.md#bad-input-and-faults). Source: docs/bandit.md#bounds (anything outside
    0 <= floor <= cap <= 1, sum(floor) <= 1 <= sum(cap) is an error).
    """


def _g(x: float) -> str:
    return f"{x:.6g}"


def check_arm_names(arm_names: Iterable[str]) -> list[str]:
    """The arm names sorted; raises BanditConfigError for none, a non-string or empty name, or
    a name listed twice."""
    names = list(arm_names)
    if not names:
        raise BanditConfigError("no arms configured: the bandit needs at least one arm")
    for n in names:
        if not isinstance(n, str) or not n:
            raise BanditConfigError(f"arm name {n!r} is not a non-empty string")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BanditConfigError(f"arm name(s) {', '.join(dup)} listed more than once")
    return sorted(names)


def parse_arm_values(text: str, arm_names: list[str], what: str) -> dict[str, float]:
    """Parse operator text ``"repo-code=0.5,python-docs=0.2"`` into ``{arm: probability}``.

    `what` names the setting in messages (e.g. ``"--caps"``). Empty or blank text gives ``{}``;
    empty entries between commas are skipped. Values are probabilities (unitless, in [0, 1]).
    Raises BanditConfigError for an entry without ``=``, an unknown arm (the message lists the
    known arms), a duplicate arm, a value that is not a number, NaN, or outside [0, 1]. Source:
    docs/architecture.md#bad-input-and-faults ("caps/floors infeasible, unknown arm names, bad
    numbers: refused before anything starts").
    """
    known = check_arm_names(arm_names)
    out: dict[str, float] = {}
    for raw in (text or "").split(","):  # blank text gives {}
        item = raw.strip()
        if not item:
            continue
        if "=" not in item:
            raise BanditConfigError(
                f"{what}: entry {item!r} is not ARM=VALUE; write e.g. {known[0]}=0.1"
            )
        name, _, value_text = item.partition("=")
        name, value_text = name.strip(), value_text.strip()
        if name not in known:
            raise BanditConfigError(f"{what}: unknown arm {name!r}; known arms: {', '.join(known)}")
        if name in out:
            raise BanditConfigError(f"{what}: arm {name!r} given twice; give each arm once")
        try:
            v = float(value_text)
        except ValueError:
            raise BanditConfigError(
                f"{what}: arm {name!r} value {value_text!r} is not a number; "
                f"write a probability in [0, 1] such as {name}=0.1"
            ) from None
        if math.isnan(v):
            raise BanditConfigError(
                f"{what}: arm {name!r} value {value_text!r} is NaN; a probability in [0, 1] is needed"
            )
        if not 0.0 <= v <= 1.0:
            raise BanditConfigError(
                f"{what}: arm {name!r} value {_g(v)} is outside [0, 1]; {what} values are probabilities"
            )
        out[name] = v
    return out


def check_bounds(names: list[str], floors: Mapping[str, float], caps: Mapping[str, float]) -> None:
    """Raise BanditConfigError unless every floor and cap of `names` is a probability, floor <=
    cap per arm and sum(floors) <= 1 <= sum(caps) (slack BOUND_SLACK); the message names the
    arms, the values and the fix. `floors` and `caps` must hold every name."""
    for kind, given in (("floor", floors), ("cap", caps)):
        for n in names:
            v = given[n]
            if not is_real(v) or not 0.0 <= v <= 1.0:
                raise BanditConfigError(f"arm {n!r}: {kind} {v!r} is not a probability in [0, 1]")
    bad = [n for n in names if floors[n] > caps[n]]
    if bad:
        detail = ", ".join(f"{n} (floor {_g(floors[n])} > cap {_g(caps[n])})" for n in bad)
        raise BanditConfigError(
            f"floor above cap for arm(s) {detail}: each arm needs floor <= cap; "
            f"lower the floor or raise the cap"
        )
    sf = math.fsum(floors[n] for n in names)
    if sf > 1.0 + BOUND_SLACK:
        detail = ", ".join(f"{n}={_g(floors[n])}" for n in names if floors[n] > 0)
        raise BanditConfigError(
            f"sum of floors = {_g(sf)} > 1 ({detail}): the floors alone exceed a whole batch; "
            f"lower some floors"
        )
    sc = math.fsum(caps[n] for n in names)
    if sc < 1.0 - BOUND_SLACK:
        detail = ", ".join(f"{n}={_g(caps[n])}" for n in names)
        raise BanditConfigError(
            f"sum of caps = {_g(sc)} < 1 ({detail}): the caps cannot hold a whole batch; "
            f"raise some caps"
        )


def resolve_bounds(
    arm_names: list[str], caps: Mapping[str, float] | None, floors: Mapping[str, float] | None
) -> tuple[dict[str, float], dict[str, float]]:
    """Complete and validate per-arm bounds; returns ``(caps, floors)`` (the argument order).

    Arms not given get floor 0.0 and cap 1.0. Checks, per docs/bandit.md#state: every value a
    probability in [0, 1]; floor <= cap per arm; sum(floors) <= 1 and sum(caps) >= 1 (slack
    1e-9). Raises BanditConfigError naming the unknown arm (with the known ones), the arm(s)
    whose floor exceeds the cap, or the sum and its terms.
    """
    names = check_arm_names(arm_names)
    caps, floors = dict(caps or {}), dict(floors or {})
    for kind, given in (("caps", caps), ("floors", floors)):
        for n in given:
            if n not in names:
                raise BanditConfigError(
                    f"{kind}: unknown arm {n!r}; known arms: {', '.join(names)}"
                )
    full_f = {n: floors.get(n, 0.0) for n in names}
    full_c = {n: caps.get(n, 1.0) for n in names}
    check_bounds(names, full_f, full_c)
    return ({n: float(full_c[n]) for n in names}, {n: float(full_f[n]) for n in names})
