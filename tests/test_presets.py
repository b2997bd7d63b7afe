"""The published ANDREA shapes, exactly (docs/checkpoint-format.md,
docs/architecture.md#the-worker): parameter counts and checkpoint sizes per preset and
vocabulary, and the parameter order table checked against the bytes of a checkpoint the
worker's own writer put on disk."""
import math

import numpy as np
import pytest
import torch

from shared.checkpoint.file_format import checkpoint_name
from shared.checkpoint.read import read_header
from shared.run.config import (
    DEFAULT_BPE_VOCAB,
    PRESETS,
    RunConfig,
    count_parameters,
    parameter_table,
)

# (preset, vocabulary) -> (parameters, checkpoint bytes). 2305 is the default BPE vocabulary,
# 256 the `bytes` tokenizer. The seed's "154 MB, 147 MB rounded" is andrea-12m at 2305.
EXACT = {
    ("andrea-test", 256): (42_880, 514_568),
    ("andrea-tiny", 2305): (1_201_536, 14_418_440),
    ("andrea-tiny", 256): (676_992, 8_123_912),
    ("andrea-12m", 2305): (12_811_008, 153_732_104),
    ("andrea-12m", 256): (11_237_376, 134_848_520),
    ("andrea-120m", 2305): (89_382_912, 1_072_594_952),
    ("andrea-120m", 256): (86_235_648, 1_034_827_784),
}

SHAPES = {  # docs/architecture.md#the-worker: width, heads, layers, context
    "andrea-12m": (384, 12, 6, 1024),
    "andrea-120m": (768, 12, 12, 1024),
}


def gpt_formula(preset: str, vocab: int) -> int:
    """nanoGPT's count written out: wte + wpe + L * (2 LayerNorms + qkv + proj + MLP, biases)
    + final LayerNorm + untied head without bias."""
    s = PRESETS[preset]
    d, L, T = s.n_embd, s.n_layer, s.block_size
    per_layer = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return vocab * d + T * d + L * per_layer + 2 * d + vocab * d


@pytest.mark.parametrize("preset,vocab", sorted(EXACT))
def test_preset_has_its_exact_parameter_count_and_checkpoint_size(preset, vocab):
    n, nbytes = EXACT[(preset, vocab)]
    assert count_parameters(PRESETS[preset], vocab) == n
    assert gpt_formula(preset, vocab) == n
    assert 8 + 12 * n == nbytes
    cfg = RunConfig(preset=preset, model=PRESETS[preset], vocab_size=vocab)
    assert (cfg.n_params, cfg.checkpoint_bytes) == (n, nbytes)


@pytest.mark.parametrize("preset", ["andrea-tiny", "andrea-12m",
                                    pytest.param("andrea-120m", marks=pytest.mark.slow)])
def test_the_built_model_has_the_table_count_for_the_default_vocabulary(preset):
    from worker.model import GPT
    model = GPT(PRESETS[preset], DEFAULT_BPE_VOCAB)
    assert model.n_params == EXACT[(preset, DEFAULT_BPE_VOCAB)][0]
    assert sum(p.numel() for p in model.parameters()) == model.n_params


@pytest.mark.parametrize("preset", sorted(SHAPES))
def test_published_shapes_are_the_specs(preset):
    s = PRESETS[preset]
    assert (s.n_embd, s.n_head, s.n_layer, s.block_size) == SHAPES[preset]


def test_parameter_order_is_embeddings_then_attention_and_mlp_per_layer_then_the_head():
    table = parameter_table(PRESETS["andrea-12m"], DEFAULT_BPE_VOCAB)
    names = [n for n, _, _ in table]
    assert names[:2] == ["transformer.wte.weight", "transformer.wpe.weight"]
    assert names[-3:] == ["transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"]
    per_layer = ["ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                 "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                 "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"]
    assert names[2:-3] == [f"transformer.h.{i}.{n}" for i in range(6) for n in per_layer]
    offset = 0
    for name, shape, off in table:  # contiguous, no gaps, no overlap
        assert off == offset, name
        offset += math.prod(shape)
    assert offset == 12_811_008


def test_each_named_parameter_sits_at_its_table_offset_in_a_written_checkpoint(tmp_path):
    """Write a real checkpoint of andrea-test with the worker's Checkpointer, then read each
    named parameter's bytes (and its m and v) at the table offset of each region."""
    from worker.checkpointer import Checkpointer
    from worker.model import GPT
    from worker.optim import FlatAdamW
    vocab = 256
    cfg = RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], vocab_size=vocab)
    model = GPT(cfg.model, vocab, seed=7)
    opt = FlatAdamW(model, cfg)
    with torch.no_grad():  # distinct values everywhere: every element identifies its place
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) * 1e-3 + i)
    x = torch.randint(0, vocab, (2, 16))
    torch.nn.functional.cross_entropy(model(x).reshape(-1, vocab), x.reshape(-1)).backward()
    opt.step(1e-3)  # m and v become the gradients' moments, different per parameter
    n = model.n_params
    ck = Checkpointer(tmp_path, n)
    ck.snapshot(1, model.flat, opt.m, opt.v, "cadence")
    assert ck.wait().error is None
    path = tmp_path / checkpoint_name(1)
    assert read_header(path) == (1, n)
    raw = path.read_bytes()
    assert len(raw) == 8 + 12 * n == 514_568
    table = parameter_table(cfg.model, vocab)
    params = dict(model.named_parameters())
    assert list(params) == [name for name, _, _ in table]
    for name, shape, off in table:
        p = params[name]
        assert tuple(p.shape) == shape
        size = p.numel() * 4
        state = opt.opt.state[p]
        for region, tensor in enumerate((p, state["exp_avg"], state["exp_avg_sq"])):
            start = 8 + region * 4 * n + 4 * off
            got = np.frombuffer(raw[start:start + size], dtype="<f4")
            assert np.array_equal(got, tensor.detach().reshape(-1).numpy()), \
                f"{name}: region {region} bytes at offset {off} are not this parameter's"
