"""A creation stopped in the middle of an arm's tokenization (SIGTERM, SIGINT, kill -9: real
processes, real signals) keeps the tokenized part of the arm, and the same command goes on from
the last recorded piece; the result is byte-identical to an uninterrupted creation
(docs/data.md#crash-safe-creation)."""
import json
import os
import signal
import subprocess

import pytest
from test_arm_sources import prose

from proc_helpers import ROOT, proxy_cmd, run_proxy, wait_for

# many files (one document each) of a few hundred KB: dozens of pieces and batches
ARGS = ["--tokenizer", "bpe", "--bpe-sample-bytes", "200000", "--max-steps", "1",
        "--checkpoint-every", "1"]


def _corpus(d):
    d.mkdir()
    (d / "small.txt").write_text(prose(150_000, seed=1))
    big = d / "big"
    big.mkdir()
    for i in range(24):
        (big / f"{i:02d}.txt").write_text(prose(120_000, seed=10 + i))
    return [f"--arm=small=text:{d / 'small.txt'}", f"--arm=big=text:{big}"]


def _created(run):
    data = run / "data"
    return ({p.name: p.read_bytes() for p in sorted(data.glob("*.u16"))},
            json.loads((data / "arms.json").read_text())["arms"],
            (run / "tokenizer.json").read_bytes())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    arms = _corpus(d / "src")
    r = run_proxy(d / "run", *ARGS, *arms)
    assert r.returncode == 0, r.stderr[-2000:]
    return arms, _created(d / "run")


def _progress(run):
    try:
        return json.loads((run / "data" / "big.u16.progress.json").read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_stop_mid_arm_keeps_its_tokenized_part_and_the_rerun_is_byte_identical(
        tmp_path, reference, sig):
    arms, want = reference
    run = tmp_path / "run"
    # a pause after each recorded batch (test hook) so the signal lands inside the arm
    env = dict(os.environ, PYTHONPATH=str(ROOT), ANDREA_TOKENIZE_DELAY="0.15",
               RAYON_NUM_THREADS="1")
    p = subprocess.Popen(proxy_cmd(run, *ARGS, *arms), cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (_progress(run) or {}).get("pieces", 0) >= 3, timeout=120,
                 what="three recorded pieces of arm big")
        p.send_signal(sig)
        err = p.stderr.read()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    data = run / "data"
    rec = _progress(run)
    assert rec is not None and rec["pieces"] >= 3, err[-2000:]
    if sig != signal.SIGKILL:
        assert p.returncode == 0, err[-2000:]
        assert f"stopped by {sig.name} during tokenization of arm big" in err, err[-2000:]
    assert not (data / "big.u16").exists() and not (run / "run.json").exists()
    tmp = data / "big.u16.tmp"
    assert tmp.stat().st_size >= rec["bytes"] > 0
    kept = tmp.read_bytes()[:rec["bytes"]]
    assert want[0]["big.u16"].startswith(kept)       # the kept part is the arm's own head
    r = run_proxy(run, *ARGS, *arms)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "arm big: resuming its tokenization after" in r.stderr, r.stderr[-3000:]
    assert f"({rec['tokens']:,} tokens kept" in r.stderr
    assert _created(run) == want
    assert not list(data.glob("*.tmp")) and not list(data.glob("*.progress.json"))


@pytest.mark.slow
def test_a_partial_arm_whose_source_changed_is_tokenized_again_from_its_start(tmp_path, reference):
    """The progress record is kept only under the same key (spec, source fingerprint,
    tokenizer, cap): a source file touched since makes the arm start over, still identical."""
    arms, want = reference
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), ANDREA_TOKENIZE_DELAY="0.15",
               RAYON_NUM_THREADS="1")
    p = subprocess.Popen(proxy_cmd(run, *ARGS, *arms), cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (_progress(run) or {}).get("pieces", 0) >= 2, timeout=120,
                 what="two recorded pieces of arm big")
    finally:
        p.kill()
        p.wait()
    src = arms[1].split(":", 1)[1]
    f = max(os.listdir(src))
    st = os.stat(os.path.join(src, f))
    os.utime(os.path.join(src, f), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        r = run_proxy(run, *ARGS, *arms)
    finally:
        os.utime(os.path.join(src, f), ns=(st.st_atime_ns, st.st_mtime_ns))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming its tokenization" not in r.stderr
    assert _created(run)[0] == want[0]
