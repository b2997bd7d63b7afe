"""`--precision` on CPU: bf16 autocast with fp32 master weights, m and v, the file
layout unchanged, exact resume, and a negative control. The CUDA path's arithmetic (bf16
autocast + fused AdamW) is run here on CPU: torch supports both there, and the worker selects
the fused kernel (the default on CPU too; ANDREA_TEST_FUSED_ADAMW=1 pins it, worker/precision.py).

Real proxy and worker processes (proc_helpers), andrea-test on the bytes tokenizer, 18 steps:
a cadence of 6, a bandit that moves every 4 steps (so the bf16 held-out probes feed what is
resumed), a warm-up of 8, no sample audits (fp32 text generation: not what is tested here, and
the slowest part of a tiny run on a loaded CPU). Runs are short because bf16 is emulated on
CPUs without avx512_bf16/AMX (several times slower than fp32)."""
import json
import signal

import numpy as np
import pytest
import torch

from proc_helpers import (
    assert_same_run,
    checkpoint_steps,
    clone,
    create_template,
    kill_run,
    loss_records,
    manifest,
    output,
    reports,
    run,
    start,
    stopped_step,
    wait_for,
    wait_report,
)
from shared.checkpoint.file_format import checkpoint_name
from shared.checkpoint.manifest import read_manifest
from shared.checkpoint.read import load_checkpoint, read_header

FINAL = 30  # probes (2 % budget) fall every 8 steps here: enough for the bandit to move
ARGS = ["--max-steps", str(FINAL), "--checkpoint-every", "6", "--probe-every", "4",
        "--sample-every", "1000", "--warmup-steps", "8", "--bandit-warmup", "0",
        "--reward", "heldout_progress"]   # the probe's policy: the bf16 probes feed the mixture
N_PARAMS, FILE_BYTES = 42_880, 514_568   # andrea-test, 256 tokens (tests/test_presets.py)
CUDA_PATH = {"ANDREA_TEST_FUSED_ADAMW": "1"}  # the fused AdamW kernel, on CPU


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return create_template(tmp_path_factory.mktemp("tpl") / "run", *ARGS)


def _full_run(template, dest, precision: str | None, env=CUDA_PATH):
    d = clone(template, dest)
    args = [*ARGS, "--precision", precision] if precision else ARGS
    r = run(d, *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return d, r


@pytest.fixture(scope="module")
def bf16_ref(template, tmp_path_factory):
    """The uninterrupted bf16 run with the fused AdamW kernel (the CUDA path's arithmetic)."""
    d, r = _full_run(template, tmp_path_factory.mktemp("bf16") / "run", "bf16")
    assert "precision bf16 (bf16 autocast" in r.stderr and "AdamW fused" in r.stderr, \
        "the worker names the precision and AdamW kernel in use at start-up"
    return d


def _low_half_nonzero(a: np.ndarray) -> float:
    """Fraction of float32 values whose low 16 bits are not all zero: 0 for a buffer that holds
    only bf16-representable numbers (bf16 = the high half of a float32)."""
    return float(((a.view(np.uint32) & 0xFFFF) != 0).mean())


# ------------------------------------------------------------------ in-process: the decision
def test_the_precision_decision_on_cpu(monkeypatch):
    from worker.precision import autocast, resolve_precision, use_fused_adamw
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu) == "fp32", "auto keeps today's CPU behaviour"
    assert resolve_precision("bf16", cpu) == "bf16"
    assert resolve_precision("fp32", cpu) == "fp32"
    with pytest.raises(ValueError, match="--precision"):
        resolve_precision("fp16", cpu)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    with autocast(cpu, "bf16"):
        assert lin(x).dtype == torch.bfloat16
    with autocast(cpu, "fp32"):
        assert lin(x).dtype == torch.float32
    assert lin.weight.dtype == torch.float32
    monkeypatch.delenv("ANDREA_TEST_FUSED_ADAMW", raising=False)
    assert use_fused_adamw(cpu) is True, "the fused kernel on CPU too (5x faster than foreach)"
    assert use_fused_adamw(torch.device("meta")) is False
    monkeypatch.setenv("ANDREA_TEST_FUSED_ADAMW", "0")
    assert use_fused_adamw(cpu) is False


def test_bf16_autocast_keeps_weights_and_gradients_fp32():
    from shared.run.config import PRESETS
    from worker.model import GPT
    from worker.precision import autocast
    model = GPT(PRESETS["andrea-test"], 256, 0.0, seed=1)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with autocast(torch.device("cpu"), "bf16"):
        logits = model(idx)
    assert logits.dtype == torch.bfloat16, "the matmuls really run in bf16"
    logits.float().sum().backward()
    assert model.flat.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())
    assert all(p.untyped_storage().data_ptr() == model.flat.untyped_storage().data_ptr()
               for p in model.parameters()), "parameters are still views of the flat buffer"


