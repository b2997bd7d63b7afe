#!/usr/bin/env python3
"""Polish pivot for operators (SPEC section 8): the same as `python -m proxy pivot`.

    scripts/polish_pivot.py --run-dir runs/x --caps repo-code=0.5 --floors python-docs=0.2 --label v3

Validates the bounds, asks the live proxy to checkpoint and stop at the next cadence boundary B,
waits for step_B.bin and a clean exit, then starts the proxy again detached under the new bounds
(see proxy/pivot.py). Exit code: 0 done, 1 the run did not stop, 2 refused (bad bounds).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["pivot", *sys.argv[1:]]))
