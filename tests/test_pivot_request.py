"""proxy/run_files/pivot_request.py's lock (docs/pivots.md#withdrawing-a-pivot): reentrant in a
process whatever timeout each caller asks for, exclusive between processes. Fast."""
import subprocess
import sys

from proc_helpers import ROOT
from proxy.run_files.pivot_request import request_lock
from shared.run.layout import RunLayout


def test_the_request_lock_is_reentrant_with_any_timeout_and_excludes_other_processes(tmp_path):
    """Resume planning holds it (30 s) around moves that take it again (1 s): a second FileLock
    of the same path with other arguments raised ValueError there; another process times out
    with RequestLockTimeout naming the lock, and gets it once it is free."""
    layout = RunLayout(tmp_path)
    probe = ("import sys; sys.path.insert(0, sys.argv[1]);"
             "from proxy.run_files.pivot_request import request_lock, RequestLockTimeout;"
             "from shared.run.layout import RunLayout\n"
             "try:\n"
             "    with request_lock(RunLayout(sys.argv[2]), timeout=0.2): print('got it')\n"
             "except RequestLockTimeout as e: print('timeout', e)")

    def other() -> str:
        return subprocess.run([sys.executable, "-c", probe, str(ROOT), str(tmp_path)],
                              capture_output=True, text=True, timeout=60).stdout

    with request_lock(layout):
        with request_lock(layout, timeout=1.0):
            with request_lock(layout, timeout=0.0):
                out = other()
    assert out.startswith("timeout") and ".pivot.request.lock" in out, out
    assert other().startswith("got it")
