"""Collapse watch (docs/bandit.md#watching-for-collapse): repetition scores per audit; two
bad audits in a row pin the last checkpoint before them, write an alarm into the history and the
log, and with --stop-on-collapse stop the run."""
import json

import pytest

from proc_helpers import loss_records, run_proxy
from proxy.mixture.collapse_watch import CollapseWatch, repetition_scores
from shared.checkpoint.file_format import checkpoint_name
from shared.checkpoint.manifest import ManifestEntry, read_manifest, record_checkpoint, set_pinned
from shared.checkpoint.retention import apply_retention
from shared.run.layout import RunLayout


def test_repetition_scores_tell_region_region_region_from_prose():
    rep = repetition_scores("region region region region region region region region")
    prose = repetition_scores("The quick brown fox jumps over the lazy dog, then naps under "
                              "an old oak tree near the river.")
    assert rep["distinct_1"] == 1 / 8 and rep["top_ngram_share"] == 1.0
    assert rep["top_ngram"].startswith("region")
    assert prose["distinct_2"] == 1.0 and prose["top_ngram_share"] < 0.2
    w = CollapseWatch(RunLayout("/nonexistent"))
    assert w.degenerate(rep) and not w.degenerate(prose)
    assert not w.degenerate(repetition_scores("a a a"))  # too short to judge


def _audit(step, text):
    return {"type": "audit", "step": step, "arms": {"x": {"prompt": "", "text": text, "loss": 1.0},
                                                     "y": {"prompt": "", "text": text, "loss": 1.0}}}


def test_one_bad_audit_then_a_good_one_raises_no_alarm(tmp_path):
    w = CollapseWatch(RunLayout(tmp_path))
    assert w.on_audit(_audit(10, "go go go go go go go go go go")) is None
    assert w.on_audit(_audit(20, "a perfectly ordinary sentence with many different words in it")) is None
    assert w.on_audit(_audit(30, "go go go go go go go go go go")) is None
    assert w.alarms == []


BAD = "go go go go go go go go go go"
GOOD = "a perfectly ordinary sentence with many different words in it"


def _checkpoint(run, step):
    """What the worker's writer does after a durable checkpoint: file, entry, retention."""
    (run / checkpoint_name(step)).write_bytes(b"x" * 68)
    record_checkpoint(run, ManifestEntry(step=step, file=checkpoint_name(step), nbytes=68,
                                         checksum="crc32:00000000", reason="cadence",
                                         pinned=False, time=1.0))
    apply_retention(run, n_params=5, keep_last=3, keep_every=0)


def test_a_bad_audit_holds_its_checkpoint_against_retention_until_the_alarm(tmp_path):
    # Audits every 20 steps and checkpoints every 10, the newest 3 kept: by the second bad audit
    # (step 60) retention has retired the checkpoint before the first (step 30) unless it is held.
    for step in (10, 20, 30, 40):
        _checkpoint(tmp_path, step)
    w = CollapseWatch(RunLayout(tmp_path))
    assert w.on_audit(_audit(40, BAD)) is None
    assert read_manifest(tmp_path)[30].pinned
    for step in (50, 60):
        _checkpoint(tmp_path, step)
    alarm = w.on_audit(_audit(60, BAD))
    assert alarm["pinned_checkpoint"] == checkpoint_name(30)
    assert (tmp_path / checkpoint_name(30)).exists() and read_manifest(tmp_path)[30].pinned
    _checkpoint(tmp_path, 70)
    assert sorted(read_manifest(tmp_path)) == [30, 50, 60, 70]


def test_a_good_audit_releases_the_hold_but_never_a_pin_made_before(tmp_path):
    for step in (10, 20, 30):
        _checkpoint(tmp_path, step)
    w = CollapseWatch(RunLayout(tmp_path))
    w.on_audit(_audit(30, BAD))
    assert read_manifest(tmp_path)[20].pinned
    w.on_audit(_audit(40, GOOD))
    assert not read_manifest(tmp_path)[20].pinned
    for step in (40, 50):
        _checkpoint(tmp_path, step)
    assert sorted(read_manifest(tmp_path)) == [30, 40, 50], "a released hold is retired as usual"
    assert set_pinned(tmp_path, 30) is False  # an operator's pin, made before the watch's
    w.on_audit(_audit(50, BAD))
    w.on_audit(_audit(60, GOOD))
    assert read_manifest(tmp_path)[30].pinned, "the watch released a pin it did not make"


def test_a_checkpoint_filed_after_the_first_bad_audit_is_pinned_by_the_alarm(tmp_path):
    # the writer is asynchronous: step 30's entry lands after the audit of step 40 was judged
    (tmp_path / checkpoint_name(30)).write_bytes(b"x" * 68)
    w = CollapseWatch(RunLayout(tmp_path))
    assert w.on_audit(_audit(40, BAD)) is None and w.held is None
    _checkpoint(tmp_path, 30)
    assert w.on_audit(_audit(50, BAD))["pinned_checkpoint"] == checkpoint_name(30)
    assert read_manifest(tmp_path)[30].pinned


def test_a_manifest_that_cannot_be_written_costs_the_hold_not_the_run(tmp_path, caplog):
    _checkpoint(tmp_path, 10)
    (tmp_path / ".checkpoints.json.lock").unlink(missing_ok=True)
    (tmp_path / ".checkpoints.json.lock").mkdir()  # the lock cannot be opened: an OSError
    w = CollapseWatch(RunLayout(tmp_path))
    assert w.on_audit(_audit(20, BAD)) is None
    alarm = w.on_audit(_audit(30, BAD))
    assert alarm["pinned_checkpoint"] is None and "could not pin" in caplog.text


@pytest.mark.slow
def test_two_degenerate_audits_pin_the_checkpoint_before_them_alarm_the_history_and_stop(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a " * 30000)
    (src / "b.txt").write_text("b a " * 15000)
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "300", "--checkpoint-every", "10", "--sample-every", "10",
                  "--probe-every", "5", "--arm", f"a=text:{src / 'a.txt'}",
                  "--arm", f"b=text:{src / 'b.txt'}", "--stop-on-collapse",
                  # the hold is taken when the proxy judges the first bad audit; the worker may be
                  # several checkpoints ahead by then on a fast machine, so retention keeps more
                  "--keep-last", "8", timeout=600)
    out = r.stdout + r.stderr
    assert "COLLAPSE ALARM" in out, out[-3000:]
    assert r.returncode != 0, "--stop-on-collapse must stop the run with a non-zero exit"
    records = loss_records(run)
    alarms = [x for x in records if x.get("alarm")]
    assert len(alarms) == 1
    alarm = alarms[0]["alarm"]
    first_bad, second_bad = alarm["audit_steps"]
    assert second_bad == first_bad + 10 and alarms[0]["step"] > second_bad
    assert records[-1]["step"] < 300, "the run went on after the alarm"
    manifest = read_manifest(run)
    pinned = alarm["pinned_checkpoint"]
    step = int(pinned[5:11])
    assert step < first_bad and step == max(s for s in manifest if s < first_bad)
    assert manifest[step].pinned and (run / pinned).exists(), "retention deleted the pinned checkpoint"
    audits = json.loads((run / ".samples.json").read_text())["audits"]
    assert all("collapse" in a for a in audits)
    assert [a["collapse"]["bad"] for a in audits if a["step"] in (first_bad, second_bad)] == [True, True]
    assert "COLLAPSE ALARM" in (run / "logs" / "proxy.log").read_text()
