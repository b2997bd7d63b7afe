#!/usr/bin/env python3
"""Polish pivot for operators (docs/pivots.md): the same as `python -m proxy pivot`.

    scripts/polish_pivot.py --run-dir runs/x --caps repo-code=0.5 --floors python-docs=0.2 --label v3

Validates the bounds, then asks the live proxy to pivot in place (same pid: the worker stops at
the next cadence boundary B, the phase is archived and recorded, a new worker starts from
step_B.bin) and waits until the new worker filed step B+1, printing the progress; on a stopped
run it records the new phase in the foreground and the next `run` trains in it (docs/pivots.md).
Exit code: 0 in force (or accepted, --no-wait), 1 the pivot did not complete, 2 refused.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["pivot", *sys.argv[1:]]))
