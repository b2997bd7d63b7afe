"""The ready-made configurations under configs/ (docs/configuration.md#ready-made-configurations)
and the --config file rules (docs/configuration.md#the-config-file): every file loads, resolves
to a valid run of its published shape, and creates and trains a real run on CPU with the model
shrunk only where the file's `# overridable in tests:` line allows."""
import argparse
import json
import sysconfig
from pathlib import Path

import pytest

from proc_helpers import ROOT
from proxy.commands.run_args import add_run_args, config_from_args
from proxy.commands.run_config_file import parse_run_args, read_config_file
from shared.run.config import ConfigError, RunConfig

CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
ARG = f"x=text:{Path(sysconfig.get_paths()['stdlib']) / 'argparse.py'}"
SHRINK = {"preset": "andrea-test", "tokenizer": "bytes", "max_steps": "3", "warmup_steps": "1", "batch_size": "8",
          "micro_batch_size": "4", "arm": ARG, "device": "cpu"}


def _parser():
    ap = argparse.ArgumentParser()
    add_run_args(ap)
    return ap


def _overridable(path: Path) -> set[str]:
    for line in path.read_text().splitlines():
        if line.startswith("# overridable in tests:"):
            return {k.strip() for k in line.split(":", 1)[1].split(",")}
    return set()


