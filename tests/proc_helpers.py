"""Helpers for tests that drive real proxy and worker processes (no mocks).

`start_proxy(run_dir, *args)` starts `python -m proxy run` with a tiny model and the bytes
tokenizer; `wait_for(pred)` polls; `last_step(run_dir)` reads `.loss.json`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A tiny model (42,880 parameters) on raw bytes: creation takes ~1 s, a step a few ms.
TINY = ["--preset", "andrea-test", "--tokenizer", "bytes", "--batch-size", "8",
        "--print-every", "1000"]


def proxy_cmd(run_dir, *args: str) -> list[str]:
    return [sys.executable, "-m", "proxy", "run", "--run-dir", str(run_dir), *TINY, *args]


def start_proxy(run_dir, *args: str, log_name: str = "proxy-test.log") -> subprocess.Popen:
    """Start a proxy in the background; its output goes to run_dir/../<log_name>."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    log = open(Path(run_dir).parent / log_name, "ab")
    return subprocess.Popen(proxy_cmd(run_dir, *args), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def run_proxy(run_dir, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run a proxy to completion; returns the CompletedProcess with output captured."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(proxy_cmd(run_dir, *args), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def wait_for(pred, timeout: float = 60.0, interval: float = 0.02, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def loss_records(run_dir) -> list[dict]:
    try:
        return json.loads((Path(run_dir) / ".loss.json").read_text())
    except (FileNotFoundError, ValueError):
        return []


def last_step(run_dir) -> int:
    """The last step in .loss.json, read from the tail (cheap enough to poll)."""
    p = Path(run_dir) / ".loss.json"
    try:
        with open(p, "rb") as f:
            f.seek(max(0, p.stat().st_size - 4096))
            tail = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return 0
    steps = [int(l.split(",", 1)[0][8:]) for l in tail.splitlines() if l.startswith('{"step":')]
    return steps[-1] if steps else 0


def worker_pid(run_dir) -> int | None:
    try:
        return json.loads((Path(run_dir) / ".handshake.json").read_text())["worker"]["pid"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def checkpoint_steps(run_dir) -> list[int]:
    from shared.checkpoint_format import list_checkpoints
    return [s for s, _ in list_checkpoints(run_dir)]


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
