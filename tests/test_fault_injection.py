"""The worker's test pauses (worker/fault_injection.py) end early on a stop signal or on the
test's release file, so signal tests can pause for longer than a loaded machine needs without
waiting that long. Fast: in-process, a thread plays the test's part."""
import threading
import time

from worker.fault_injection import EnvHooks


def test_a_pause_ends_when_the_release_file_appears_and_reports_first(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDREA_TEST_PAUSE_AT_STEP", "7:600")
    got = []
    threading.Timer(0.2, (tmp_path / ".test-release-7").touch).start()
    t0 = time.monotonic()
    EnvHooks(tmp_path).after_step(7, got.append)
    assert time.monotonic() - t0 < 60
    assert [r["event"] for r in got] == ["test-pause"] and got[0]["step"] == 7
    EnvHooks(tmp_path).after_step(7, got.append)  # once per run directory
    assert len(got) == 1


def test_a_pause_ends_once_a_stop_signal_arrived(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDREA_TEST_PAUSE_AT_MICRO", "3.2:600")
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    EnvHooks(tmp_path, stop.is_set).after_micro_batch(3, 2, lambda r: None)
    assert time.monotonic() - t0 < 60


def test_without_a_release_or_a_stop_the_pause_lasts_its_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDREA_TEST_PAUSE_AT_STEP", "2:0.3")
    t0 = time.monotonic()
    EnvHooks(tmp_path, lambda: False).after_step(2, lambda r: None)
    assert time.monotonic() - t0 >= 0.3


def test_test_hooks_live_only_in_the_two_fault_injection_modules():
    """Every ANDREA_TEST_*/ANDREA_FAULT_* variable and the tokenization delay is read in
    worker/fault_injection.py or proxy/fault_injection.py and nowhere else in the packages, so a
    reader finds every test hook in one place per side."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    hook = re.compile(r"""["'](ANDREA_TEST_\w+|ANDREA_FAULT_\w+|ANDREA_TOKENIZE_DELAY)["']""")
    seams = {root / "worker" / "fault_injection.py", root / "proxy" / "fault_injection.py"}
    outside = [f"{p.relative_to(root)}: {m.group(1)}"
               for pkg in ("proxy", "worker", "shared") for p in sorted((root / pkg).rglob("*.py"))
               if p not in seams for m in hook.finditer(p.read_text())]
    assert not outside, outside
