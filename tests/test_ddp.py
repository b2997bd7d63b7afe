"""Multi-process training under torchrun (docs/signals.md#several-ranks): 2 ranks on CPU with
the gloo backend, real proxy / torchrun agent / rank processes, real signals, real files.

Each run uses two small text arms (standard-library sources) so creation takes about a second.
"""
import json
import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import psutil
import pytest

from proc_helpers import (
    ROOT,
    checkpoint_steps,
    last_step,
    loss_records,
    pid_alive,
    run_proxy,
    start_proxy,
    wait_for,
)
from shared.checkpoint.file_format import checkpoint_name
from shared.checkpoint.read import load_checkpoint

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

STDLIB = Path(sysconfig.get_paths()["stdlib"])
ARMS = ["--arm", f"argparse=text:{STDLIB / 'argparse.py'}",
        "--arm", f"typing=text:{STDLIB / 'typing.py'}"]
N_PARAMS = 42_880  # andrea-test on bytes
BIG = ["--max-steps", "100000", "--checkpoint-every", "100000", "--sample-every", "100000"]

# 1 rank vs 2 ranks: identical batches and learning rates; DDP averages the two half-batch
# gradients where one rank takes the mean over the whole batch, so only the float32 summation
# order differs. Observed after 20 AdamW updates (andrea-test, batch 8): max |difference|
# 5.2e-7 for the weights, 3.0e-8 for m, 8.7e-11 for v. The bound |2-rank - 1-rank| <=
# ATOL + RTOL * |1-rank| leaves 10x margin; a real bug (a rank training on the wrong rows,
# gradients summed not averaged, a missed update) moves the weights by ~1e-3 or more.
RTOL, ATOL = 1e-4, 5e-6


def ranks(run) -> list[int]:
    try:
        w = json.loads((Path(run) / ".handshake.json").read_text())["worker"] or {}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return []
    return list(w.get("pids") or [])


def hello(run) -> dict:
    try:
        return json.loads((Path(run) / ".handshake.json").read_text())["worker"] or {}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return {}


