"""operator tools: `python -m proxy inspect PATH` and `export PATH --to X.safetensors`.

A real model's flat parameters are written with the real writer into a run directory that
has a real run.json; the tools run as real processes.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from proc_helpers import ROOT
from shared.checkpoint import manifest as cm
from shared.checkpoint import write as cw
from shared.run.config import PRESETS, RunConfig, parameter_table

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

VOCAB = 256


def _proxy(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "proxy", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture()
def run_with_checkpoint(tmp_path):
    """(run_dir, model, path): andrea-test with bytes vocabulary, checkpoint of step 7."""
    from worker.model import GPT
    cfg = RunConfig(preset="andrea-test", model=PRESETS["andrea-test"], tokenizer="bytes",
                    vocab_size=VOCAB)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(cfg.to_json()))
    model = GPT(cfg.model, VOCAB, seed=3)
    flat = model.flat.detach().numpy()
    m = (flat * 0.5).astype("float32")
    v = (flat * flat).astype("float32")
    path, nbytes, checksum = cw.write_checkpoint(run, 7, flat, m, v)
    cm.record_checkpoint(run, cm.ManifestEntry(step=7, file=path.name, nbytes=nbytes,
                                               checksum=checksum, reason="sigusr1",
                                               pinned=True, time=0.0))
    return run, model, path


def test_inspect_prints_header_size_checksum_table_and_norms(run_with_checkpoint):
    run, model, path = run_with_checkpoint
    r = _proxy("inspect", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert f"header     step 7, n_params {model.n_params:,}" in out
    assert f"size       {8 + 12 * model.n_params:,} bytes" in out and ": ok" in out
    assert f"{cm.read_manifest(run)[7].checksum}: match; written for sigusr1, pinned yes" in out
    assert "valid      yes" in out
    for name, shape, offset in parameter_table(PRESETS["andrea-test"], VOCAB):
        assert any(line.startswith(name) and f"{offset:,}" in line and str(tuple(shape)) in line
                   for line in out.splitlines()), name
    assert "|weights|" in out and "|m|" in out and "|v|" in out


def test_inspect_reports_a_flipped_byte_and_a_truncated_file_with_their_rules(
        run_with_checkpoint):
    run, _, path = run_with_checkpoint
    data = bytearray(path.read_bytes())
    data[5000] ^= 0x01
    path.write_bytes(bytes(data))
    r = _proxy("inspect", str(path))
    assert r.returncode == 1
    assert "MISMATCH: manifest records" in r.stdout and "NO (rule: checksum)" in r.stdout
    path.write_bytes(bytes(data[:1000]))
    r = _proxy("inspect", str(path))
    assert r.returncode == 1 and "(rule: size)" in r.stdout and "truncated" in r.stdout


def test_export_writes_named_weights_that_a_fresh_model_loads_and_runs_identically(run_with_checkpoint,
                                                                       tmp_path):
    from safetensors.numpy import load_file

    from worker.model import GPT
    run, model, path = run_with_checkpoint
    out = tmp_path / "model.safetensors"
    r = _proxy("export", str(path), "--to", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    tensors = load_file(str(out))
    table = parameter_table(PRESETS["andrea-test"], VOCAB)
    assert sorted(tensors) == sorted(name for name, _, _ in table)
    fresh = GPT(PRESETS["andrea-test"], VOCAB, seed=99)
    res = fresh.load_state_dict({k: torch.from_numpy(a) for k, a in tensors.items()},
                                strict=False)
    assert res.unexpected_keys == []
    assert set(res.missing_keys) <= {name for name, _ in fresh.named_buffers()}
    for name, p in model.named_parameters():
        assert tuple(tensors[name].shape) == tuple(p.shape)
        torch.testing.assert_close(dict(fresh.named_parameters())[name], p, rtol=0, atol=0)
    idx = torch.arange(16).view(1, -1)
    torch.testing.assert_close(fresh(idx), model(idx), rtol=0, atol=0)
    # an existing output is not overwritten without --force; a corrupt file is refused
    assert _proxy("export", str(path), "--to", str(out)).returncode == 2
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    r = _proxy("export", str(path), "--to", str(out), "--force")
    assert r.returncode == 1 and "(rule: checksum)" in r.stdout
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_export_refuses_an_output_of_the_wrong_kind_and_a_path_that_is_no_checkpoint(
        run_with_checkpoint, tmp_path):
    """`export` refuses, exit 2 and nothing written: `--to dir/` for a safetensors file,
    `--format hf --to model.safetensors` for a folder, a checkpoint file that does not exist
    ("no such checkpoint file") and a run directory given as PATH (it points at --from-run).
    The hf folder it makes gets the umask's permissions."""
    import stat
    run, _, path = run_with_checkpoint
    r = _proxy("export", str(path), "--to", f"{tmp_path / 'out'}/")
    assert r.returncode == 2 and "a folder; --format safetensors writes one file" in r.stdout
    assert not (tmp_path / "out").exists()
    r = _proxy("export", str(path), "--format", "hf", "--to", str(tmp_path / "m.safetensors"))
    assert r.returncode == 2 and "--format hf writes a folder" in r.stdout
    assert not (tmp_path / "m.safetensors").exists()
    r = _proxy("export", str(run / "step_999999.bin"), "--to", str(tmp_path / "x.safetensors"))
    assert r.returncode == 2 and "no such checkpoint file" in r.stdout, r.stdout
    r = _proxy("export", str(run), "--to", str(tmp_path / "x.safetensors"))
    assert r.returncode == 2 and f"--from-run {run}" in r.stdout, r.stdout
    r = _proxy("export", str(path), "--format", "hf", "--to", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stdout + r.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o777 & ~umask


def test_export_makes_the_folder_of_its_output_file(run_with_checkpoint, tmp_path):
    """`--to new/dir/model.safetensors` makes new/dir/, as `--format hf` and `plot --out` make
    their folders."""
    from safetensors.numpy import load_file
    _, _, path = run_with_checkpoint
    out = tmp_path / "new" / "dir" / "model.safetensors"
    r = _proxy("export", str(path), "--to", str(out))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "transformer.wte.weight" in load_file(str(out))
    (tmp_path / "afile").write_text("x")
    r = _proxy("export", str(path), "--to", str(tmp_path / "afile" / "m.safetensors"))
    assert r.returncode == 2 and "cannot make its folder" in r.stdout, r.stdout + r.stderr


def test_export_and_sample_from_a_run_say_which_newer_checkpoint_they_passed_over(
        run_with_checkpoint, tmp_path):
    """--from-run / --run-dir take the newest valid checkpoint; a newer one that fails a rule
    is named with its rule, not silently skipped (docs/checkpoint-format.md#validity)."""
    from shared.data.tokenizer import RunTokenizer
    run, model, path = run_with_checkpoint
    RunTokenizer.bytes().save(run / "tokenizer.json")
    flat = model.flat.detach().numpy()
    newer, nbytes, checksum = cw.write_checkpoint(run, 9, flat, flat, flat * flat)
    cm.record_checkpoint(run, cm.ManifestEntry(step=9, file=newer.name, nbytes=nbytes,
                                               checksum=checksum, reason="cadence",
                                               pinned=False, time=0.0))
    data = bytearray(newer.read_bytes())
    data[5000] ^= 0x01
    newer.write_bytes(bytes(data))
    r = _proxy("export", "--from-run", str(run), "--to", str(tmp_path / "w.safetensors"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skipped step_000009.bin, newer but invalid (rule checksum)" in r.stdout, r.stdout
    assert path.name in r.stdout
    r = _proxy("sample", "--run-dir", str(run), "--prompt", "ab", "--tokens", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skipped step_000009.bin, newer but invalid (rule checksum)" in r.stderr, r.stderr
    assert r.stdout.startswith(f"# {path.name} (step 7)")
