"""shared/procfs.py, the one reader of /proc/PID/stat: fields, zombies, gone processes, and a
command name with spaces and parentheses (which a split on the first ")" misreads). Fast."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil

from proc_helpers import wait_for
from shared.procfs import all_pids, process_state, read_stat


def test_read_stat_of_this_process_matches_the_os():
    st = read_stat(os.getpid())
    assert (st.pid, st.ppid, st.pgrp, st.session) == (os.getpid(), os.getppid(), os.getpgrp(),
                                                      os.getsid(0))
    assert st.state == "R"
    started = psutil.boot_time() + st.start_ticks / os.sysconf("SC_CLK_TCK")
    assert abs(started - psutil.Process().create_time()) < 1.0
    assert os.getpid() in all_pids()


def test_a_zombie_reads_Z_and_a_reaped_process_reads_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: process_state(child.pid) == "Z", 120, what="the child to exit unreaped")
    child.wait()
    assert process_state(child.pid) is None and read_stat(child.pid) is None


def test_a_command_name_with_spaces_and_parentheses_is_parsed_after_the_last_paren():
    name = b"a) (b c) Z 1"  # prctl(PR_SET_NAME) keeps 15 bytes: the whole of this
    code = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, %r, 0, 0, 0); "
            "print('ready', flush=True); time.sleep(60)" % name)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        st = read_stat(child.pid)
        assert st.comm == name.decode()
        assert st.state in ("S", "R") and st.ppid == os.getpid() and st.pgrp == os.getpgrp()
    finally:
        child.kill()
        child.wait()


def test_bad_pids_read_as_gone():
    assert read_stat(-1) is None and read_stat(2 ** 22 + 12345) is None
    assert process_state(0) is None
