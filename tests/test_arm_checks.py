"""Every arm is checked before any expensive work (docs/data.md#checks-before-any-work):
existence, non-emptiness, a JSON Lines arm's field and a Parquet arm's column in the first
records, decodability; all problems at once, exit 2, and a refused start leaves no directory
it created."""
import gzip
import json

import pytest
from test_arm_sources import prose

from proc_helpers import run_proxy
from shared.data.arms import parse_arm_option
from shared.data.checks import check_arm, check_arms


def _arm(text):
    return parse_arm_option(text)


def _bad_sources(d):
    """name -> --arm value of one bad arm of each kind, and the words its message holds."""
    d.mkdir()
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text("\n  \n")
    (d / "bin.txt").write_bytes(b"\x00\x01\x02" * 100)
    (d / "nofield.jsonl").write_text("".join(json.dumps({"body": f"x{i}"}) + "\n" for i in range(5)))
    (d / "notjson.jsonl").write_text("just text\nmore text\n")
    (d / "broken.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage-not-deflate" * 4)
    return {
        "empty": (f"empty=text:{d / 'empty.txt'}", "is empty"),
        "blank": (f"blank=text:{d / 'blank.txt'}", "only whitespace"),
        "missing": (f"missing=text:{d / 'nowhere' / '*.txt'}", "matches no file"),
        "binary": (f"binary=text:{d / 'bin.txt'}", "is binary"),
        "nofield": (f"nofield=jsonl:{d / 'nofield.jsonl'}", "has a text field 'text'"),
        "notjson": (f"notjson=jsonl:{d / 'notjson.jsonl'}", "is JSON"),
        "broken": (f"broken=jsonl:{d / 'broken.jsonl.gz'}", "corrupt or truncated"),
    }


def test_each_kind_of_bad_arm_is_named_with_its_fix(tmp_path):
    for name, (spec, words) in _bad_sources(tmp_path / "src").items():
        got = check_arm(_arm(spec))
        assert len(got) == 1 and f"arm {name}:" in got[0] and words in got[0], (name, got)
    nofield = check_arm(_arm(f"nofield=jsonl:{tmp_path / 'src' / 'nofield.jsonl'}"))[0]
    assert "'body'" in nofield and "nofield=jsonl:" in nofield and ":FIELD" in nofield


def test_good_arms_pass_the_checks(tmp_path):
    (tmp_path / "a.txt").write_text(prose(5_000))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        for i in range(3):
            f.write(json.dumps({"content": prose(300, seed=i)}) + "\n")
    (tmp_path / "many").mkdir()
    for i in range(5):
        (tmp_path / "many" / f"{i}.txt").write_text(prose(1_000, seed=i))
    (tmp_path / "many" / "0-empty.txt").write_text("")   # one empty file among many is fine
    assert check_arms([_arm(f"a=text:{tmp_path / 'a.txt'}"),
                       _arm(f"b=jsonl:{tmp_path / 'b.jsonl.gz'}:content"),
                       _arm(f"m=text:{tmp_path / 'many'}"), _arm("d=python-docs")]) == []


def test_a_parquet_arm_without_the_column_or_rows_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "b.parquet")
    a = check_arm(_arm(f"a=parquet:{tmp_path / 'a.parquet'}"))
    b = check_arm(_arm(f"b=parquet:{tmp_path / 'b.parquet'}"))
    assert "no column 'text'" in a[0] and "body" in a[0]
    assert "holds no rows" in b[0]


@pytest.mark.slow
def test_a_start_with_bad_arms_reports_them_all_before_any_work_and_leaves_nothing(tmp_path):
    bad = _bad_sources(tmp_path / "src")
    (tmp_path / "src" / "good.txt").write_text(prose(400_000))
    run = tmp_path / "new" / "run"
    r = run_proxy(run, "--tokenizer", "bpe", "--max-steps", "1",
                  f"--arm=good=text:{tmp_path / 'src' / 'good.txt'}",
                  *(f"--arm={spec}" for spec, _ in bad.values()))
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"{len(bad)} of the {len(bad) + 1} arms cannot be used" in r.stderr
    for name, (_, words) in bad.items():
        assert f"arm {name}:" in r.stderr and words in r.stderr, name
    assert "BPE sample" not in r.stderr and "arm good" not in r.stderr.replace("arm good=", "")
    assert not (tmp_path / "new").exists()   # neither the run directory nor its parent


@pytest.mark.slow
def test_a_refused_restart_of_an_interrupted_creation_keeps_its_directory(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "proxy.log").write_text("an earlier attempt\n")
    r = run_proxy(run, "--tokenizer", "bytes", "--max-steps", "1",
                  f"--arm=x=text:{tmp_path / 'none.txt'}")
    assert r.returncode == 2 and "arm x:" in r.stderr
    assert (run / "logs" / "proxy.log").read_text().startswith("an earlier attempt")


def test_a_refused_start_in_a_directory_that_existed_leaves_only_its_log(tmp_path):
    """A start refused at the arm checks says "nothing was written", and in a directory the user
    made for the run it leaves no `.proxy.lock` or `.proxy.owner.json`; only logs/ with the
    attempt's log, from which `status` names the refusal."""
    run = tmp_path / "run"
    run.mkdir()
    r = run_proxy(run, "--tokenizer", "bytes", "--max-steps", "1",
                  f"--arm=x=text:{tmp_path / 'none.txt'}")
    assert r.returncode == 2 and "arm x:" in r.stderr and "nothing was written" in r.stderr
    assert run.is_dir() and sorted(p.name for p in run.iterdir()) == ["logs"]
    assert "arm x:" in (run / "logs" / "proxy.log").read_text()
