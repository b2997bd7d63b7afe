"""The worker's options write their own command line and parse it back (shared/run/worker_options.py)."""
from pathlib import Path

import pytest

from shared.run.worker_options import WorkerOptions


def test_options_survive_the_command_line_unchanged():
    """Every option the proxy sets comes back from the worker's parser as it was written."""
    opts = WorkerOptions(run_dir=Path("/runs/a"), resume_from=Path("/runs/a/step_000100.bin"),
                         resume_verified="crc32:0badf00d", max_steps=600, usr1_at="boundary",
                         device="cpu", parent_pid=4242, keep_last=3, keep_every=500,
                         policy_timeout=30.5, compile="on", precision="bf16", micro_batch_size=4)
    assert WorkerOptions.from_argv(opts.to_argv()) == opts


def test_defaults_come_from_the_dataclass_and_are_left_off_the_command_line():
    """An option at its default is parsed back to the dataclass's default; the optional ones
    (resume, compile, precision, micro-batch, policy timeout) are not written at all."""
    opts = WorkerOptions(run_dir=Path("/runs/b"))
    argv = opts.to_argv()
    assert WorkerOptions.from_argv(argv) == opts
    for flag in ("--resume-from", "--resume-verified", "--compile", "--precision",
                 "--micro-batch-size", "--policy-timeout", "--max-steps", "--parent-pid"):
        assert flag not in argv


def test_a_bad_option_exits_with_the_usage_code():
    """argparse refuses a value outside the choices with exit code 2 (a usage error)."""
    with pytest.raises(SystemExit) as e:
        WorkerOptions.from_argv(["--run-dir", "/r", "--precision", "fp8"])
    assert e.value.code == 2
