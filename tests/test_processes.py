"""shared/processes.py, the one answer to "does this process run": states, zombies, gone and
reused pids, process groups. Real child processes. Fast."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from proc_helpers import wait_for
from shared.processes import alive, group_members, process_state, seconds_since_start


def test_this_process_runs_and_started_moments_ago_by_its_own_clock():
    assert process_state(os.getpid()) == "R" and alive(os.getpid())
    assert 0 < seconds_since_start() < 3600
    assert os.getpid() in group_members(os.getpgrp())


def test_a_stopped_process_reads_T_a_zombie_Z_and_dead_and_a_reaped_one_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for(lambda: process_state(child.pid) == "S", 60, what="the child to sleep")
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(child.pid) == "T", 60, what="the child to stop")
        assert alive(child.pid)  # stopped is not dead
        os.kill(child.pid, signal.SIGKILL)
        wait_for(lambda: process_state(child.pid) == "Z", 60, what="the child to exit unreaped")
        assert not alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None and not alive(child.pid)


def test_a_process_younger_than_its_record_is_not_the_one_recorded():
    """A record stamped at `started_by` names a process that started before it (plus a slack);
    one that started later holds a reused pid."""
    me = os.getpid()
    assert alive(me, started_by=time.time())
    assert not alive(me, started_by=time.time() - 3600)
    assert not alive(me, started_by="not a time")


def test_bad_pids_read_as_gone():
    for pid in (-1, 0, 2 ** 22 + 12345, None, "12", True):
        assert process_state(pid) is None and not alive(pid)
