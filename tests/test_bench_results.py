"""The benchmarks' RESULT contract (docs/operations.md#benchmarks), on small real runs of
scripts/: each script exits 0 and ends with one `RESULT {...}` line per figure, after everything
else it prints; each line is JSON with the figure, ratio, low, high, target and met, and `met`
agrees with low, high and the target (or is null: cannot decide)."""
import json
import os
import subprocess
import sys

import pytest

from proc_helpers import ROOT

pytestmark = pytest.mark.slow  # real benchmark processes, seconds each

LOWER_IS_BETTER = {"data_pipeline_vs_encode_batch_fast": False,
                   "supervision_alone_over_proxy_step_time": False,
                   "train_mfu": False, "train_ours_over_reference_tokens_per_s": False,
                   "train_accumulation_over_one_pass_tokens_per_s": False}


def _results(script: str, *args: str) -> list[dict]:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.rstrip("\n").splitlines()
    k = next(i for i, line in enumerate(lines) if line.startswith("RESULT "))
    assert all(line.startswith("RESULT ") for line in lines[k:]), lines[k:]  # last, together
    out = [json.loads(line[len("RESULT "):]) for line in lines[k:]]
    for x in out:
        assert {"figure", "ratio", "low", "high", "target", "met"} <= set(x), x
        assert x["met"] in (True, False, None), x
        if x["met"] is not None:
            lower = LOWER_IS_BETTER.get(x["figure"], True)
            good = x["high"] <= x["target"] if lower else x["low"] >= x["target"]
            bad = x["low"] > x["target"] if lower else x["high"] < x["target"]
            assert (good if x["met"] else bad), x
        if x["target"] is None:
            assert x["met"] is None, x
    return out


def test_bench_checkpoint_runs_and_ends_with_its_results(tmp_path):
    # its state's v must be a possible AdamW v (>= 0): a load with no checksum checks it
    out = _results("bench_checkpoint.py", "--repeats", "6", "--n-params", "200000",
                   "--dir", str(tmp_path))
    assert [x["figure"] for x in out] == [
        "checkpoint_write_vs_raw_write_fsync", "checkpoint_load_checksummed_vs_np_fromfile",
        "checkpoint_load_checksummed_vs_torch_load", "checkpoint_stall_vs_durable_torch_save",
        "checkpoint_stall_vs_torch_save"]
    assert all(x["rounds"] == 6 for x in out)


def test_bench_history_and_rewind_decide_from_rounds_not_one_measurement():
    out = _results("bench_history.py", "--records", "5000", "--rounds", "6")
    by = {x["figure"]: x for x in out}
    assert by["history_append_at_n_over_at_0"]["rounds"] == 6
    assert by["history_rewind_seconds_over_2s"]["rounds"] == 6
    exact = by["history_bytes_written_over_size"]
    assert exact["exact"] is True and exact["met"] is True   # a count decides at once
    out = _results("bench_rewind.py", "--records", "5000", "--rounds", "6")
    assert out[0]["figure"] == "rewind_and_rebuild_seconds_over_2s" and out[0]["rounds"] == 6
    assert out[0]["met"] is True   # a fraction of a second against 2 s
    few = _results("bench_rewind.py", "--records", "3000", "--rounds", "2")
    assert few[0]["met"] is None   # two rounds cannot decide


def test_bench_gpu_smoke_runs_every_side_on_the_cpu_and_sets_no_target(tmp_path):
    """The GPU benchmark's plumbing on the CPU (andrea-test, seconds): our compiled and eager
    loops, the SDPA backends (those the CPU lacks are rows that say so), the checkpoint's paired
    windows; without a nanoGPT checkout it says so and leaves that side out."""
    out = _results("bench_gpu.py", "--smoke", "--nanogpt", str(tmp_path / "no-nanogpt"))
    assert [x["figure"] for x in out] == ["mfu_andrea-test_best",
                                          "checkpoint_cost_andrea-test_cadence_100"]
    assert all(x["target"] is None and x["rounds"] == 6 for x in out)