def leftovers(run) -> list[str]:
    """Processes whose command line names the run directory (proxy, agent, ranks)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = p.info.get("cmdline") or []
        if p.info.get("status") != psutil.STATUS_ZOMBIE and any(str(run) in c for c in cmd):
            out.append(f"{p.info['pid']}: {' '.join(cmd)[:160]}")
    return out


def manifest(run) -> list[tuple]:
    return [(e["step"], e["reason"]) for e in
            json.loads((Path(run) / "checkpoints.json").read_text())["checkpoints"]]


def start2(run, *args):
    return start_proxy(run, *ARMS, "--nproc-per-node", "2", *args)


def finish(proc, run):
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    for line in leftovers(run):  # never leave ranks behind for the next test
        psutil.Process(int(line.split(":")[0])).kill()


def test_two_ranks_sigusr1_then_sigterm_to_the_proxy_give_one_checkpoint_and_stop_everything(tmp_path):
    run = tmp_path / "run"
    proc = start2(run, *BIG)
    try:
        wait_for(lambda: last_step(run) >= 5 and len(ranks(run)) == 2, 240, what="2 ranks training")
        pids = ranks(run)
        agent = psutil.Process(proc.pid).children()[0].pid
        assert hello(run)["world_size"] == 2
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: checkpoint_steps(run), 60, what="the SIGUSR1 checkpoint")
        usr1_step = checkpoint_steps(run)[0]
        wait_for(lambda: last_step(run) >= usr1_step + 5, 60, what="training to go on")
        assert proc.poll() is None and all(pid_alive(p) for p in pids), "SIGUSR1 stopped a rank"
        assert checkpoint_steps(run) == [usr1_step], "SIGUSR1 must give exactly one checkpoint"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        wait_for(lambda: not leftovers(run), 120, what="every process of the run to exit")
        assert not pid_alive(agent) and not any(pid_alive(p) for p in pids)
    finally:
        finish(proc, run)
    final = last_step(run)
    assert [r["step"] for r in loss_records(run)] == list(range(1, final + 1))
    assert manifest(run) == [(usr1_step, "sigusr1"), (final, "sigterm")]
    step, *_ = load_checkpoint(run / checkpoint_name(final), N_PARAMS)
    assert step == final


def test_a_signal_to_one_rank_only_still_gives_one_checkpoint_and_a_clean_stop_of_all(tmp_path):
    run = tmp_path / "run"
    proc = start2(run, *BIG)
    try:
        wait_for(lambda: last_step(run) >= 5 and len(ranks(run)) == 2, 240, what="2 ranks training")
        rank0 = hello(run)["pid"]
        other = next(p for p in ranks(run) if p != rank0)  # rank 1: it writes no file itself
        psutil.Process(other).send_signal(signal.SIGUSR1)
        wait_for(lambda: checkpoint_steps(run), 60, what="the agreed SIGUSR1 checkpoint")
        usr1_step = checkpoint_steps(run)[0]
        wait_for(lambda: last_step(run) >= usr1_step + 5, 60, what="training to go on")
        assert checkpoint_steps(run) == [usr1_step]
        psutil.Process(other).send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, "the worker stopped cleanly, so the proxy exits 0"
        wait_for(lambda: not leftovers(run), 120, what="every process of the run to exit")
    finally:
        finish(proc, run)
    final = last_step(run)
    assert manifest(run) == [(usr1_step, "sigusr1"), (final, "sigterm")]
    assert load_checkpoint(run / checkpoint_name(final), N_PARAMS)[0] == final


def test_kill_9_of_one_rank_restarts_all_ranks_from_the_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = start2(run, "--max-steps", "100000", "--checkpoint-every", "10",
                  "--sample-every", "100000")
    try:
        wait_for(lambda: last_step(run) >= 13 and 10 in checkpoint_steps(run)
                 and len(ranks(run)) == 2, 240, what="the first cadence checkpoint")
        old = ranks(run)
        victim = next(p for p in old if p != hello(run)["pid"])
        psutil.Process(victim).kill()
        wait_for(lambda: not any(pid_alive(p) for p in old), 60, what="the old ranks to go")
        newest = max(checkpoint_steps(run))
        # the proxy lists the new ranks' pids before rank 0's hello says where it resumed
        wait_for(lambda: len(ranks(run)) == 2 and not set(ranks(run)) & set(old)
                 and "resumed_from" in hello(run), 240, what="a new incarnation of both ranks")
        assert hello(run)["resumed_from"] == newest
        wait_for(lambda: last_step(run) >= newest + 3, 120, what="training to resume")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        wait_for(lambda: not leftovers(run), 120, what="every process of the run to exit")
    finally:
        finish(proc, run)
    log = (tmp_path / "proxy-test.log").read_text()
    assert "restart 1 of" in log
    assert [r["step"] for r in loss_records(run)] == list(range(1, last_step(run) + 1))


def test_two_ranks_and_one_rank_with_the_same_global_batch_end_with_matching_checkpoints(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = [*ARMS, "--max-steps", "20", "--checkpoint-every", "10", "--bandit-warmup", "0",
              "--probe-every", "5"]
    r1 = run_proxy(one, *common, timeout=300)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = run_proxy(two, *common, "--nproc-per-node", "2", timeout=300)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "world size 2" in r2.stderr and "world size 1" in r1.stderr
    for step in (10, 20):
        s1, *arrays1 = load_checkpoint(one / checkpoint_name(step), N_PARAMS)
        s2, *arrays2 = load_checkpoint(two / checkpoint_name(step), N_PARAMS)
        assert s1 == s2 == step
        for name, a, b in zip(("weights", "m", "v"), arrays1, arrays2):
            np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=f"{name} at {step}")
    w10 = load_checkpoint(one / checkpoint_name(10), N_PARAMS)[1]
    w20 = load_checkpoint(one / checkpoint_name(20), N_PARAMS)[1]
    assert np.abs(w20 - w10).max() > 100 * ATOL, "training must move the weights well past the tolerance"
    l1, l2 = loss_records(one), loss_records(two)
    assert [r["arms"] for r in l1] == [r["arms"] for r in l2], "different global batches"
    np.testing.assert_allclose([r["loss"] for r in l2], [r["loss"] for r in l1], rtol=1e-5)
    for a, b in zip(l1, l2):
        assert a["arm_loss"].keys() == b["arm_loss"].keys() == b["arm_unigram_loss"].keys()
        np.testing.assert_allclose(list(b["arm_unigram_loss"].values()),
                                   list(a["arm_unigram_loss"].values()), rtol=1e-12)
        np.testing.assert_allclose(list(b["arm_loss"].values()), list(a["arm_loss"].values()),
                                   rtol=1e-5)


def test_kill_9_of_the_proxy_stops_every_rank_and_the_agent_with_a_checkpoint(tmp_path):
    """Under torchrun a rank's parent is the agent: the ranks watch the proxy's pid instead."""
    run = tmp_path / "run"
    proc = start2(run, *BIG)
    try:
        wait_for(lambda: last_step(run) >= 5 and len(ranks(run)) == 2, 240, what="2 ranks training")
        pids = ranks(run)
        proc.kill()
        proc.wait(timeout=30)
        wait_for(lambda: not any(pid_alive(p) for p in pids), 60, what="the ranks to stop")
        wait_for(lambda: not leftovers(run), 120, what="the agent to exit")
    finally:
        finish(proc, run)
    assert [r for r in manifest(run) if r[1] == "sigterm"], \
        "the ranks must take the proxy's death as SIGTERM: checkpoint, then exit"


def test_two_ranks_with_accumulation_match_one_rank_in_one_pass(tmp_path):
    """Batch 8: one rank in one pass vs 2 ranks x 2 micro-batches of 2 (no_sync on the first):
    the same data, the same mean gradient, within the float tolerance above."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = [*ARMS, "--max-steps", "20", "--checkpoint-every", "20", "--bandit-warmup", "0",
              "--probe-every", "5"]
    r1 = run_proxy(one, *common, timeout=300)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = run_proxy(two, *common, "--nproc-per-node", "2", "--micro-batch-size", "2", timeout=300)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert "2 micro-batch(es) of 2 sequences" in r2.stderr
    _, *arrays1 = load_checkpoint(one / checkpoint_name(20), N_PARAMS)
    _, *arrays2 = load_checkpoint(two / checkpoint_name(20), N_PARAMS)
    for name, a, b in zip(("weights", "m", "v"), arrays1, arrays2):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=ATOL, err_msg=name)
    l1, l2 = loss_records(one), loss_records(two)
    assert [r["step"] for r in l2] == list(range(1, 21)), "one record per update, not per micro-batch"
    assert [r["arms"] for r in l1] == [r["arms"] for r in l2]
    np.testing.assert_allclose([r["loss"] for r in l2], [r["loss"] for r in l1], rtol=1e-5)


