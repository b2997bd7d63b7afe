"""Run creation over real arm sources with real processes (docs/data.md): kill -9 at
random moments during creation never leaves a partial token file under its final name, and the
same `run` command completes what is missing without redoing complete arms; sixteen arms of
mixed kinds train; an arm of a new kind joins on a restart through the same pipeline."""
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_arm_sources import prose

from proc_helpers import ROOT, loss_records, proxy_cmd, run_proxy
from shared.data.token_files import read_arm_index
from shared.run.config import load_run_config, probe_plan
from shared.run.layout import RunLayout


def _corpus(d):
    d.mkdir()
    for i in range(4):
        (d / f"a{i}.txt").write_text(prose(700_000, seed=i))
    return [f"--arm=a{i}=text:{d / f'a{i}.txt'}" for i in range(4)]


def _token_files(run):
    return {p.name: p.read_bytes() for p in sorted((run / "data").glob("*.u16"))}


@pytest.mark.slow
def test_kill9_at_random_moments_during_creation_then_the_same_command_completes_it(tmp_path):
    arms = _corpus(tmp_path / "src")
    args = ["--tokenizer", "bpe", "--bpe-sample-bytes", "400000", "--max-steps", "1",
            "--checkpoint-every", "1", *arms]
    clean = tmp_path / "clean"
    t0 = time.monotonic()
    r = run_proxy(clean, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    want = _token_files(clean)
    assert len(want) == 4
    created = json.loads((clean / "run.json").read_text())
    span = max(1.0, time.monotonic() - t0 - 1.0)
    rng = random.Random(10)
    stages = set()
    for trial in range(10):
        run = tmp_path / f"t{trial}"
        env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
        p = subprocess.Popen(proxy_cmd(run, *args), cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, span))
        p.kill()
        p.wait()
        if (run / "run.json").exists():
            stages.add("created")
            continue
        seen = _token_files(run) if (run / "data").exists() else {}
        for name, data in seen.items():      # never a partial file under a final name
            assert data == want[name], (trial, name)
        kept = {n: (run / "data" / n).stat() for n in seen
                if (run / "data" / n.replace(".u16", ".done.json")).exists()}
        stages.add(len(kept))
        r = run_proxy(run, *args)
        assert r.returncode == 0, r.stderr[-2000:]
        assert _token_files(run) == want, trial
        for n, st in kept.items():           # complete arms are not redone
            now = (run / "data" / n).stat()
            assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), (trial, n)
            assert f"arm {n[:-4]}: already complete" in r.stderr
        assert not list((run / "data").glob("*.tmp"))
        got = json.loads((run / "run.json").read_text())
        assert got["vocab_size"] == created["vocab_size"] and got["arms"] == created["arms"]
        assert len(loss_records(run)) == 1
    assert len(stages) >= 2, stages          # the kills landed at different stages


