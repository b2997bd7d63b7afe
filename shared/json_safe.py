"""Values made safe for strict JSON: the one helper every writer of a JSON record uses.

What it is: `jsonable(value)`, so that `json.dumps(..., allow_nan=False)` never fails on a loss
that went NaN. Used by `.loss.json` (shared/run/loss_history.py) and the worker's step reports
(shared/run/handshake.py).
What it is not: an encoder (callers choose separators and key order). Standard library only.
"""

from __future__ import annotations

import math


def jsonable(value):
    """`value` with every non-finite float replaced by None (recursively); tuples become lists,
    numpy/torch scalars and arrays go through `.tolist()`. Nothing is added or renamed."""
    t = type(value)
    if t is float:
        return value if math.isfinite(value) else None
    if value is None or t is str or t is int or t is bool:
        return value
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):  # float subclasses, e.g. numpy.float64
        return jsonable(float(value))
    if isinstance(value, (int, str)):
        return value
    tolist = getattr(value, "tolist", None)
    if callable(tolist):  # numpy / torch scalars and arrays
        return jsonable(tolist())
    return value  # let json.dumps name the unsupported type