def test_leaving_the_process_group_right_after_a_collective_never_deadlocks(tmp_path):
    """worker/distributed.py leave_process_group: leaving a gloo group the instant DDP's
    all-reduce completes does not deadlock (destroying it then would: its destructor joins
    gloo's threads while holding the GIL they need). 20 rounds of DDP backward then teardown,
    in a child with a deadline."""
    child = textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from shared.run.config import PRESETS
        from worker import distributed as wdist
        from worker.model import GPT
        for i in range(20):
            dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store{i}",
                                    rank=0, world_size=1)
            ddp = DDP(GPT(PRESETS["andrea-test"], 64, seed=1), gradient_as_bucket_view=True)
            ddp(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
            wdist.leave_process_group()
            del ddp   # its Reducer held the last reference: the group's destructor runs here
        print("done", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", child, str(tmp_path)], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr[-2000:]


def test_a_rank_that_cannot_go_on_stops_the_run_under_torchrun_without_restarts(tmp_path):
    """torchrun reports a rank's exit 3 as its own 1; a rank that cannot go on (a token file
    changed after creation) says so in a "stopped" event, and the proxy exits 3 at once, with no
    restarts."""
    from shared.data.token_files import read_arm_index
    from shared.run.layout import RunLayout
    run = tmp_path / "run"
    r = run_proxy(run, *ARMS, "--max-steps", "4", "--checkpoint-every", "2", "--sample-every", "2",
                  timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    arm = read_arm_index(RunLayout(run))["typing"]
    path = arm.token_path(run)
    path.write_bytes(path.read_bytes()[:1000])
    r = run_proxy(run, *ARMS, "--max-steps", "8", "--nproc-per-node", "2", timeout=300)
    assert r.returncode == 3, r.stderr[-3000:]
    assert str(path) in r.stderr and "restart 1" not in r.stderr, r.stderr[-3000:]
    assert leftovers(run) == []