def test_proxy_run_passes_precision_to_the_options():
    import argparse

    from proxy.commands.run_args import add_run_args, proxy_options
    from shared.run.config import RunConfig

    ap = argparse.ArgumentParser()
    add_run_args(ap)
    for argv, want in (([], "auto"), (["--precision", "bf16"], "bf16"),
                       (["--precision", "fp32"], "fp32")):
        o = proxy_options(ap.parse_args(["--run-dir", "x", *argv]), RunConfig())
        assert o.precision == want
    with pytest.raises(SystemExit):
        ap.parse_args(["--precision", "fp16"])


# ------------------------------------------------------------------ real processes
@pytest.mark.slow
def test_bf16_run_writes_the_fp32_checkpoint_layout_and_its_loss_falls(bf16_ref):
    steps = checkpoint_steps(bf16_ref)
    assert FINAL in steps and len(steps) >= 3
    entries = read_manifest(bf16_ref)
    for s in steps:
        path = bf16_ref / checkpoint_name(s)
        assert path.stat().st_size == FILE_BYTES == 8 + 12 * N_PARAMS
        assert read_header(path) == (s, N_PARAMS)
        step, w, m, v = load_checkpoint(path, N_PARAMS, entries[s].checksum)
        assert step == s and w.dtype == m.dtype == v.dtype == np.float32
        assert np.isfinite(w).all() and np.isfinite(m).all() and np.isfinite(v).all()
        # master weights and moments are real fp32 values, not bf16 numbers stored as fp32
        # (zeros excluded: byte values absent from the data leave embedding rows' m, v at 0)
        for name, a in (("weights", w), ("m", m), ("v", v)):
            assert _low_half_nonzero(a[a != 0]) > 0.9, f"step {s}: {name} look bf16-rounded"
    loss = [r["loss"] for r in loss_records(bf16_ref)]
    assert len(loss) == FINAL and all(np.isfinite(loss))
    assert np.mean(loss[-4:]) < loss[0] - 0.7, f"loss does not fall: {loss}"
    hello = next(r for r in reports(bf16_ref) if r.get("type") == "hello")
    assert hello["precision"] == "bf16" and hello["fused_adamw"] is True


@pytest.mark.slow
def test_bf16_sigterm_after_a_checkpoint_then_resume_is_byte_identical(template, bf16_ref, tmp_path):
    assert len({json.dumps(x["p"], sort_keys=True) for x in loss_records(bf16_ref)}) > 1, \
        "the bandit never moved: the bf16 probes would not be part of what resumes"
    b = clone(template, tmp_path / "run")
    # update 9 pauses (after the step-6 cadence checkpoint, past the warm-up, inside a bandit
    # period) until the SIGTERM arrives, so the stop lands there however fast the machine's bf16
    # is and however slowly a loaded machine writes the step-6 checkpoint or delivers the signal
    proc = start(b, *ARGS, "--precision", "bf16", env={**CUDA_PATH, "ANDREA_TEST_PAUSE_AT_STEP": "9:600"})
    try:
        wait_report(b, lambda r: r.get("event") == "test-pause", 120, "the pause in update 9")
        wait_for(lambda: 6 in checkpoint_steps(b), 120, what="the step-6 checkpoint")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_run(b)
    assert stopped_step(b) == 9
    assert (9, "sigterm", False) in manifest(b) and checkpoint_name(9) in {p.name for p in b.iterdir()}
    r = run(b, *ARGS, "--precision", "bf16", env=CUDA_PATH)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {checkpoint_name(9)}" in r.stderr
    assert "precision bf16" in output(b) and "precision bf16" in r.stderr
    assert_same_run(bf16_ref, b, FINAL)


@pytest.mark.slow
def test_precision_changes_the_arithmetic_and_auto_is_fp32_on_cpu(template, bf16_ref, tmp_path):
    """Negative control: fp32 differs from bf16 (same data, same AdamW kernel); and `auto` on
    CPU is exactly fp32 (today's behaviour)."""
    fp32, auto = clone(template, tmp_path / "fp32"), clone(template, tmp_path / "auto")
    procs = [start(fp32, *ARGS, "--precision", "fp32", env=CUDA_PATH),   # side by side: the
             start(auto, *ARGS, env=CUDA_PATH)]                          # start-ups overlap
    try:
        assert [p.wait(timeout=180) for p in procs] == [0, 0], output(fp32)[-2000:] + output(auto)[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for d in (fp32, auto):
        assert "precision fp32 (no autocast)" in output(d)
    final = checkpoint_name(FINAL)
    assert (fp32 / final).read_bytes() == (auto / final).read_bytes()
    _, w32, m32, v32 = load_checkpoint(fp32 / final, N_PARAMS)
    _, w16, m16, v16 = load_checkpoint(bf16_ref / final, N_PARAMS)
    assert not np.array_equal(w32, w16) and not np.array_equal(m32, m16)
    l32 = [r["loss"] for r in loss_records(fp32)]
    l16 = [r["loss"] for r in loss_records(bf16_ref)]
    assert l32 != l16
    # ... by rounding, not by a different training: the first losses agree to bf16 accuracy
    assert abs(l32[0] - l16[0]) < 0.05 * l32[0]
