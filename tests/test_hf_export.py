"""`python -m proxy export ... --format hf --to DIR` gives a folder that `transformers`
loads as it is, with the project's logits and the project's token ids.

A real GPT's flat weights (perturbed so that no bias or norm is at its initial value, which would
hide a wrong mapping) are written by the real checkpoint writer into a run directory with a real
run.json and tokenizer.json; `export` runs as a real process; `transformers` (the `dev` extra)
loads the result. The HF import is slow: every check of the round trip lives in one test per
tokenizer kind.
"""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from proc_helpers import ROOT
from shared.checkpoint import manifest as cm
from shared.checkpoint import write as cw
from shared.data.tokenizer import RunTokenizer
from shared.run.config import PRESETS, RunConfig

pytestmark = pytest.mark.slow  # starts `python -m proxy export`, imports transformers

TEXT = "def parse(line):\n    \"\"\"Split 'a=b'.\"\"\"\n\treturn line.split('=')  # é ✓ 日本\n"


def _proxy(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _make_run(tmp_path, kind):
    from worker.model import GPT
    tok = (RunTokenizer.bytes() if kind == "bytes"
           else RunTokenizer.train_bpe([(ROOT / "README.md").read_text() * 2], 400))
    cfg = RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], tokenizer=kind,
                    vocab_size=tok.vocab_size)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(cfg.to_json()))
    tok.save(run / "tokenizer.json")
    model = GPT(cfg.model, cfg.vocab_size, seed=3)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        model.flat.add_(0.05 * torch.randn(model.flat.shape, generator=g))
    flat = model.flat.detach().numpy()
    for step in (4, 7):  # --from-run must pick the newest valid one
        path, nbytes, checksum = cw.write_checkpoint(run, step, flat * (step == 7), flat, flat)
        cm.record_checkpoint(run, cm.ManifestEntry(step=step, file=path.name, nbytes=nbytes,
                                                   checksum=checksum, reason="cadence",
                                                   pinned=False, time=0.0))
    return run, model.eval(), tok


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_hf_export_loads_in_transformers_with_the_same_logits_and_token_ids(tmp_path, kind):
    run, model, tok = _make_run(tmp_path, kind)
    out = tmp_path / "hf"
    r = _proxy("export", "--from-run", str(run), "--format", "hf", "--to", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step_000007.bin" in r.stdout
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporaries left

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_warning()
    said = []
    handler = logging.Handler()
    handler.emit = lambda rec: said.append(rec.getMessage())
    hf_logging.get_logger("transformers").addHandler(handler)
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)
    err = "\n".join(said)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert "newly initialized" not in err and "were not used" not in err, err
    assert type(hf).__name__ == "GPT2LMHeadModel"
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()  # untied
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)

    htok = AutoTokenizer.from_pretrained(str(out))
    ids = [int(i) for i in tok.encode(TEXT)]
    assert htok.encode(TEXT) == ids  # the project's ids, no special tokens added
    assert htok.decode(ids) == tok.decode(ids) == TEXT

    idx = torch.tensor([ids[:PRESETS["andrea-test"].block_size]])
    hf.eval()
    with torch.no_grad():
        diff = (hf(idx).logits - model(idx)).abs().max().item()
    print(f"max |logit difference| HF vs project ({kind}): {diff:.3g}")
    assert diff <= 1e-5

    prompt = torch.tensor([ids[:6]])
    gen = hf.generate(prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape == (1, 14) and torch.equal(gen[0, :6], prompt[0])
    with torch.no_grad():  # greedy: the first new token is the project's argmax
        assert gen[0, 6].item() == model(prompt)[0, -1].argmax().item()
    # the exported generation_config.json alone (no arguments) stays inside the context
    # (it once asked for 100 new tokens of a 32-token model, which transformers cannot embed)
    torch.manual_seed(0)
    out_ids = hf.generate(prompt)
    assert 6 < out_ids.shape[1] <= PRESETS["andrea-test"].block_size


def test_hf_export_refuses_a_non_empty_folder_without_force_and_replaces_it_with(tmp_path):
    run, _, _ = _make_run(tmp_path, "bytes")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _proxy("export", str(run / "step_000007.bin"), "--format", "hf", "--to", str(out))
    assert r.returncode == 2 and "--force" in r.stdout
    assert os.listdir(out) == ["keep.txt"]
    r = _proxy("export", str(run / "step_000007.bin"), "--format", "hf", "--to", str(out),
               "--force")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "keep.txt" not in os.listdir(out) and (out / "config.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["tie_word_embeddings"] is False
    assert cfg["activation_function"] == "gelu" and cfg["n_positions"] == 32
    assert _proxy("export", "--format", "hf", "--to", str(out)).returncode == 2  # no source
