import sys
from pathlib import Path

from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

# No per-example time limit: hypothesis' default deadline (200 ms) fails a correct test on a
# loaded machine, and no test may depend on the machine being quiet.
settings.register_profile("andrea", deadline=None)
settings.load_profile("andrea")
