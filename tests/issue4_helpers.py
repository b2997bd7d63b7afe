"""Helpers for the issue-4 tests (exact resume, signals, supervision): real processes only.

A run directory is created once per configuration in-process (`create_template`: run.json, the
bytes tokenizer, the arms' token files; no torch, no worker) and copied per scenario (`clone`),
which saves the arm tokenization for every test. Fault hooks (worker/fault_injection.py) are
passed through `env`.
"""
from __future__ import annotations

import argparse
import json
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from proc_helpers import ROOT, TINY, loss_records, wait_for

# The exactness configuration: a short warm-up so a resume can land inside it and after it, a
# cadence of 10, and a bandit that moves every 10 steps (so the mixture is part of what resumes).
EXACT = ["--max-steps", "60", "--checkpoint-every", "10", "--probe-every", "10",
         "--warmup-steps", "20", "--bandit-warmup", "0"]


def create_template(run_dir: Path, *args: str) -> Path:
    """Create a run directory as `python -m proxy run --run-dir run_dir TINY args` would, without
    training a step. Returns run_dir."""
    from proxy import cli, pivot
    from proxy.run_setup import create_run
    from shared.run_layout import RunLayout
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd")
    p = sub.add_parser("run")
    cli._add_run_args(p)
    pivot.add_run_extras(p)
    a = ap.parse_args(["run", "--run-dir", str(run_dir), *TINY, *args])
    create_run(RunLayout(run_dir), cli._config_from_args(a))
    return Path(run_dir)


def clone(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest)
    return dest


def _env(extra: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANDREA_TEST_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra or {})
    return env


def cmd(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "proxy", "run", "--run-dir", str(run_dir), *TINY, *args]


def start(run_dir: Path, *args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """Start a proxy in the background; output to run_dir/../<name>.out."""
    log = open(Path(run_dir).parent / f"{Path(run_dir).name}.out", "ab")
    return subprocess.Popen(cmd(run_dir, *args), cwd=ROOT, env=_env(env), stdout=log,
                            stderr=subprocess.STDOUT, **kw)


def run(run_dir: Path, *args: str, env: dict | None = None, timeout: float = 300):
    """Run a proxy to its end; the CompletedProcess (text output captured)."""
    return subprocess.run(cmd(run_dir, *args), cwd=ROOT, env=_env(env), capture_output=True,
                          text=True, timeout=timeout)


def output(run_dir: Path) -> str:
    p = Path(run_dir).parent / f"{Path(run_dir).name}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def proxy_log(run_dir: Path) -> str:
    p = Path(run_dir) / "logs" / "proxy.log"
    return p.read_text(errors="replace") if p.exists() else ""


def reports(run_dir: Path) -> list[dict]:
    """The current worker incarnation's reports (.reports.jsonl), complete lines only."""
    try:
        lines = (Path(run_dir) / ".reports.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def wait_report(run_dir: Path, pred, timeout: float = 120, what: str = "a report") -> dict:
    return wait_for(lambda: next((r for r in reports(run_dir) if pred(r)), None), timeout,
                    what=what)


def manifest(run_dir: Path) -> list[tuple[int, str, bool]]:
    """(step, reason, pinned) of every checkpoints.json entry."""
    try:
        d = json.loads((Path(run_dir) / "checkpoints.json").read_text())
    except FileNotFoundError:
        return []
    return [(e["step"], e["reason"], e["pinned"]) for e in d["checkpoints"]]


def hello_pid(run_dir: Path, timeout: float = 120) -> int:
    """The pid of the current worker once it has said hello."""
    return wait_report(run_dir, lambda r: r.get("type") == "hello", timeout, "the worker's hello")["pid"]


def run_processes(run_dir: Path) -> list[int]:
    """Pids (not zombies) whose command line names `run_dir`: proxy, worker, their children."""
    needle = str(run_dir).encode()
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            out.append(int(d))
        except OSError:
            pass
    return out


def kill_all(procs) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(30)


def kill_run(run_dir: Path) -> None:
    """SIGKILL whatever of the run is still running (test clean-up)."""
    for pid in run_processes(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def cleaned_up(proc, run_dir: Path):
    """`with cleaned_up(proc, run):` — whatever the test body does, the proxy and every process
    of the run are gone afterwards (SIGKILL), so a failing test leaves nothing running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(run_dir)


def compare_keys(records: list[dict]) -> list[dict]:
    keys = ("step", "loss", "lr", "tokens", "arms", "p", "arm_loss", "probe", "period")
    return [{k: r.get(k) for k in keys} for r in records]


def assert_same_run(ref: Path, other: Path, final: int) -> None:
    """Byte-identical final checkpoint and identical loss records 1..final."""
    from shared.checkpoint_format import checkpoint_name
    name = checkpoint_name(final)
    assert (ref / name).read_bytes() == (other / name).read_bytes(), \
        f"{other / name} differs from the uninterrupted run's"
    rb = loss_records(other)
    assert [r["step"] for r in rb] == list(range(1, final + 1)), "history must hold one record per step"
    assert compare_keys(loss_records(ref)) == compare_keys(rb)


def stopped_step(run_dir: Path) -> int:
    """Step of the newest `stopped` event in the reports."""
    ev = [r for r in reports(run_dir) if r.get("event") == "stopped"]
    return ev[-1]["step"]


def sigterm_and_wait(proc: subprocess.Popen, timeout: float = 120) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=timeout)


def now() -> float:
    return time.time()
