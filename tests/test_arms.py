"""Arms (docs/architecture.md#arms): text file/dir/glob, JSON Lines field and uint16 token sources
with a held-out split never trained on; zombie arms retired by name; bad bounds refused."""
import json

import numpy as np
import pytest

from proc_helpers import loss_records, run_proxy
from proxy.mixture.bandit import Bandit, BanditConfig
from proxy.mixture.rebuild import replay_run
from shared.data.token_files import heldout_ranges, heldout_size, read_arm_index
from shared.run.config import load_run_config, probe_plan
from shared.run.layout import RunLayout
from worker.data import UNIGRAM_SAMPLE_TOKENS, ArmSampler, unigram_table

PROSE = ("It was a bright cold day in April, and the clocks were striking thirteen. "
         "Winston Smith slipped quickly through the glass doors of Victory Mansions. ")


def make_sources(d):
    (d / "notes").mkdir(parents=True)
    (d / "notes" / "a.md").write_text(PROSE * 60)
    (d / "notes" / "b.md").write_text(PROSE.upper() * 60)
    (d / "single.txt").write_text("lorem ipsum dolor sit amet " * 400)
    with open(d / "chat.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"id": i, "content": f"message {i}: hello there, how are you?"}) + "\n")
        f.write("not json\n")
    n = 20_000
    toks = np.random.default_rng(0).integers(0, 200, n).astype(np.uint16)
    return toks


def test_the_unigram_table_counts_the_train_split_only_and_a_bounded_sample_of_a_large_arm(tmp_path):
    """docs/bandit.md#the-control-variate: -ln((c_t + 1) / (N + V)) over the train segments;
    held-out tokens are not counted; an arm past UNIGRAM_SAMPLE_TOKENS is counted on evenly
    spaced chunks (the same table every time, close to the whole arm's)."""
    toks = np.array([0, 1, 1, 2, 7, 7, 7, 2, 2, 2], dtype=np.uint16)
    got = unigram_table(toks, [(0, 4), (7, 10)], 8)      # tokens 4..6 (the 7s) held out
    c = np.array([1, 2, 4, 0, 0, 0, 0, 0], dtype=np.float64)
    np.testing.assert_array_equal(got, -np.log((c + 1) / (7 + 8)))
    assert unigram_table(toks, [(0, 10)], None).shape == (8,)  # V from the largest id
    n = UNIGRAM_SAMPLE_TOKENS * 3
    big = np.lib.format.open_memmap(tmp_path / "big.npy", "w+", np.uint16, (n,))
    rng = np.random.default_rng(0)
    big[:] = rng.choice(200, n, p=np.arange(1, 201) / np.arange(1, 201).sum())
    segments = [(0, n // 2), (n // 2 + 1000, n)]
    sampled = unigram_table(big, segments, 256)
    np.testing.assert_array_equal(sampled, unigram_table(big, segments, 256))
    whole = np.bincount(np.concatenate([big[a:b] for a, b in segments]), minlength=256)
    exact = -np.log((whole + 1.0) / (whole.sum() + 256))
    freq = whole / whole.sum()  # the mean unigram loss of the arm's tokens, sampled vs whole
    assert float(freq @ sampled) == pytest.approx(float(freq @ exact), abs=1e-3)
    assert np.abs(sampled[:200] - exact[:200]).max() > 0, "the large arm must be sampled"
    with pytest.raises(ValueError, match="pass vocab_size"):  # its ids past the sample's
        unigram_table(big, segments, None)                  # would index past the table


def test_each_rows_unigram_loss_is_its_targets_mean_under_its_own_arms_table(tmp_path):
    """Batch.unigram_loss: row i's mean of its arm's table over its targets y (not its first
    input token), per arm, for every rank's rows."""
    from shared.data.token_files import ArmData
    rng = np.random.default_rng(1)
    index = {}
    for name, hi in (("low", 10), ("high", 200)):
        t = rng.integers(0, hi, 5000).astype(np.uint16)
        t.tofile(tmp_path / f"{name}.bin")
        index[name] = ArmData(name, "tokens", "", "", f"{name}.bin", 5000, 4000,
                              heldout=[[4000, 5000]])
    sampler = ArmSampler(tmp_path, index, 16, 256)
    tables = {n: unigram_table(sampler.tokens[n], [(0, 4000)], 256) for n in ("high", "low")}
    for rank in (0, 1):
        b = sampler.draw(3, 7, {"low": 0.5, "high": 0.5}, 8, rank, 2)
        for i, row in enumerate(b.tokens.numpy()):
            n = sampler.names[b.arm_index[i]]
            assert b.unigram_loss[i] == pytest.approx(tables[n][row[1:]].mean(), rel=1e-12)
    assert len(set(b.arm_index)) == 2


@pytest.mark.slow
def test_every_source_kind_trains_with_a_held_out_split_that_is_never_drawn(tmp_path):
    src = tmp_path / "src"
    toks = make_sources(src)
    n = len(toks)
    from shared.run.config import PRESETS, RunConfig
    cfg = RunConfig(model=PRESETS["andrea-test"])
    hold = heldout_size(n, cfg)
    ranges = heldout_ranges(n, cfg)                         # spread over the arm
    assert len(ranges) > 1 and sum(b - a for a, b in ranges) == hold and ranges[-1][1] == n
    for a, b in ranges:
        toks[a:b] = 255                                     # marks the held-out split
    toks.tofile(src / "web.bin")
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "15", "--checkpoint-every", "15", "--probe-every", "5",
                  "--reward", "heldout_progress",
                  "--arm", f"dir=text:{src / 'notes'}", "--arm", f"glob=text:{src}/notes/*.md",
                  "--arm", f"file=text:{src / 'single.txt'}",
                  "--arm", f"chat=jsonl:{src / 'chat.jsonl'}:content",
                  "--arm", f"web=tokens:{src / 'web.bin'}")
    assert r.returncode == 0, r.stderr[-3000:]
    names = {"dir", "glob", "file", "chat", "web"}
    index = read_arm_index(RunLayout(run))
    assert set(index) == names
    assert all(a.fingerprint.startswith("sha256:") and a.source_fingerprint.startswith("stat:")
               for a in index.values())
    assert index["web"].heldout_ranges() == ranges and index["web"].n_tokens == n
    chat = bytes(np.asarray(index["chat"].tokens(run)[:40], dtype=np.uint8)).decode()
    assert chat.startswith("message 0: hello there") and "{" not in chat
    recs = loss_records(run)
    # five arms at batch 8: the probe's 1.5 % budget spaces it to every 15 steps (probe_plan)
    every = probe_plan(load_run_config(RunLayout(run).run_json)).every
    assert every == 15 and set(recs[every - 1]["probe"]) == names
    assert not any("probe" in x for x in recs[:every - 1])
    assert sum(sum(x["arms"].values()) for x in recs) == 8 * 15
    sampler = ArmSampler(run, index, 32)
    for k in range(1, 200):                                 # the held-out split is never drawn
        b = sampler.draw(1, k, {"web": 1.0}, 8)
        assert int(b.x.max()) < 255 and int(b.y.max()) < 255
    assert (sampler.heldout_windows("web", 8) == 255).all()


@pytest.mark.slow
def test_bad_bounds_and_unknown_arms_are_refused_before_the_run_is_created(tmp_path):
    for args, words in [(["--caps", "repo-code=0.1,python-docs=0.1,repo-docstrings=0.1"], "sum of caps"),
                        (["--floors", "repo-code=0.7,python-docs=0.7"], "sum of floors"),
                        (["--floors", "repo-code=0.5", "--caps", "repo-code=0.4"], "floor above cap"),
                        (["--caps", "nope=0.5"], "unknown arm 'nope'"),
                        (["--floors", "repo-code=-0.1"], "outside [0, 1]"),
                        (["--arm", "x=text:/does/not/exist*"], "matches no file")]:
        run = tmp_path / f"run{len(words)}"
        r = run_proxy(run, "--max-steps", "5", *args)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr[-1500:])
        assert not (run / "run.json").exists()


@pytest.mark.slow
def test_zombie_arm_is_reported_retired_by_name_and_never_pulled_again(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep.txt").write_text(PROSE * 80)
    (src / "gone.txt").write_text("lorem ipsum dolor sit amet " * 600)
    (src / "third.txt").write_text("the quick brown fox jumps over the lazy dog " * 400)
    run = tmp_path / "run"
    arms = ["--arm", f"keep=text:{src / 'keep.txt'}", "--arm", f"gone=text:{src / 'gone.txt'}",
            "--arm", f"third=text:{src / 'third.txt'}"]
    common = ["--checkpoint-every", "20", "--probe-every", "5", "--bandit-warmup", "5"]
    assert run_proxy(run, "--max-steps", "20", *common, *arms).returncode == 0
    (src / "gone.txt").unlink()
    (src / "third.txt").write_text("the quick brown fox jumps over the lazy dog " * 400)  # touched, same text
    r = run_proxy(run, "--max-steps", "40", *common, *arms)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "arm gone is a zombie: source gone" in r.stderr and "arm third is a zombie" not in r.stderr
    index = read_arm_index(RunLayout(run), include_retired=True)
    assert index["gone"].retired["step"] == 20 and index["third"].retired is None
    recs = loss_records(run)
    assert all(x["arms"].get("gone", 0) == 0 and "gone" not in (x.get("probe") or {}) for x in recs[20:])
    assert any(x["arms"].get("gone", 0) for x in recs[:20])
    state = json.loads((run / ".state.json").read_text())
    assert set(state["arms"]) == {"keep", "third"} and state["retired"]["gone"]["retired_at_step"] == 20
    assert state["retired"]["gone"]["pulls"] == sum(x["arms"].get("gone", 0) for x in recs[:20])
    layout = RunLayout(run)
    assert replay_run(layout, load_run_config(layout.run_json), 40).bandit.to_dict() == state
    # a third start does not report it again and keeps it retired
    r = run_proxy(run, "--max-steps", "45", *common, *arms)
    assert r.returncode == 0 and "is a zombie" not in r.stderr


@pytest.mark.slow
def test_relative_sources_survive_another_directory_and_a_zombie_re_joins_when_its_source_is_back(tmp_path):
    """--arm paths are stored absolute, so a resume from another directory (systemd's
    WorkingDirectory=) finds every arm; a start that would retire every arm is refused with
    nothing written; and a zombie whose source comes back as it was re-joins with its
    statistics, and the start-up table says which arms are retired."""
    import os
    import subprocess
    import sys

    from proc_helpers import ROOT, TINY
    src = tmp_path / "src"
    src.mkdir()
    (src / "keep.txt").write_text(PROSE * 80)
    (src / "away.txt").write_text("the quick brown fox jumps over the lazy dog " * 500)
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    common = ["--checkpoint-every", "20", "--probe-every", "5", "--bandit-warmup", "5"]

    def proxy(cwd, steps, *arms):
        return subprocess.run([sys.executable, "-m", "proxy", "run", "--run-dir", str(run), *TINY,
                               "--max-steps", str(steps), *common, *arms], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300)

    r = proxy(tmp_path, 20, "--arm", "keep=text:src/keep.txt", "--arm", "away=text:src/away.txt")
    assert r.returncode == 0, r.stderr[-3000:]
    layout = RunLayout(run)
    assert {a.source for a in read_arm_index(layout).values()} == {
        str(src / "keep.txt"), str(src / "away.txt")}
    other = tmp_path / "elsewhere"
    other.mkdir()
    r = proxy(other, 40)  # from another directory: the same files
    assert r.returncode == 0 and "zombie" not in r.stderr, r.stderr[-3000:]
    # every source gone: refused, nothing retired, the run resumes once they are back
    (src / "keep.txt").rename(tmp_path / "keep.off")
    (src / "away.txt").rename(tmp_path / "away.off")
    before = layout.arms_index.read_bytes()
    r = proxy(other, 60)
    assert r.returncode == 2 and "every arm this run trains on has lost its source" in r.stderr
    assert "nothing was retired" in r.stderr and layout.arms_index.read_bytes() == before
    (tmp_path / "keep.off").rename(src / "keep.txt")
    r = proxy(other, 60)  # `away` is still gone: a zombie from step 40
    assert r.returncode == 0 and "arm away is a zombie: source gone" in r.stderr, r.stderr[-3000:]
    r = proxy(other, 70)
    assert "retired: away" in r.stderr  # the start-up table does not list it as trained
    (tmp_path / "away.off").rename(src / "away.txt")  # back, same bytes, new mtime
    r = proxy(other, 100)
    assert r.returncode == 0 and "arm away re-joins with its statistics" in r.stderr, r.stderr[-3000:]
    recs = {x["step"]: x for x in loss_records(run)}
    assert all(recs[k]["arms"].get("away", 0) == 0 for k in range(41, 71))
    assert sum(recs[k]["arms"].get("away", 0) for k in range(71, 101)) > 0
    state = json.loads((run / ".state.json").read_text())
    assert set(state["arms"]) == {"keep", "away"} and not state.get("retired")
    assert state["arms"]["away"]["pulls_lifetime"] == sum(x["arms"].get("away", 0) for x in recs.values())
    assert replay_run(layout, load_run_config(layout.run_json), 100).bandit.to_dict() == state


def test_arm_statistics_are_keyed_by_name_whatever_the_order_or_set_of_arms():
    cfg = BanditConfig(warmup_steps=0)
    recs = [{"step": k, "phase_index": 0, "arms": {"a": 3, "b": 4, "c": 1},
             "p": {"a": 0.3, "b": 0.5, "c": 0.2}, "arm_loss": {"a": 2.0, "b": 3.0, "c": 1.0},
             "probe": {"a": 3 - k / 50, "b": 4 - k / 20, "c": 2 - k / 100} if k % 5 == 0 else None}
            for k in range(1, 61)]
    x, y = Bandit(["a", "b", "c"], None, None, cfg), Bandit(["c", "a", "b"], None, None, cfg)
    for r in recs:
        x.observe(r)
        y.observe(r)
    assert x.to_dict() == y.to_dict() and x.updates > 0
    before = x.to_dict()["arms"]
    x.retire("b", "source gone")
    after = x.to_dict()
    assert after["retired"]["b"]["pulls"] == before["b"]["pulls"]
    assert all(after["arms"][a]["pulls"] == before[a]["pulls"] for a in ("a", "c"))
    assert "b" not in x.probabilities()
    more = {"step": 61, "phase_index": 0, "arms": {"a": 5, "c": 3, "b": 0}, "p": {"a": 0.6, "c": 0.4}}
    x.observe(more)
    assert x.pulls["a"] == before["a"]["pulls"] + 5 and "b" not in x.pulls


@pytest.mark.slow
def test_a_token_file_changed_after_creation_stops_the_run_naming_the_file_and_restoring_it_resumes(tmp_path):
    """A token file cut short, or overwritten with ids outside the vocabulary: the worker stops
    at once (exit 3, no restart) naming the arm, the file and what is wrong, and nothing is
    trained on it; the restored file resumes the run."""
    run = tmp_path / "run"
    opts = ["--checkpoint-every", "5", "--sample-every", "5"]
    assert run_proxy(run, "--max-steps", "10", *opts).returncode == 0
    arm = read_arm_index(RunLayout(run))["python-docs"]
    path = arm.token_path(run)
    original = path.read_bytes()
    wrong = np.frombuffer(original, dtype=arm.dtype).copy()
    wrong[:] = np.iinfo(wrong.dtype).max        # same size, ids far outside the byte vocabulary
    for content, words in [(original[:len(original) // 3], "bytes, but data/arms.json records"),
                           (original + b"\0\0", "bytes, but data/arms.json records"),
                           (wrong.tobytes(), "outside the run's vocabulary of")]:
        path.write_bytes(content)
        r = run_proxy(run, "--max-steps", "20", *opts)
        assert r.returncode == 3, r.stderr[-3000:]
        assert str(path) in r.stderr and words in r.stderr and "'python-docs'" in r.stderr, r.stderr[-3000:]
        assert "restart 1" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert [x["step"] for x in loss_records(run)] == list(range(1, 11))
    path.write_bytes(original)
    assert run_proxy(run, "--max-steps", "20", *opts).returncode == 0
    assert [x["step"] for x in loss_records(run)] == list(range(1, 21))
