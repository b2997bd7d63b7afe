"""FlatAdamW's fused path, checked on CPU: torch's fused AdamW kernel runs on CPU too,
so the optimizer the CUDA worker uses is exercised here with the flat m/v buffers, set_step and
an exact in-process resume. In-process, tiny model (andrea-test, bytes vocabulary), ~20 steps.

Tolerance of fused vs foreach (the two kernels round differently, e.g. the bias correction is
computed in float32 inside the fused kernel and in float64 in Python for foreach): after 20 steps
at lr 1e-3, |w_fused - w_foreach| <= 2e-5 (2% of one update's size), |m diff| <= 1e-6 and
|v diff| <= 1e-9 (measured: 3.8e-6, 5.6e-9, 1.5e-11). The negative controls show the tolerance
discriminates: an AdamW step off by one (wrong bias correction) or one update fewer are >= 10x
beyond it in every buffer."""
import pytest
import torch
import torch.nn.functional as F

from shared.run.config import PRESETS, RunConfig
from worker.model import GPT
from worker.optim import FlatAdamW

CFG = RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], vocab_size=256)
LR, STEPS = 1e-3, 20
TOL = {"w": 2e-5, "m": 1e-6, "v": 1e-9}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster, and far steadier on a loaded CPU (both
    kernels compared here run under the same setting)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + k)  # batch k is a function of k alone
    return torch.randint(0, 256, (4, CFG.model.block_size + 1), generator=g)


def _update(model: GPT, opt: FlatAdamW, k: int) -> None:
    x = _batch(k)
    loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step(LR)


def _train(fused: bool, first: int = 1, last: int = STEPS, start=None, step_offset: int = 0):
    """Updates first..last; `start` = (w, m, v) to resume from (header step first - 1).
    Checks views and the AdamW step after every update. Returns (model, opt)."""
    model = GPT(CFG.model, 256, 0.0, seed=1)
    opt = FlatAdamW(model, CFG, fused=fused)
    if start is not None:
        with torch.no_grad():
            for dst, src in zip((model.flat, opt.m, opt.v), start):
                dst.copy_(src)
    opt.set_step(first - 1 + step_offset)
    for k in range(first, last + 1):
        _update(model, opt, k)
        opt.check_views()
        assert opt.steps() == {float(k + step_offset)}, "every parameter's AdamW step == k"
    return model, opt


def _bufs(model, opt) -> dict[str, torch.Tensor]:
    return {"w": model.flat.clone(), "m": opt.m.clone(), "v": opt.v.clone()}


def _maxdiff(a: dict, b: dict) -> dict[str, float]:
    return {k: float((a[k] - b[k]).abs().max()) for k in a}


def test_fused_adamw_runs_on_cpu_with_its_state_in_the_flat_buffers():
    model, opt = _train(fused=True, last=3)
    assert opt.fused and all(g["fused"] for g in opt.opt.param_groups), \
        "the fused kernel, not a silent foreach fallback"
    assert opt.step_device == model.flat.device
    for p in model.parameters():  # the state torch.optim reads is the state FlatAdamW bound
        st = opt.opt.state[p]
        assert st["step"].device == model.flat.device and st["step"].dtype == torch.float32
    assert opt.m.abs().sum() > 0 and opt.v.abs().sum() > 0, "the updates landed in the flat m, v"
    # and those buffers are the ones a checkpoint copies: writing m through the flat buffer is
    # seen by AdamW's exp_avg of the first parameter
    first = next(iter(model.parameters()))
    opt.m[0] = 123.0
    assert float(opt.opt.state[first]["exp_avg"].reshape(-1)[0]) == 123.0


