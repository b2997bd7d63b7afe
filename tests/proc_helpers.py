"""Helpers for tests that drive real proxy and worker processes (no mocks).

`start_proxy(run_dir, *args)` starts `python -m proxy run` with a tiny model and the bytes
tokenizer; `wait_for(pred)` polls; `last_step(run_dir)` reads `.loss.json`.

For the exact-resume, signal and supervision tests: a run directory is created once per
configuration in-process (`create_template`: run.json, the bytes tokenizer, the arms' token
files; no torch, no worker) and copied per scenario (`clone`), which saves the arm tokenization
for every test; `start`/`run` pass fault hooks (worker/fault_injection.py) through `env`, and
`cleaned_up` guarantees that nothing of a run outlives its test.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.checkpoint.manifest import editing_manifest
from shared.processes import alive, process_state

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
    steps = [int(ln.split(",", 1)[0][8:]) for ln in tail.splitlines() if ln.startswith('{"step":')]
    return steps[-1] if steps else 0


def worker_pid(run_dir) -> int | None:
    try:
        return json.loads((Path(run_dir) / ".handshake.json").read_text())["worker"]["pid"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def checkpoint_steps(run_dir) -> list[int]:
    from shared.checkpoint.directory import list_checkpoints
    return [s for s, _ in list_checkpoints(run_dir)]


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 60) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout=timeout)


pid_alive = alive  # a zombie counts as dead (shared/processes.py)


# The exactness configuration: a short warm-up so a resume can land inside it and after it, a
# cadence of 10, and a bandit that moves every 10 steps (so the mixture is part of what resumes):
# the probe's EXP3 policy, which moves at every probe (the default, train_slope, stays at
# stratified until its evidence is strong, which a 60-step run on three alike arms never gives).
EXACT = ["--max-steps", "60", "--checkpoint-every", "10", "--probe-every", "10",
         "--warmup-steps", "20", "--bandit-warmup", "0", "--reward", "heldout_progress"]


def create_template(run_dir: Path, *args: str) -> Path:
    """Create a run directory as `python -m proxy run --run-dir run_dir TINY args` would, without
    training a step. Returns run_dir."""
    from proxy.commands.run_args import add_run_args, config_from_args
    from proxy.supervision.run_setup import create_run
    from shared.run.layout import RunLayout
    ap = argparse.ArgumentParser()
    add_run_args(ap)
    a = ap.parse_args(["--run-dir", str(run_dir), *TINY, *args])
    create_run(RunLayout(run_dir), config_from_args(a))
    return Path(run_dir)


def clone(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest)
    return dest


def _env(extra: dict | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANDREA_TEST_")}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra or {})
    return env


cmd = proxy_cmd  # the name the signal and supervision tests use


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


def usr1_forwarded(run_dir: Path) -> int:
    """How many SIGUSR1 the proxy has forwarded to its worker (it logs each after sending it)."""
    return proxy_log(run_dir).count("SIGUSR1 received: forwarded to worker pid")


def usr1_to_paused_worker(proc: subprocess.Popen, run_dir: Path, step: int, n: int = 1) -> None:
    """Send `n` SIGUSR1 to the proxy while its worker pauses inside update `step`
    (ANDREA_TEST_PAUSE_AT_STEP), wait until the proxy has forwarded them, then end the pause
    (`.test-release-<step>`): the worker has the signal before the step's boundary, however
    slowly a loaded machine delivers it."""
    before = usr1_forwarded(run_dir)
    for _ in range(n):
        proc.send_signal(signal.SIGUSR1)
    wait_for(lambda: usr1_forwarded(run_dir) > before, 120, what="the proxy to forward SIGUSR1")
    (Path(run_dir) / f".test-release-{step}").touch()


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


def drop_manifest_entries(run_dir: Path, steps) -> None:
    """Drop the manifest entries of `steps` (a .bin without an entry still loads)."""
    with editing_manifest(run_dir) as entries:
        for step in set(steps) & entries.keys():
            del entries[step]


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
            if process_state(int(d)) in (None, "Z"):
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
    keys = ("step", "loss", "lr", "tokens", "arms", "p", "arm_loss", "arm_unigram_loss", "probe",
            "period")
    return [{k: r.get(k) for k in keys} for r in records]


def assert_same_run(ref: Path, other: Path, final: int) -> None:
    """Byte-identical final checkpoint and identical loss records 1..final."""
    from shared.checkpoint.file_format import checkpoint_name
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
