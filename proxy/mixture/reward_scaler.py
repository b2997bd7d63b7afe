"""The reward scaler of the data-mixture bandit: raw rewards mapped into [-1, 1] by quantiles.

What it is: `QuantileScaler`, the 20th/80th-percentile mapping over a reservoir of past raw
rewards (Graves et al. 2017; docs/bandit.md#reward-scaling), with its JSON round trip.
What it is not: the rewards themselves or the EMA (proxy/mixture/bandit.py). Deterministic: the
reservoir is the last N rewards in arrival order, so a replay reproduces it.
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Any, Mapping

from proxy.mixture.arm_bounds import BanditConfigError, is_real

SCALER_CAPACITY = 1000  # raw rewards kept by QuantileScaler (the last N, no sampling)


class QuantileScaler:
    """Maps a raw reward to [-1, 1] by the 20th/80th percentiles of past raw rewards.

    Source: Graves et al. 2017 (section 3, reward scaling), docs/bandit.md#rewards. The reservoir
    is the last `capacity` (default 1000) finite raw rewards, in arrival order, with no
    randomness, so a replay reproduces it. Percentiles use linear interpolation between order
    statistics (numpy's default "linear" method). `scale(r)`: r <= q20 -> -1, r >= q80 -> +1,
    linear between. Degenerate reservoirs: empty -> 0.0; when q80 == q20 (one value, or all
    equal) the result is sign-based: +1 above, -1 below, 0.0 equal. Units: those of the reward
    (nats of loss decrease, or nats of loss for `train_loss`) in, unitless out.
    """

    def __init__(self, capacity: int = SCALER_CAPACITY, low: float = 0.2, high: float = 0.8):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise BanditConfigError(f"QuantileScaler capacity {capacity!r} must be an int >= 1")
        if not (is_real(low) and is_real(high) and 0.0 <= low < high <= 1.0):
            raise BanditConfigError(
                f"QuantileScaler quantiles ({low!r}, {high!r}) need 0 <= low < high <= 1"
            )
        self.capacity, self.low, self.high = capacity, float(low), float(high)
        self._recent: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, r: float) -> None:
        """Append one raw reward (finite float; -0.0 stored as 0.0), dropping the oldest past capacity.

        Raises ValueError for NaN or infinity (callers skip those before they get here).
        """
        if not is_real(r):
            raise ValueError(f"QuantileScaler.add: reward {r!r} is not a finite number")
        r = float(r) + 0.0
        self._recent.append(r)
        bisect.insort(self._sorted, r)
        if len(self._recent) > self.capacity:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def quantile(self, frac: float) -> float:
        """The `frac` quantile (0..1) of the reservoir; raises ValueError when it is empty."""
        s = self._sorted
        if not s:
            raise ValueError("QuantileScaler.quantile: empty reservoir")
        pos = (len(s) - 1) * frac
        i = int(math.floor(pos))
        j = min(i + 1, len(s) - 1)
        return s[i] + (s[j] - s[i]) * (pos - i)

    def scale(self, r: float) -> float:
        """Raw reward -> [-1, 1] (see class docstring for the degenerate cases)."""
        if not self._sorted:
            return 0.0
        q20, q80 = self.quantile(self.low), self.quantile(self.high)
        if q80 <= q20:
            return 1.0 if r > q80 else -1.0 if r < q20 else 0.0
        if r <= q20:
            return -1.0
        if r >= q80:
            return 1.0
        return -1.0 + 2.0 * (r - q20) / (q80 - q20)  # in [-1, 1]: q20 < r < q80

    def to_dict(self) -> dict:
        """JSON-safe state: capacity, quantiles and the reservoir in arrival order."""
        return {
            "capacity": self.capacity,
            "low": self.low,
            "high": self.high,
            "values": list(self._recent),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantileScaler":
        """Inverse of `to_dict`; raises ValueError (or BanditConfigError) on malformed input."""
        try:
            s = cls(int(d["capacity"]), float(d["low"]), float(d["high"]))
            for v in d["values"]:
                s.add(v)
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"scaler state malformed ({e!r}); rebuild the bandit by replay"
            ) from None
        return s
