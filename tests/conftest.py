import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

# No time limits: hypothesis' per-example deadline (200 ms) and its slow-generation health check
# fail a correct test on a loaded machine, and no test may depend on the machine being quiet.
settings.register_profile("andrea", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("andrea")
