"""The three sidecars at full scale (docs/bandit.md#determinism): .state.json = replay of .loss.json,
the rewind path when the newest checkpoint is corrupt, and the bounded .samples.json."""
import json

import pytest

from proc_helpers import loss_records, run_proxy
from proxy.mixture.rebuild import replay_run
from shared.checkpoint.file_format import checkpoint_name
from shared.run.config import load_run_config
from shared.run.layout import RunLayout

pytestmark = pytest.mark.slow  # every test here starts real proxy/worker processes

COMMON = ["--checkpoint-every", "20", "--sample-every", "20", "--probe-every", "5",
          "--bandit-warmup", "5"]


def replayed_state(run, step):
    layout = RunLayout(run)
    return replay_run(layout, load_run_config(layout.run_json), step).bandit.to_dict()


def test_replaying_the_history_from_the_phase_start_reproduces_state_json_exactly(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "60", *COMMON).returncode == 0
    state = json.loads((run / ".state.json").read_text())
    assert state["step"] == 60 and state["phase"]["updates"] > 0, "the bandit never updated"
    assert replayed_state(run, 60) == state
    assert replayed_state(run, 40) != state


def test_corrupt_newest_checkpoint_rewinds_history_archives_audits_and_rebuilds_state(tmp_path):
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "60", *COMMON).returncode == 0
    newest = run / checkpoint_name(60)
    newest.write_bytes(newest.read_bytes()[:1000])           # torn: the resume must fall back to 40
    r = run_proxy(run, "--max-steps", "40", *COMMON)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rejected step_000060.bin" in r.stderr
    assert newest.exists() or (run / "rejected" / newest.name).exists(), "the bad file must be kept"
    assert [x["step"] for x in loss_records(run)] == list(range(1, 41))
    rewound = json.loads((run / ".loss.rewound.json").read_text())
    assert [x["step"] for x in rewound] == list(range(41, 61))
    assert all("resumed from step 40" in x["rewound_reason"] for x in rewound)
    assert [a["step"] for a in json.loads((run / "archive" / "rewound-samples.json").read_text())] == [60]
    assert [a["step"] for a in json.loads((run / ".samples.json").read_text())["audits"]] == [20, 40]
    state = json.loads((run / ".state.json").read_text())
    assert state["step"] == 40 and state == replayed_state(run, 40)


def test_samples_json_keeps_only_the_last_n_audits_of_the_phase(tmp_path):
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "30", "--checkpoint-every", "10", "--sample-every", "5",
                  "--samples-keep", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((run / ".samples.json").read_text())
    assert d["phase"] == {"label": "initial", "index": 0}
    assert [a["step"] for a in d["audits"]] == [25, 30]
    assert set(d["audits"][0]["arms"]) == {"repo-docstrings", "repo-code", "python-docs"}
    assert all({"prompt", "text", "loss"} <= set(a) for a in d["audits"][0]["arms"].values())


def test_a_torn_history_tail_and_a_stale_temporary_are_repaired_on_resume_and_said_once(tmp_path):
    """A torn last record of the history and stale temporaries (an atomic write's, a half-made
    pivot archive) are repaired at the resume,
    and the repair warning is logged once (by the history, not again by the supervisor)."""
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "40", *COMMON).returncode == 0
    loss = run / ".loss.json"
    loss.write_bytes(loss.read_bytes()[:-37])              # a kill mid-append of the last record
    # and a kill between write and rename of the status file: the temporary it leaves
    import os
    import tempfile
    stale = tempfile.mkstemp(prefix="..status.json.", suffix=".tmp", dir=run)[1]
    os.utime(stale, (1e9, 1e9))
    # and a kill while a pivot at step 30 (withdrawn since) was being archived
    half_made = run / "archive" / "pivot-30.tmp"
    half_made.mkdir(parents=True)
    (half_made / "..state.json.5qvouemu.tmp").write_text('{"arms"')
    r = run_proxy(run, "--max-steps", "60", *COMMON)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("torn tail at byte") == 1, r.stderr[-3000:]
    assert not os.path.exists(stale) and "removed stale temporary ./" in r.stderr
    assert not half_made.exists() and "removed stale temporary archive/pivot-30.tmp" in r.stderr
    assert [x["step"] for x in loss_records(run)] == list(range(1, 61))
