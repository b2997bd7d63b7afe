"""GPT keeps every parameter a view of GPT.flat through .to(), .float(), .cuda(), .half() and DDP
wrapping, or refuses with a clear error (worker/model.py `GPT._apply`): otherwise a nanoGPT-style
`model.to(dtype)` would re-allocate the parameters and checkpoints would save stale weights.
Fast: andrea-test (tens of thousands of parameters), in-process, CPU."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shared.run.config import PRESETS
from worker import distributed as wdist
from worker.model import GPT

VOCAB = 256
ROOT = Path(__file__).resolve().parent.parent


def gpt() -> GPT:
    return GPT(PRESETS["andrea-test"], VOCAB, seed=1)


def assert_views_of_flat(model: GPT) -> None:
    """Every parameter is the flat slice at its offset, and a write into flat shows through."""
    model.check_flat()
    with torch.no_grad():
        model.flat.add_(1.0)
    for p, (name, _, off) in zip(model.parameters(), model.table):
        got = p.detach().reshape(-1).to("cpu")
        want = model.flat[off:off + p.numel()].to("cpu")
        assert torch.equal(got, want), name
    with torch.no_grad():
        model.flat.sub_(1.0)


def test_a_new_model_holds_its_parameters_in_flat():
    assert_views_of_flat(gpt())



def test_the_gpt2_initialisation_is_the_documented_rule_drawn_in_checkpoint_order():
    # worker/model.py: normal(0, 0.02), c_proj weights normal(0, 0.02 / sqrt(2 x layers)),
    # LayerNorm weights 1, every bias 0, one private generator seeded with `seed`
    shape = PRESETS["andrea-test"]
    model = GPT(shape, VOCAB, seed=7)
    g = torch.Generator().manual_seed(7)
    for name, size, off in model.table:
        want = torch.empty(size)
        if name.endswith("c_proj.weight"):
            want.normal_(0.0, 0.02 / math.sqrt(2 * shape.n_layer), generator=g)
        elif len(size) == 2:
            want.normal_(0.0, 0.02, generator=g)
        else:
            want.fill_(1.0 if "ln_" in name and name.endswith("weight") else 0.0)
        assert torch.equal(model.flat[off:off + want.numel()], want.reshape(-1)), name


def test_a_model_built_for_a_resume_skips_the_initialisation_and_keeps_the_views():
    model = GPT(PRESETS["andrea-test"], VOCAB, init_weights=False)
    assert all(p.device.type == "cpu" and p.requires_grad for p in model.parameters())
    assert_views_of_flat(model)
    with torch.no_grad():
        model.flat.copy_(gpt().flat)
    x = torch.randint(0, VOCAB, (2, 8))
    assert torch.equal(model(x), gpt()(x))


def test_building_a_gpt_does_not_import_torch_dynamo():
    # GPT is built on the meta device; nn.Embedding's normal_ there would import torch._dynamo
    # (about 1.5 s of every worker's start-up). A fresh interpreter: this one may have it.
    code = ("import sys, torch; from shared.run.config import PRESETS; from worker.model import GPT; "
            "GPT(PRESETS['andrea-test'], 256); GPT(PRESETS['andrea-test'], 256, init_weights=False); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

@pytest.mark.parametrize("convert", [
    lambda m: m.float(), lambda m: m.to(torch.float32), lambda m: m.to("cpu"),
    lambda m: m.cpu(), lambda m: m.to(torch.device("cpu"), torch.float32), lambda m: m.to(torch.device("cpu")),
], ids=["float", "to-float32", "to-cpu", "cpu", "to-cpu-float32", "to-device"])
def test_same_device_float32_conversions_keep_flat_and_its_values(convert):
    model = gpt()
    flat, before = model.flat, model.flat.clone()
    assert convert(model) is model
    assert model.flat is flat and torch.equal(model.flat, before)
    assert_views_of_flat(model)


@pytest.mark.parametrize("convert", [
    lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.double(), lambda m: m.to(torch.float16),
    lambda m: m.to("cpu", torch.bfloat16),
], ids=["half", "bfloat16", "double", "to-float16", "to-cpu-bfloat16"])
def test_a_dtype_change_is_refused_with_a_clear_error_and_nothing_changes(convert):
    model = gpt()
    flat, before = model.flat, model.flat.clone()
    with pytest.raises(TypeError, match=r"views of one float32 buffer.*--precision bf16"):
        convert(model)
    assert model.flat is flat and torch.equal(model.flat, before)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_views_of_flat(model)


def test_a_conversion_to_a_new_tensor_re_points_every_parameter_and_gradient():
    # `.to_empty(device=...)` returns a NEW tensor for flat even on the same device: the path a
    # real device move (.cuda(), .to("cuda")) takes, on any machine. (The meta device cannot
    # stand in: torch refuses `param.data = <meta tensor>` for a CPU parameter.)
    model = gpt()
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    old = model.flat
    model.to_empty(device="cpu")
    assert model.flat is not old
    with torch.no_grad():  # to_empty's memory is uninitialised: a NaN there never equals itself
        model.flat.zero_()
    assert_views_of_flat(model)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)


def test_share_memory_keeps_the_views():
    model = gpt()
    model.share_memory()
    assert model.flat.is_shared()
    assert_views_of_flat(model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_fails_and_leaves_the_model_intact():
    model = gpt()
    flat, before = model.flat, model.flat.clone()
    with pytest.raises((AssertionError, RuntimeError)):
        model.cuda()
    assert model.flat is flat and torch.equal(model.flat, before)
    assert_views_of_flat(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_moves_flat_and_keeps_the_views():
    model = gpt()
    before = model.flat.clone()
    model.cuda()
    assert model.flat.is_cuda and torch.equal(model.flat.cpu(), before)
    assert_views_of_flat(model)


def test_check_flat_names_a_parameter_that_was_re_allocated():
    model = gpt()
    p = model.transformer.wpe.weight
    p.data = p.data.clone()
    with pytest.raises(RuntimeError, match="transformer.wpe.weight is no longer a view of GPT.flat"):
        model.check_flat()


@pytest.mark.slow  # a gloo process group takes seconds to set up here
def test_ddp_wrapping_keeps_the_parameters_in_flat(tmp_path):
    # One gloo rank in-process: DDP's constructor broadcasts the parameters and builds its
    # buckets; neither may re-allocate them.
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        model = gpt()
        ddp = DDP(model, gradient_as_bucket_view=True)
        assert_views_of_flat(model)
        ddp(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
        assert_views_of_flat(model)
        assert all(p.grad is not None for p in model.parameters())
        del ddp  # its Reducer holds the process group: freed here, not at an unknown moment
    finally:
        wdist.leave_process_group()


def test_flops_per_token_counts_matmuls_not_embedding_lookups():
    """MFU's FLOPs per token (PaLM appendix B): 6 x the weights of every matmul (the untied head
    included) + attention; the token and position embeddings are lookups, not matmuls. Checked
    against the model's own nn.Linear weights (biases and layer norms add well under 1 %)."""
    from shared.run.config import PRESETS
    for preset in ("andrea-tiny", "andrea-12m"):
        model = GPT(PRESETS[preset], 2305)
        s = model.shape
        matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        attention = 12 * s.n_layer * s.n_embd * s.block_size
        got = model.flops_per_token() - attention
        assert 6 * matmul <= got <= 1.01 * 6 * matmul, preset
