"""The step loop reads the device's values once per update and never before AdamW
(docs/architecture.md#the-step-loop): counted in a real worker under the proxy with torch's
function and dispatch modes (ANDREA_TEST_COUNT_HOST_READS, worker/fault_injection.py), and the
device-side skip of a non-finite update checked against the kernel."""
import pytest
import torch

from proc_helpers import clone, create_template, loss_records, reports, run


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return create_template(tmp_path_factory.mktemp("loop") / "t", "--max-steps", "40",
                           "--checkpoint-every", "1000", "--probe-every", "1000",
                           "--sample-every", "1000")


@pytest.mark.slow
def test_one_batched_host_read_per_update_in_the_steady_state(template, tmp_path):
    """Between two updates the worker reads tensor values on the host once: the previous
    update's statistics vector (loss sums, gradient norm, skip flag). Every `item()`,
    `float(t)`, `.numpy()`, `.tolist()` or copy to the host counts, wherever it happens."""
    d = clone(template, tmp_path / "run")
    r = run(d, env={"ANDREA_TEST_COUNT_HOST_READS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = {e["step"]: e["reads"] for e in reports(d) if e.get("event") == "test-host-reads"}
    assert sorted(counts) == list(range(1, 41))
    steady = {k: sum(c.values()) for k, c in counts.items() if 2 < k < 40}
    assert all(n <= 1 for n in steady.values()), {k: counts[k] for k, n in steady.items() if n > 1}
    assert sum(steady.values()) >= len(steady) - 1, "the reports' values are read somewhere"
    assert [x["step"] for x in loss_records(d)] == list(range(1, 41))


def test_a_non_finite_flag_leaves_weights_and_moments_alone_and_advances_the_step():
    """FlatAdamW.step with found_inf set is skip_step on the device: the fused kernel leaves
    the parameters, m and v as they were and the AdamW step moves on by one; with it clear,
    the update is the one without a flag, bit for bit."""
    from shared.run.config import PRESETS, RunConfig
    from worker.model import GPT
    from worker.optim import FlatAdamW

    cfg = RunConfig(model=PRESETS["andrea-test"], vocab_size=64)
    outs = []
    for flag in (None, 0.0, 1.0):
        model = GPT(cfg.model, 64, seed=3)
        opt = FlatAdamW(model, cfg, fused=True)
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        model(x).float().logsumexp(-1).mean().backward()
        before = (model.flat.clone(), opt.m.clone(), opt.v.clone())
        opt.step(1e-3, None if flag is None else torch.tensor(flag))
        outs.append((before, (model.flat.clone(), opt.m.clone(), opt.v.clone()), opt.steps()))
    (_, plain, s0), (_, clear, s1), (before, flagged, s2) = outs
    assert all(torch.equal(a, b) for a, b in zip(plain, clear)) and s0 == s1 == {1.0}
    assert all(torch.equal(a, b) for a, b in zip(before, flagged)) and s2 == {1.0}
