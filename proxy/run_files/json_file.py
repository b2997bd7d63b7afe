"""The one reader of the proxy's small JSON run files, with the error policy chosen by the caller
(docs/architecture.md#bad-input-and-faults).

What it is not: a writer (shared/atomic_io.py `atomic_write_json`), or the reader of `.loss.json`
(shared/run/loss_history.py, whose `tail_records` reads its tail).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

from shared.atomic_io import read_json as parse_json_file

log = logging.getLogger("proxy.run_files.sidecars")

Garbage = Literal["default", "aside", "raise"]


def read_json(path: Path | str, default: Any = None, *, garbage: Garbage = "default") -> Any:
    """The JSON content of `path` (parsed by shared/atomic_io.py `read_json`, the project's one
    parser); `default` when the file is missing. A file that is not JSON (or cannot be read) is
    handled by `garbage`:

    - "default": return `default` (a reader that must never disturb a live run: `status`);
    - "aside": move it to `<name>.corrupt-<time>` with a warning naming it and return
      `default` (a sidecar the proxy rebuilds: `.samples.json`, `.state.json`);
    - "raise": raise the ValueError (naming the file and the byte offset) or the OSError.
    """
    path = Path(path)
    try:
        return parse_json_file(path, default)
    except (ValueError, OSError) as e:
        if garbage == "raise":
            raise
        if garbage == "aside" and isinstance(e, ValueError):
            aside = Path(f"{path}.corrupt-{int(time.time())}")
            path.replace(aside)
            log.warning(
                "%s: unreadable (%s); moved aside to %s and starting it afresh", path, e, aside.name
            )
        return default
