"""proxy/run_files/json_file.py: the proxy's one reader of small JSON run files, with the error
policy chosen by the caller. Fast."""
import logging

import pytest

from proxy.run_files.json_file import read_json


def test_a_missing_file_gives_the_default_under_every_policy(tmp_path):
    for garbage in ("default", "aside", "raise"):
        assert read_json(tmp_path / "none.json", {"d": 1}, garbage=garbage) == {"d": 1}


def test_garbage_gives_the_default_and_stays_in_place_for_a_reader_that_must_not_disturb(tmp_path):
    p = tmp_path / ".status.json"
    p.write_text('{"step": 1')
    assert read_json(p, {}) == {}
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
