"""shared/atomic_io.py `read_json`: the one reader of small JSON files, with the error policy
chosen by the caller. Fast."""
import logging

import pytest

from shared.atomic_io import read_json


def test_a_missing_file_gives_the_default_under_every_policy(tmp_path):
    for garbage in ("default", "aside", "raise"):
        assert read_json(tmp_path / "none.json", {"d": 1}, garbage=garbage) == {"d": 1}


def test_garbage_gives_the_default_and_stays_in_place_for_a_reader_that_must_not_disturb(tmp_path):
    p = tmp_path / ".status.json"
    p.write_text('{"step": 1')
    assert read_json(p, {}, garbage="default") == {}
    assert p.read_text() == '{"step": 1' and sorted(x.name for x in tmp_path.iterdir()) == [p.name]


def test_garbage_is_moved_aside_with_a_warning_naming_it(tmp_path, caplog):
    p = tmp_path / ".state.json"
    p.write_bytes(b"\x00garbage")
    with caplog.at_level(logging.WARNING):
        assert read_json(p, None, garbage="aside") is None
    (aside,) = [x for x in tmp_path.iterdir() if x.name.startswith(".state.json.corrupt-")]
    assert aside.read_bytes() == b"\x00garbage" and not p.exists()
    assert str(p) in caplog.text and aside.name in caplog.text


def test_garbage_raises_naming_the_file_and_the_byte_when_the_caller_asks(tmp_path):
    p = tmp_path / "phases.json"
    p.write_text('{"phases": [}')
    with pytest.raises(ValueError, match=r"phases.json: invalid JSON at byte 12"):
        read_json(p, garbage="raise")
    assert p.exists()


def test_a_value_of_the_wrong_kind_is_garbage_under_the_callers_policy(tmp_path):
    p = tmp_path / "job.json"
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="a JSON list, not the dict expected"):
        read_json(p, expect=dict)
    assert read_json(p, None, garbage="default", expect=dict) is None
    assert read_json(p, expect=list) == [1, 2]


def test_a_file_that_must_exist_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "run.json", missing_ok=False)


def test_the_owners_messages_name_the_file_once_with_the_byte_offset(tmp_path):
    from proxy.run_files.phases import read_phases
    from shared.run.config import ConfigError, load_run_config
    from shared.run.layout import RunLayout

    (tmp_path / "run.json").write_text('{"preset": ')
    (tmp_path / "phases.json").write_bytes(b"\xff")
    for read, name, reason in ((lambda: load_run_config(tmp_path / "run.json"), "run.json",
                                "invalid JSON at byte 11 of 11"),
                               (lambda: read_phases(RunLayout(tmp_path)), "phases.json",
                                "not UTF-8 at byte 0")):
        with pytest.raises(ConfigError) as e:
            read()
        assert str(e.value).count(name) == 1 and reason in str(e.value), str(e.value)


def test_two_garbage_files_moved_aside_in_the_same_second_keep_both_copies(tmp_path):
    """A second corruption moved aside within the same second gets its own name (`.1`, ...)
    instead of overwriting the first copy: nothing is lost."""
    p = tmp_path / ".samples.json"
    for garbage in (b"first", b"second", b"third"):
        p.write_bytes(garbage)
        assert read_json(p, [], garbage="aside") == []
    kept = sorted(x.read_bytes() for x in tmp_path.iterdir() if x.name.startswith(".samples.json.corrupt-"))
    assert kept == [b"first", b"second", b"third"] and not p.exists()
