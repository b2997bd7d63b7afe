"""Damage inside `.loss.json` named as a hole (byte range, steps lost), its bytes kept aside, and
`status` showing the history's holes (docs/history.md#torn-tail-repair)."""

import subprocess
import sys

import pytest

from shared.run.loss_history import LossHistory, holes, iter_records
from tests.proc_helpers import ROOT, run_proxy


def _history(path, n=20):
    with LossHistory(path) as h:
        for k in range(1, n + 1):
            h.append({"step": k, "loss": 1.0 / k, "lr": 1e-3})


def _zero_middle(path, nbytes=40) -> bytes:
    b = bytearray(path.read_bytes())
    mid = len(b) // 2
    b[mid:mid + nbytes] = b"\0" * nbytes
    path.write_bytes(bytes(b))
    return bytes(b)


def test_a_hole_is_named_with_its_bytes_and_steps_and_the_damage_kept_aside(tmp_path):
    p = tmp_path / ".loss.json"
    _history(p)
    assert holes(p) == []
    damaged = _zero_middle(p)
    assert holes(p) == [(11, 12)]  # a reader finds it without writing
    assert p.read_bytes() == damaged
    h = LossHistory(p)
    h.close()
    msg = " ".join(h.repairs)
    assert "1 hole(s) inside the history, not a torn tail" in msg and "steps 11..12 lost" in msg
    assert "torn tail at" not in msg
    aside = list(tmp_path.glob(".loss.json.damaged-*"))
    assert len(aside) == 1 and aside[0].name in msg
    assert damaged.endswith(aside[0].read_bytes())  # the original bytes, from the cut on
    assert [r["step"] for r in iter_records(p)] == [*range(1, 11), *range(13, 21)]
    assert holes(p) == [(11, 12)]
    # the same damage again at once (the same second, as a fast restart loop would): the first
    # copy is kept, the second gets a name of its own
    p.write_bytes(damaged)
    LossHistory(p).close()
    copies = sorted(tmp_path.glob(".loss.json.damaged-*"))
    assert len(copies) == 2 and all(damaged.endswith(c.read_bytes()) for c in copies)


def test_a_torn_tail_is_still_called_one(tmp_path):
    p = tmp_path / ".loss.json"
    _history(p)
    p.write_bytes(p.read_bytes()[:-30])
    h = LossHistory(p)
    h.close()
    assert "torn tail at byte" in h.repairs[0] and "hole" not in h.repairs[0]
    assert holes(p) == []


@pytest.mark.slow
def test_status_shows_the_holes_of_a_damaged_history(tmp_path):
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "20", "--checkpoint-every", "10")
    assert r.returncode == 0, r.stderr[-2000:]
    _zero_middle(run / ".loss.json")
    s = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert s.returncode == 0, s.stderr
    assert "steps missing from .loss.json" in s.stdout, s.stdout


@pytest.mark.slow
def test_a_record_the_policy_cannot_fold_stops_the_resume_with_its_file_step_and_field(tmp_path):
    """A hand edit that gives a record's `arm_unigram_loss` the wrong type: the resume's replay
    stops with exit 1 and a message naming `.loss.json`, the step and the field (no traceback), and
    so does `pivot` on the stopped run; deleting the line, as the message says, lets the same
    command go on."""
    import json

    from tests.proc_helpers import drop_manifest_entries
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "30", "--checkpoint-every", "10")
    assert r.returncode == 0, r.stderr[-2000:]
    (run / "step_000030.bin").unlink()
    drop_manifest_entries(run, [30])
    (run / ".state.snapshots.jsonl").unlink()  # the resume at 20 replays steps 1..20
    lines = (run / ".loss.json").read_text().splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if '"step": 15,' in ln or '"step":15,' in ln)
    rec = json.loads(lines[at].rstrip().rstrip(","))
    rec["arm_unigram_loss"] = [1, 2]
    edited = json.dumps(rec) + ("," if lines[at].rstrip().endswith(",") else "") + "\n"
    (run / ".loss.json").write_text("".join(lines[:at] + [edited] + lines[at + 1:]))
    r = run_proxy(run, "--max-steps", "40", "--checkpoint-every", "10")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert ".loss.json" in out and "step 15" in out and "arm_unigram_loss" in out, out[-3000:]
    # `pivot` on the stopped run replays the same records: refused alike, and its request gone
    p = subprocess.run([sys.executable, "-m", "proxy", "pivot", "--run-dir", str(run), "--caps",
                        "repo-code=0.5", "--max-steps", "40"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert "step 15" in out and "arm_unigram_loss" in out, out[-3000:]
    assert not (run / ".pivot.request.json").exists()
    text = (run / ".loss.json").read_text()
    lines = text.splitlines(keepends=True)
    (run / ".loss.json").write_text("".join(ln for ln in lines if '"arm_unigram_loss": [1, 2]' not in ln))
    r = run_proxy(run, "--max-steps", "40", "--checkpoint-every", "10")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