def _sixteen(d):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    d.mkdir()
    arms, rng = [], np.random.default_rng(1)
    for i in range(3):
        (d / f"t{i}").mkdir()
        for j in range(3):
            (d / f"t{i}" / f"{j}.txt").write_text(prose(15_000, seed=10 * i + j))
        arms.append(f"text{i}=text:{d / f't{i}'}")
    for i in range(3):
        lines = "\n".join(json.dumps({"text": prose(500, seed=100 * i + k)}) for k in range(80))
        (d / f"g{i}.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
        (d / f"z{i}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        arms += [f"gz{i}=jsonl:{d / f'g{i}.jsonl.gz'}", f"zst{i}=jsonl:{d / f'z{i}.jsonl.zst'}"]
    for i in range(3):
        pq.write_table(pa.table({"text": [prose(500, seed=200 * i + k) for k in range(80)]}),
                       d / f"p{i}.parquet", row_group_size=20)
        arms.append(f"pq{i}=parquet:{d / f'p{i}.parquet'}")
    for i in range(2):
        rng.integers(0, 256, 40_000).astype(np.uint16).tofile(d / f"k{i}.u16")
        rng.integers(0, 256, 40_000).astype(np.uint32).tofile(d / f"w{i}.u32")
        arms += [f"u16-{i}=tokens:{d / f'k{i}.u16'}", f"u32-{i}=tokens:{d / f'w{i}.u32'}:u32"]
    return arms


@pytest.mark.slow
def test_temporaries_a_killed_creation_left_are_removed_by_the_next_attempt_whatever_their_age(
        tmp_path):
    """A creation killed between an atomic write and its rename leaves `.NAME.XXXXXXXX.tmp`
    (seen in CI: a progress record's temporary, seconds old, survived the next attempt, which
    removed only those older than 60 s). Creation holds the run lock and nothing else writes
    into a run without run.json, so the next attempt removes them all, young ones too."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(prose(60_000))
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    left = [run / "data" / ".a.u16.progress.json.xivkyglm.tmp", run / ".tokenizer.json.k2j4h5g6.tmp"]
    for p in left:
        p.write_text("{")
    keep = run / "data" / "notes.tmp"   # not an atomic write's temporary: kept
    keep.write_text("x")
    r = run_proxy(run, "--tokenizer", "bytes", "--max-steps", "1", "--checkpoint-every", "1",
                  f"--arm=a=text:{src / 'a.txt'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not any(p.exists() for p in left) and keep.exists()
    assert "removed a temporary of an interrupted creation" in r.stderr


@pytest.mark.slow
def test_sixteen_arms_of_mixed_kinds_train_fifty_steps(tmp_path):
    arms = _sixteen(tmp_path / "src")
    assert len(arms) == 16
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "50", "--checkpoint-every", "50", "--probe-every", "10",
                  "--reward", "heldout_progress",
                  "--batch-size", "16", *[f"--arm={a}" for a in arms])
    assert r.returncode == 0, r.stderr[-3000:]
    idx = read_arm_index(RunLayout(run))
    assert len(idx) == 16 and {a.dtype for a in idx.values()} == {"uint16", "uint32"}
    assert all(a.documents == 80 for n, a in idx.items() if n[:2] in ("gz", "zs", "pq"))
    recs = loss_records(run)
    every = probe_plan(load_run_config(RunLayout(run).run_json)).every  # 30: 16 arms, 1.5 % budget
    assert len(recs) == 50 and set(recs[every - 1]["probe"]) == set(idx)
    assert (run / "step_000050.bin").exists()


@pytest.mark.slow
def test_an_arm_of_a_new_kind_joins_on_a_restart_through_the_same_pipeline(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(prose(80_000))
    pq.write_table(pa.table({"body": [prose(400, seed=k) for k in range(200)]}), src / "p.parquet",
                   row_group_size=50)
    run = tmp_path / "run"
    common = ["--checkpoint-every", "10", "--probe-every", "5", "--bandit-warmup", "5"]
    assert run_proxy(run, "--max-steps", "10", *common, f"--arm=a=text:{src / 'a.txt'}").returncode == 0
    r = run_proxy(run, "--max-steps", "20", *common, f"--arm=a=text:{src / 'a.txt'}",
                  f"--arm=p=parquet:{src / 'p.parquet'}:body")
    assert r.returncode == 0, r.stderr[-3000:]
    p = read_arm_index(RunLayout(run))["p"]
    assert p.documents == 200 and len(p.heldout_ranges()) > 1
    assert "arm p (parquet): 200 documents" in r.stderr
    assert any(x["arms"].get("p", 0) for x in loss_records(run)[10:])


@pytest.mark.slow
def test_sigterm_during_tokenization_stops_within_a_piece_and_the_same_command_goes_on(tmp_path):
    """docs/signals.md#during-creation: SIGTERM while a large arm is tokenized stops the proxy
    within a piece of the source (not after the whole corpus), exit 0, nothing written under a
    final name for the interrupted arm (its tokenized part is kept as a `.tmp` with a progress
    record), the complete arm kept; the same command then finishes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "small.txt").write_text(prose(200_000, seed=1))
    (src / "big").mkdir()
    block = prose(2_000_000, seed=2)
    for i in range(8):   # 16 MB: seconds of BPE encoding on any machine
        (src / "big" / f"{i}.txt").write_text(block)
    args = ["--tokenizer", "bpe", "--bpe-sample-bytes", "300000", "--max-steps", "1",
            "--checkpoint-every", "1", f"--arm=small=text:{src / 'small.txt'}",
            f"--arm=big=text:{src / 'big'}"]
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), ANDREA_PROGRESS_SECONDS="0.05")
    p = subprocess.Popen(proxy_cmd(run, *args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    lines = []
    for line in p.stderr:        # the first progress line of the big arm: it is being encoded
        lines.append(line)
        if "arm big:" in line and "MB of" in line:
            break
    else:
        raise AssertionError("".join(lines[-30:]))
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rest = p.stderr.read()
    p.wait(timeout=60)
    took = time.monotonic() - sent
    assert p.returncode == 0, rest[-2000:]
    assert "stopped by SIGTERM during tokenization of arm big" in rest, rest[-2000:]
    assert "arm big (text)" not in rest            # it did not finish the arm first
    data = run / "data"
    assert not (run / "run.json").exists()
    assert not (data / "big.u16").exists() and list(data.glob("*.tmp")) == [data / "big.u16.tmp"]
    assert (data / "big.u16.progress.json").exists()
    assert (data / "small.done.json").exists() and not (data / "big.done.json").exists()
    small = (data / "small.u16").stat()
    r = run_proxy(run, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "arm small: already complete" in r.stderr
    now = (data / "small.u16").stat()
    assert (now.st_ino, now.st_mtime_ns) == (small.st_ino, small.st_mtime_ns)
    assert (data / "big.u16").exists() and len(loss_records(run)) == 1
    assert took < 10, took   # within a piece: well under a second when the machine is quiet


@pytest.mark.slow
def test_sigterm_during_bpe_training_stops_when_it_returns_and_keeps_the_tokenizer(tmp_path):
    """docs/signals.md#during-creation: BPE training is one library call; a stop during it acts
    when it returns, names it, and the next attempt keeps the saved tokenizer."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(prose(3_000_000, seed=3))
    args = ["--tokenizer", "bpe", "--bpe-sample-bytes", "3000000", "--max-steps", "1",
            f"--arm=a=text:{src / 'a.txt'}"]
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(proxy_cmd(run, *args), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    lines = []
    for line in p.stderr:        # the sample is drawn: training starts now
        lines.append(line)
        if "BPE sample:" in line:
            break
    else:
        raise AssertionError("".join(lines[-30:]))
    p.send_signal(signal.SIGTERM)
    rest = p.stderr.read()
    p.wait(timeout=120)
    assert p.returncode == 0, rest[-2000:]
    assert "stopped by SIGTERM during the tokenizer's creation" in rest, rest[-2000:]
    assert (run / "tokenizer.json").exists() and not list((run / "data").glob("*.u16*"))
    # status names the unfinished creation and its fix, not "not a run directory"
    st = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert st.returncode == 2 and "creation of this run is unfinished" in st.stderr, st.stderr
    r = run_proxy(run, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokenizer: kept" in r.stderr and len(loss_records(run)) == 1
