"""The tail of `.loss.json` as the proxy's readers see it: the last records, read from the end of
the file without holding the history in memory (docs/history.md); their loss EMA is
proxy/run_files/loss_ema.py.
The history's appender and repair are shared/loss_history.py; this module only reads.
"""

from __future__ import annotations

import json
import os

TAIL_BYTES = 1 << 17  # the last 128 KiB of .loss.json: a few hundred records


def tail_records(path, nbytes: int = TAIL_BYTES) -> list[dict]:
    """The complete records in the last `nbytes` of a `.loss.json` (one record per line), in
    order; a torn or partial line is skipped."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - nbytes))
            data = f.read()
    except OSError:
        return []
    out = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        line = line.strip().lstrip("[").rstrip("]").rstrip(",").strip()
        if line.startswith("{"):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and isinstance(r.get("step"), int):
                out.append(r)
    return out