def test_fused_matches_foreach_within_tolerance_over_20_steps_and_the_controls_exceed_it():
    fused = _bufs(*_train(fused=True))
    foreach = _bufs(*_train(fused=False))
    d = _maxdiff(fused, foreach)
    assert all(d[k] <= TOL[k] for k in TOL), f"fused vs foreach {d} beyond {TOL}"
    assert any(d[k] > 0 for k in d), "the two kernels are expected to round differently"
    # negative controls: the tolerance would catch a step off by one or a lost update
    off_by_one = _maxdiff(fused, _bufs(*_train(fused=True, step_offset=1)))
    one_fewer = _maxdiff(fused, _bufs(*_train(fused=True, last=STEPS - 1)))
    for name, c in (("AdamW step off by one", off_by_one), ("one update fewer", one_fewer)):
        assert all(c[k] >= 10 * TOL[k] for k in TOL), f"{name}: {c} not clearly beyond {TOL}"


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_set_step_resume_is_bit_exact(fused):
    """Updates 1..10, copy w/m/v out (a checkpoint), new model + optimizer, set_step(10),
    updates 11..20: bit-identical to 20 uninterrupted updates. On the fused path this is what
    keeps the device-side step tensors in sync with the checkpoint header."""
    ref = _bufs(*_train(fused))
    half = _bufs(*_train(fused, last=10))
    resumed = _bufs(*_train(fused, first=11, start=(half["w"], half["m"], half["v"])))
    for k in ref:
        assert torch.equal(ref[k], resumed[k]), f"{k} differs after the resume"


def test_check_views_catches_replaced_state():
    model, opt = _train(fused=True, last=1)
    p = next(iter(model.parameters()))
    st = opt.opt.state[p]
    for key, bad in (("exp_avg", st["exp_avg"].clone()), ("exp_avg_sq", st["exp_avg_sq"].clone()),
                     ("step", st["step"].double())):
        good = st[key]
        st[key] = bad
        with pytest.raises(RuntimeError):
            opt.check_views()
        st[key] = good
    opt.check_views()
    # a view of the right buffer at the wrong offset is caught too
    second = list(model.parameters())[1]
    n = second.numel()
    good = opt.opt.state[second]["exp_avg"]
    opt.opt.state[second]["exp_avg"] = opt.m[:n].view_as(second)
    with pytest.raises(RuntimeError, match="exp_avg"):
        opt.check_views()
    opt.opt.state[second]["exp_avg"] = good


def test_fused_path_is_bit_identical_to_torch_optim_adamw_fused():
    """FlatAdamW's own call of the fused kernel gives exactly the bits of
    torch.optim.AdamW(fused=True) with the same groups (decay on matrices only), over 20
    updates, including an update where one parameter has no gradient."""
    model, opt = _train(fused=True)
    ref = GPT(CFG.model, 256, 0.0, seed=1)
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    rest = [p for p in ref.parameters() if p.dim() < 2]
    torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": CFG.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=LR,
                                  betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, fused=True)
    for k in range(1, STEPS + 1):
        x = _batch(k)
        loss = F.cross_entropy(ref(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        torch_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
        st, rst = opt.opt.state[p], torch_opt.state[q]
        assert torch.equal(st["exp_avg"], rst["exp_avg"])
        assert torch.equal(st["exp_avg_sq"], rst["exp_avg_sq"])
        assert float(st["step"]) == float(rst["step"]) == STEPS
    # a parameter without a gradient is left alone, its step included
    first = next(iter(model.parameters()))
    before = first.detach().clone()
    x = _batch(99)
    loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    first.grad = None
    opt.step(LR)
    assert torch.equal(first, before) and float(opt.opt.state[first]["step"]) == STEPS


def test_building_and_stepping_the_fused_optimizer_does_not_import_dynamo():
    """torch.optim's methods import torch._dynamo on first use (seconds of every worker start);
    the fused FlatAdamW path never does, in a fresh process."""
    import subprocess
    import sys
    code = ("import sys, torch, torch.nn.functional as F\n"
            "from shared.run.config import PRESETS, RunConfig\n"
            "from worker.model import GPT\nfrom worker.optim import FlatAdamW\n"
            "cfg = RunConfig(preset='andrea-test', model=PRESETS['andrea-test'], vocab_size=256)\n"
            "m = GPT(cfg.model, 256, 0.0, seed=1)\nopt = FlatAdamW(m, cfg, fused=True)\n"
            "x = torch.randint(0, 256, (2, cfg.model.block_size + 1))\n"
            "F.cross_entropy(m(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1)).backward()\n"
            "torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)\n"
            "opt.step(1e-3)\nopt.zero_grad()\nopt.set_step(5)\nopt.check_views()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip() == "False"