def test_the_three_ready_made_configurations_exist():
    assert {p.name for p in CONFIGS} >= {"andrea-12m.toml", "andrea-120m.toml", "tiny-cpu.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_resolves_to_a_valid_run_of_its_shape(path, tmp_path):
    a = parse_run_args(_parser(), ["--run-dir", str(tmp_path / "r"), "--config", str(path)])
    cfg = config_from_args(a)
    cfg.validate()
    assert cfg.checkpoint_every == 100 and a.keep_last >= 2
    assert all(a.sources[k] == "file" for k in read_config_file(path, _parser()))
    if path.stem.startswith("andrea-"):
        assert cfg.preset == path.stem and cfg.model.block_size == 1024
        assert cfg.micro_batch_size and cfg.batch_size // cfg.micro_batch_size > 1
        assert cfg.batch_size * cfg.model.block_size >= 65_536  # a realistic update
        assert 0 < cfg.warmup_steps < cfg.max_steps and cfg.grad_clip > 0
    text = path.read_text()
    assert "per update" in text and "overridable in tests:" in text


def test_tiny_cpu_is_the_embedded_default(tmp_path):
    a = parse_run_args(_parser(), ["--run-dir", str(tmp_path / "r"),
                                   "--config", str(ROOT / "configs" / "tiny-cpu.toml")])
    b = parse_run_args(_parser(), ["--run-dir", str(tmp_path / "r")])
    ca, cb = config_from_args(a).to_json(), config_from_args(b).to_json()
    for d in (ca, cb):
        d.pop("sources"), d.pop("config_file")
    assert ca == cb
    assert (a.keep_last, a.keep_every) == (b.keep_last, b.keep_every)


def test_a_short_run_from_a_config_file_shortens_the_files_warmup_like_the_default(tmp_path):
    """`--config configs/tiny-cpu.toml --max-steps 20` shortens the file's warm-up as the bare
    default it describes shortens its own. A too-long --warmup-steps typed on the command line,
    or a file whose own max_steps is below its warm-up, is an error."""
    a = parse_run_args(_parser(), ["--run-dir", str(tmp_path / "r"), "--config",
                                   str(ROOT / "configs" / "tiny-cpu.toml"), "--max-steps", "20"])
    b = parse_run_args(_parser(), ["--run-dir", str(tmp_path / "r"), "--max-steps", "20"])
    ca, cb = config_from_args(a), config_from_args(b)
    assert ca.warmup_steps == cb.warmup_steps == 2
    assert a.sources["warmup_steps"] == "file, shortened to a tenth of max steps"
    with pytest.raises(ConfigError, match="--warmup-steps 50 must be below --max-steps 20"):
        config_from_args(parse_run_args(_parser(), [
            "--run-dir", "r", "--config", str(ROOT / "configs" / "tiny-cpu.toml"),
            "--max-steps", "20", "--warmup-steps", "50"]))
    f = tmp_path / "bad.toml"
    f.write_text("max_steps = 20\nwarmup_steps = 50\n")
    with pytest.raises(ConfigError, match="--warmup-steps 50 must be below --max-steps 20"):
        config_from_args(parse_run_args(_parser(), ["--run-dir", "r", "--config", str(f)]))


def test_command_line_beats_the_file_and_the_sources_say_so(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('batch-size = 32\nmicro_batch_size = 8\nlr = 1\ncompile = true\n'
                 'arm = ["a=text:x"]\n')
    a = parse_run_args(_parser(), ["--run-dir", "r", "--config", str(f), "--batch-size", "64",
                                   "--arm", "b=text:y"])
    assert (a.batch_size, a.micro_batch_size, a.lr, a.compile, a.arm) == (64, 8, 1.0, "on",
                                                                          ["b=text:y"])
    assert (a.sources["batch_size"], a.sources["micro_batch_size"], a.sources["seed"],
            a.sources["arm"]) == ("command line", "file", "default", "command line")


@pytest.mark.parametrize("text,message", [
    ("batch_sise = 8\n", "unknown key 'batch_sise'; did you mean 'batch_size'"),
    ("batch_size = '8'\n", "batch_size = '8' (str): --batch-size takes an integer"),
    ("compile = 1\n", "takes true or false"),
    ("precision = 'fp16'\n", "choose one of auto, fp32, bf16"),
    ("lr = 1e-3\nbatch_size = = 8\n", "not valid TOML: Invalid value (at line 2, column 14)"),
    (b"max_steps = 20\n\xff\xfe\n", "not valid TOML: not UTF-8 text (byte 0xff at offset 15)"),
])
def test_a_bad_config_file_is_refused_with_the_key_or_the_line(tmp_path, text, message):
    f = tmp_path / "c.toml"
    f.write_bytes(text) if isinstance(text, bytes) else f.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_run_args(_parser(), ["--run-dir", "r", "--config", str(f)])
    assert message in str(e.value) and str(f) in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("bad,why", [
    (["--micro-batch-size", "0"], "must be >= 1"),
    (["--micro-batch-size", "16"], "larger than a rank's share"),
    (["--config", "MISSING.toml"], "cannot read it"),
])
def test_bad_batch_or_config_input_exits_2_before_anything_is_written(tmp_path, bad, why):
    from proc_helpers import run_proxy
    run = tmp_path / "run"
    r = run_proxy(run, *bad, timeout=60)  # TINY: batch 8
    assert r.returncode == 2 and why in r.stderr, r.stderr[-2000:]
    assert not run.exists()


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_creates_and_trains_a_run_on_cpu(path, tmp_path):
    import subprocess
    import sys
    allowed = _overridable(path)
    args = [x for k, v in SHRINK.items() if k in allowed
            for x in (f"--{k.replace('_', '-')}", v)]
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "proxy", "run", "--run-dir", str(run), "--config",
                        str(path), "--print-every", "1000", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = RunConfig.from_json(json.loads((run / "run.json").read_text()))
    assert cfg.config_file == str(path) and cfg.sources["preset"] in ("file", "command line")
    records = json.loads((run / ".loss.json").read_text())
    assert [x["step"] for x in records] == [1, 2, 3]
    assert "micro-batches per update" in r.stderr and "[file]" in r.stderr


def _table_row(stderr: str, key: str) -> str:
    return next(ln for ln in stderr.splitlines() if ln.split("  ", 1)[-1].lstrip().startswith(key))


@pytest.mark.slow
def test_start_up_table_names_run_json_for_creation_values_on_a_resume(tmp_path):
    """The start-up table names the real source of each value: a warm-up derived from
    --max-steps says so, and on a resume the creation values (lr, --probe-every, --reward) say
    [run.json], with a warning for each such option given again and ignored."""
    from proc_helpers import run_proxy
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "20", timeout=120)   # warm-up 50 >= 20: shortened to 2
    assert r.returncode == 0, r.stderr[-2000:]
    row = _table_row(r.stderr, "lr warm-up / cosine end")
    assert " 2/20 " in row and "[warm-up shortened to a tenth of max steps, end command line]" \
        in row, row
    # the audit cadence a tiny model gets by default, and why (docs/bandit.md#probe-cost)
    row = _table_row(r.stderr, "sample audit")
    assert "3 arms x 48 tokens every 1100 steps <= 0.50% of training FLOPs" in row
    assert "[checkpoint cadence x 11, to stay within 0.5%]" in row, row
    row = _table_row(r.stderr, "policy overhead")   # the default reads no probe: the audits alone
    assert "no probe + audits 0.50% = 0.50% of training FLOPs" in row and "[default]" in row, row
    assert "none: reward train_slope" in _table_row(r.stderr, "held-out probe")
    assert "over the default" not in row
    r = run_proxy(run, "--max-steps", "22", "--lr", "0.5", "--probe-every", "3",
                  "--reward", "train_loss", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for opt in ("--lr 0.5", "--probe-every 3", "--reward train_loss"):
        assert f"{opt} ignored: this run was created with" in r.stderr, opt
    assert "[run.json]" in _table_row(r.stderr, "lr peak") and \
        " 0.5 " not in _table_row(r.stderr, "lr peak")
    assert "[run.json]" in _table_row(r.stderr, "checkpoint/sample/probe every")
    assert "[run.json]" in _table_row(r.stderr, "reward")
    assert "[run.json]" in _table_row(r.stderr, "weight decay / grad clip")
    assert "[run.json]" in _table_row(r.stderr, "held-out probe")
    assert "[run.json]" in _table_row(r.stderr, "sample audit")
    assert "[run.json]" in _table_row(r.stderr, "policy overhead")
    assert "[command line]" in _table_row(r.stderr, "max steps")
    assert "[run.json]" in _table_row(r.stderr, "arms")


@pytest.mark.slow
def test_start_up_table_shows_the_phase_in_force_with_its_caps_and_floors(tmp_path):
    """The start-up table shows the caps and floors of the phase in force: the box the bandit
    draws in, and a pivot recorded on a stopped run is seen to be in force."""
    import subprocess
    import sys

    from proc_helpers import ROOT, run_proxy
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "10", "--checkpoint-every", "5", "--sample-every", "5",
                  "--caps", "repo-code=0.5", "--floors", "python-docs=0.2", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    row = _table_row(r.stderr, "phase / caps / floors")
    assert "0 'initial' (from step 0): caps repo-code<=0.5; floors python-docs>=0.2" in row, row
    assert "[command line]" in row, row
    p = subprocess.run([sys.executable, "-m", "proxy", "pivot", "--run-dir", str(run), "--caps",
                        "repo-docstrings=0.4", "--label", "v2", "--max-steps", "20"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = run_proxy(run, "--max-steps", "20", "--checkpoint-every", "5", "--sample-every", "5",
                  timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    row = _table_row(r.stderr, "phase / caps / floors")
    assert "1 'v2' (from step 10): caps repo-docstrings<=0.4; floors none" in row, row
    assert "[phases.json]" in row, row


@pytest.mark.slow
def test_a_batch_that_cannot_fit_in_memory_stops_at_once_naming_a_micro_batch_that_does(tmp_path):
    """--batch-size 100,000,000, a batch no memory holds: the worker stops at start, exit 3, no
    restarts, and the message names the micro-batch that trains the same batch."""
    from proc_helpers import run_proxy
    run = tmp_path / "run"
    r = run_proxy(run, "--batch-size", "100000000", "--max-steps", "2", timeout=180)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "needs at least" in r.stderr and "GiB of activations" in r.stderr
    assert "pass --micro-batch-size" in r.stderr and "restart 1" not in r.stderr


@pytest.mark.parametrize("key,value,message", [
    ("batch_size", "sixteen", "key batch_size = 'sixteen' must be an integer"),
    ("lr", "fast", "key lr = 'fast' must be a number"),
    ("seed", 1.5, "key seed = 1.5 must be an integer"),
    ("micro_batch_size", "a", "key micro_batch_size = 'a' must be an integer or null"),
    ("model", {"n_layer": "2"}, "key model.n_layer = '2' must be an integer"),
])
def test_a_run_json_value_of_the_wrong_type_is_refused_naming_the_file_and_key(tmp_path, key, value, message):
    """A hand-edited run.json with a value of the wrong type is a ConfigError (exit 2) naming the
    file and the key, not a TypeError deep in a computation later."""
    import dataclasses

    from shared.run.config import PRESETS, load_run_config
    d = json.loads(json.dumps(dataclasses.asdict(RunConfig(model=PRESETS["andrea-test"]))))
    assert RunConfig.from_json(d) == RunConfig(model=PRESETS["andrea-test"])
    d[key] = dict(d[key], **value) if isinstance(value, dict) else value
    f = tmp_path / "run.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        load_run_config(f)
    assert message in str(e.value) and str(f) in str(e.value)


def test_an_unreadable_phases_json_is_named_with_its_remedy(tmp_path):
    """A damaged phases.json said only 'unreadable (Expecting property name ...)'."""
    from proxy.run_files.phases import read_phases
    from shared.run.layout import RunLayout
    layout = RunLayout(tmp_path)
    layout.phases.write_text('{"phases": [{oops')
    with pytest.raises(ConfigError) as e:
        read_phases(layout)
    assert str(layout.phases) in str(e.value) and "restore it from a backup, or rewrite it" in str(e.value)


@pytest.mark.slow
def test_a_resume_labels_the_values_it_takes_from_run_json_as_such(tmp_path):
    """A resume without --max-steps or --micro-batch-size runs with run.json's values; the
    start-up table labels them [run.json], not [default]."""
    from proc_helpers import run_proxy
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "2", "--micro-batch-size", "4", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_proxy(run, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for row in ("max steps", "micro-batch (sequences/rank)", "micro-batches per update"):
        assert "[run.json]" in _table_row(r.stderr, row), _table_row(r.stderr, row)
    assert " 4 " in _table_row(r.stderr, "micro-batch (sequences/rank)")


@pytest.mark.slow
def test_no_warning_about_a_derived_setting_comes_before_a_configuration_error(tmp_path):
    """`run --max-steps 50` with a bad --caps printed "learning-rate warm-up shortened" and then
    the error: a warning about a setting of a run that is refused only misleads. Derived-setting
    and ignored-option warnings (creation and resume) come only once the configuration is valid."""
    from proc_helpers import run_proxy
    src = tmp_path / "a.txt"
    src.write_text("some words of prose\n" * 3000)
    refused = {
        "--caps": ["--caps", "nosuch=0.5"],
        "matches no file": ["--arm", f"a=text:{src}", "--arm", f"b=text:{src}",
                            "--arm", f"c=text:{tmp_path}/missing.txt"],
    }
    for said, args in refused.items():
        r = run_proxy(tmp_path / "new", "--max-steps", "50", *args, timeout=120)
        assert r.returncode == 2 and said in r.stderr, r.stderr[-2000:]
        assert "WARNING" not in r.stderr, r.stderr[-2000:]
        assert not (tmp_path / "new").exists()
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "2", timeout=120)     # valid: the warning is said, once
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("learning-rate warm-up shortened to 0 steps") == 1, r.stderr[-2000:]
    r = run_proxy(run, "--max-steps", "4", "--lr", "0.5", "--caps", "repo-code=0.9", timeout=120)
    assert r.returncode == 2 and "would change the policy mid-phase" in r.stderr, r.stderr[-2000:]
    assert "ignored" not in r.stderr, r.stderr[-2000:]
    r = run_proxy(run, "--max-steps", "4", "--lr", "0.5", "--default-arms", "--arm",
                  f"x=text:{tmp_path}/missing.txt", timeout=120)
    assert r.returncode == 2 and "missing.txt" in r.stderr, r.stderr[-2000:]
    assert "ignored" not in r.stderr, r.stderr[-2000:]
