"""A run restarted with its arms reordered, removed or added keeps each arm's statistics by name
(docs/architecture.md#arms): `run --arm ...` on a restart is the new arm list; the arm-change log
in data/arms.json makes replays reproduce .state.json across the changes."""
import json
import random
import subprocess
import sys

import pytest

from proc_helpers import ROOT, loss_records, run_proxy
from proxy.mixture.arm_changes import ArmChange, read_changes
from proxy.mixture.controller import MixtureController
from proxy.mixture.rebuild import replay_run
from proxy.run_files.phases import Phase
from shared.data.token_files import read_arm_index
from shared.run.config import load_run_config
from shared.run.layout import RunLayout

# the probe policy (heldout_progress): these tests follow each arm's probe rewards by name
COMMON = ["--checkpoint-every", "10", "--probe-every", "5", "--bandit-warmup", "5",
          "--reward", "heldout_progress"]
TEXTS = {"a": "It was a bright cold day in April, and the clocks were striking thirteen. " * 60,
         "b": "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 90,
         "c": "the quick brown fox jumps over the lazy dog; " * 110,
         "d": "0123456789 " * 450}


def _sources(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for n, t in TEXTS.items():
        (src / f"{n}.txt").write_text(t)
    return lambda *names: [x for n in names for x in ("--arm", f"{n}=text:{src / (n + '.txt')}")]


def _state(run):
    return json.loads((run / ".state.json").read_text())


def _pulls(recs, arm, upto=None):
    return sum(r["arms"].get(arm, 0) for r in recs if upto is None or r["step"] <= upto)


@pytest.mark.slow
def test_reorder_remove_add_and_rejoin_keep_each_arms_statistics_by_name(tmp_path):
    arms = _sources(tmp_path)
    run = tmp_path / "run"
    layout = RunLayout(run)
    r = run_proxy(run, "--max-steps", "20", *COMMON, *arms("a", "b", "c"))
    assert r.returncode == 0, r.stderr[-3000:]
    before = _state(run)

    # reordered: nothing changes; the statistics at the resume point are the same by name
    r = run_proxy(run, "--max-steps", "30", *COMMON, *arms("c", "a", "b"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_changes(layout) == [] and "rebuilt by replaying" not in r.stderr
    recs = loss_records(run)
    assert all(_state(run)["arms"][n]["pulls_lifetime"] == _pulls(recs, n) for n in "abc")
    assert all(before["arms"][n]["pulls"] == _pulls(recs, n, 20) for n in "abc")

    # b removed, d added: b retired at 30 with its statistics, d joins fresh, a and c go on
    r = run_proxy(run, "--max-steps", "50", *COMMON, *arms("a", "c", "d"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "arm d added" in r.stderr and "arm b removed" in r.stderr
    assert [x.name for x in load_run_config(layout.run_json).arms] == ["a", "c", "d"]
    index = read_arm_index(layout, include_retired=True)
    assert index["b"].retired["step"] == 30 and index["d"].retired is None
    assert [(c.step, c.action, c.arm) for c in read_changes(layout)] == [(30, "add", "d"),
                                                                        (30, "retire", "b")]
    recs = loss_records(run)
    assert [r["step"] for r in recs] == list(range(1, 51))
    late = [x for x in recs if x["step"] > 30]
    assert all(x["arms"].get("b", 0) == 0 and "b" not in x["p"] for x in late)
    assert sum(x["arms"].get("d", 0) for x in late) > 0
    assert all(set(x["probe"]) == {"a", "c", "d"} for x in late if x.get("probe"))
    st = _state(run)
    assert set(st["arms"]) == {"a", "c", "d"} and st["step"] == 50
    assert st["retired"]["b"]["retired_at_step"] == 30
    assert st["retired"]["b"]["pulls_lifetime"] == _pulls(recs, "b")
    assert st["added"]["d"]["step"] == 30 and not st["added"]["d"]["rejoined"]
    for n in ("a", "c", "d"):                        # every arm's counts run on across the restart
        assert st["arms"][n]["pulls_lifetime"] == _pulls(recs, n), n
    assert st["arms"]["d"]["ema_n"] > 0              # d earned rewards after its first probe
    assert replay_run(layout, load_run_config(layout.run_json), 50).bandit.to_dict() == st
    # the proxy's loss EMA (progress line, .status.json) carries across restarts as `status`'s
    from proxy.run_files.loss_ema import loss_ema
    from shared.run.loss_history import tail_records
    assert abs(json.loads((run / ".status.json").read_text())["loss_ema"]
               - loss_ema(tail_records(layout.loss))) < 1e-6

    # b listed again: it re-joins with its statistics (same phase: pulls, EMA, probe baseline)
    r = run_proxy(run, "--max-steps", "70", *COMMON, *arms("a", "b", "c", "d"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "arm b re-joins" in r.stderr
    recs = loss_records(run)
    st = _state(run)
    assert set(st["arms"]) == {"a", "b", "c", "d"} and "b" not in st["retired"]
    assert st["added"]["b"]["rejoined"] and st["added"]["b"]["step"] == 50
    assert st["arms"]["b"]["pulls_lifetime"] == _pulls(recs, "b")
    assert st["arms"]["b"]["pulls"] == _pulls(recs, "b") > _pulls(recs, "b", 50)
    assert replay_run(layout, load_run_config(layout.run_json), 70).bandit.to_dict() == st
    # the snapshot cache and a full replay agree after the changes too
    (run / ".state.snapshots.jsonl").unlink()
    assert run_proxy(run, "--max-steps", "70", *COMMON).returncode == 0


@pytest.mark.slow
def test_bad_arm_lists_on_a_restart_are_refused_and_nothing_is_written(tmp_path):
    arms = _sources(tmp_path)
    src = tmp_path / "src"
    run = tmp_path / "run"
    r = run_proxy(run, "--max-steps", "10", *COMMON, "--caps", "a=0.5,b=0.4,c=0.3",
                  *arms("a", "b", "c"))
    assert r.returncode == 0, r.stderr[-3000:]
    (src / "tiny.txt").write_text("too small")
    files = {p: p.read_bytes() for p in (run / "run.json", run / "data" / "arms.json",
                                         run / "data" / "a.u16")}
    cases = [(arms("a", "c"), "sum of caps"),                     # 0.5 + 0.3 cannot hold a batch
             (arms("a", "b", "c") + ["--arm", f"./a=text:{src / 'd.txt'}"], "is not allowed"),
             (arms("a", "b", "c") + ["--arm", f"../../x=text:{src / 'd.txt'}"], "is not allowed"),
             (arms("a", "b", "c", "d") + ["--arm", f"e=text:{src / 'tiny.txt'}"], "too small"),
             (["--arm", f"a=text:{src / 'd.txt'}", *arms("b", "c")], "cannot change under the same name"),
             (arms("a", "b", "c") + ["--arm", f"e=text:{src / 'missing.txt'}"], "matches no file"),
             (arms("a", "b", "c", "c"), "more than once")]
    listing = sorted(x.name for x in (run / "data").iterdir())
    assert {"a.u16", "arms.json", "b.u16", "c.u16", "a.done.json"} <= set(listing)
    for args, words in cases:
        r = run_proxy(run, "--max-steps", "20", *COMMON, *args)
        assert r.returncode == 2 and words in r.stderr, (args, r.stderr[-2000:])
        assert {p: p.read_bytes() for p in files} == files
        assert sorted(x.name for x in (run / "data").iterdir()) == listing
        assert not list(tmp_path.glob("*.u16"))
    assert loss_records(run)[-1]["step"] == 10


@pytest.mark.slow
def test_an_active_arm_missing_from_run_json_is_still_retired_when_left_out(tmp_path):
    """A proxy killed between the two writes of a change (data/arms.json, then run.json) leaves
    an active arm that run.json does not list; leaving it out of --arm must still retire it."""
    arms = _sources(tmp_path)
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "10", *COMMON, *arms("a", "b")).returncode == 0
    assert run_proxy(run, "--max-steps", "20", *COMMON, *arms("a", "b", "d")).returncode == 0
    cfg = json.loads((run / "run.json").read_text())
    cfg["arms"] = [x for x in cfg["arms"] if x["name"] != "d"]   # as if killed before run.json
    (run / "run.json").write_text(json.dumps(cfg))
    r = run_proxy(run, "--max-steps", "30", *COMMON, *arms("a", "b"))
    assert r.returncode == 0 and "arm d removed" in r.stderr, r.stderr[-3000:]
    assert read_arm_index(RunLayout(run), include_retired=True)["d"].retired["step"] == 20
    assert all(x["arms"].get("d", 0) == 0 for x in loss_records(run)[20:])


def test_bad_arm_names_are_refused_by_name():
    import pytest

    from shared.data.arms import parse_arm_option
    from shared.run.config import ConfigError
    for bad in ("./a", "../x", "x/y", ".hidden", "a b", "a..b", "x" * 65):
        with pytest.raises(ConfigError, match="is not allowed"):
            parse_arm_option(f"{bad}=text:/tmp/x.txt")
    assert parse_arm_option("web-2.v1_b=text:/tmp/x.txt").name == "web-2.v1_b"


@pytest.mark.slow
def test_a_rejoining_arm_whose_source_changed_is_refused(tmp_path):
    arms = _sources(tmp_path)
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "10", *COMMON, *arms("a", "b")).returncode == 0
    assert run_proxy(run, "--max-steps", "20", *COMMON, *arms("a")).returncode == 0
    (tmp_path / "src" / "b.txt").write_text("a different text altogether " * 100)
    r = run_proxy(run, "--max-steps", "30", *COMMON, *arms("a", "b"))
    assert r.returncode == 2 and "cannot bring arm b back: source changed" in r.stderr, r.stderr[-2000:]


# ------------------------------------------------------------------------ controller level

ARMS = ["a", "b", "c", "d"]


def _record(k, rng, active):
    counts = {x: 0 for x in active}
    for _ in range(8):
        counts[rng.choice(sorted(active))] += 1
    r = {"step": k, "arms": counts, "p": {x: 1 / len(active) for x in active},
         "arm_loss": {x: 3 + rng.random() for x in active if counts[x]},
         "phase": {"label": "initial", "index": 0}}
    if k % 5 == 0:
        r["probe"] = {x: 3.0 - k * 1e-3 * (i + 1) + rng.random() * 0.01
                      for i, x in enumerate(sorted(active))}
    return r


def test_changes_apply_at_their_step_whether_rebuilt_from_a_snapshot_or_replayed():
    """Live: the controller runs without knowing the changes, is snapshotted at each change step
    and restored with the log (what a restart does). Replay: one controller with the whole log
    from the phase start. Both end bit-identical, and each arm's counts follow its name."""
    changes = [ArmChange(0, 20, "add", "d", "added"), ArmChange(1, 20, "retire", "b", "removed"),
               ArmChange(2, 40, "add", "b", "back"), ArmChange(3, 40, "retire", "a", "removed")]
    rng = random.Random(1)
    active, recs = {"a", "b", "c"}, []
    for k in range(1, 61):
        if k == 21:
            active = {"a", "c", "d"}
        if k == 41:
            active = {"b", "c", "d"}
        recs.append(_record(k, rng, active))

    def controller(log, names=ARMS):
        return MixtureController(names, Phase(0, "initial", 0), "heldout_progress", 5, 5, log)

    live = controller([], ["a", "b", "c"])           # d does not exist yet
    for r in recs:
        if r["step"] in (21, 41):                    # a restart at step 20 / 40
            snap = json.loads(json.dumps(live.to_snapshot()))
            live = controller([c for c in changes if c.step < r["step"]])
            live.restore(snap)
            live.apply_changes(r["step"] - 1)
        live.observe(r)
    replayed = controller(changes)
    for r in recs:
        replayed.observe(r)
    assert live.bandit.to_dict() == replayed.bandit.to_dict()
    st = replayed.bandit.to_dict()
    assert set(st["arms"]) == {"b", "c", "d"} and set(st["retired"]) == {"a"}
    assert st["arms"]["b"]["pulls"] == _pulls(recs, "b") and st["added"]["b"]["rejoined"]
    assert st["retired"]["a"]["pulls"] == _pulls(recs, "a")
    assert all(x in live.policies[v] for v in live.policies if v * 5 + 1 > 40 for x in "bcd")
    # before its join, d is absent: a controller built at step 10 has only a, b, c
    early = controller(changes)
    for r in recs[:10]:
        early.observe(r)
    assert early.bandit.arms == ["a", "b", "c"]


def test_an_arm_rejoining_after_a_pivot_starts_as_an_average_arm_with_its_lifetime_pulls():
    """b left at step 10, a pivot started phase 1 at 20 (b had p = 0 in its prior), b re-joins
    at 30: it keeps its lifetime pulls but not phase-0 statistics, and is not starved."""
    changes = [ArmChange(0, 10, "retire", "b", "removed"), ArmChange(1, 30, "add", "b", "back")]
    phase = Phase(1, "v2", 20, prior={"a": 0.4, "c": 0.6}, lifetime_pulls={"a": 90, "b": 70, "c": 80})
    mix = MixtureController(["a", "b", "c"], phase, "heldout_progress", 5, 5, changes)
    assert mix.bandit.arms == ["a", "c"] and mix.bandit.retired["b"]["pulls_lifetime"] == 70
    rng = random.Random(2)
    for k in range(21, 31):
        mix.observe(_record(k, rng, {"a", "c"}) | {"phase": {"label": "v2", "index": 1}})
    mix.apply_changes(30)
    p = mix.bandit.probabilities()
    assert mix.bandit.arms == ["a", "b", "c"] and 0.2 < p["b"] < 0.5, p
    assert mix.bandit.pulls_lifetime["b"] == 70 and mix.bandit.pulls["b"] == 0


@pytest.mark.slow
def test_an_audit_fork_has_the_arms_of_its_checkpoint(tmp_path):
    import subprocess
    import sys

    from proc_helpers import ROOT
    arms = _sources(tmp_path)
    run = tmp_path / "run"
    assert run_proxy(run, "--max-steps", "20", *COMMON, *arms("a", "b", "c")).returncode == 0
    assert run_proxy(run, "--max-steps", "30", *COMMON, *arms("a", "c", "d")).returncode == 0
    # the restart from step 20 changed the arms at 20: a fork from 20 has the arms that trained
    # steps 1..20, a fork from 30 those of steps 21..30
    for at, active, retired in ((20, {"a", "b", "c"}, set()), (30, {"a", "c", "d"}, {"b"})):
        fork = tmp_path / f"fork{at}"
        r = subprocess.run([sys.executable, "-m", "proxy", "fork", "--from", f"{run}:{at}",
                            "--run-dir", str(fork)], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        layout = RunLayout(fork)
        assert set(read_arm_index(layout)) == active
        assert {x.name for x in load_run_config(layout.run_json).arms} == active
        r = run_proxy(fork, "--max-steps", str(at + 10), *COMMON)
        assert r.returncode == 0, r.stderr[-3000:]
        st = _state(fork)
        assert set(st["arms"]) == active and set(st["retired"]) == retired
        assert set(st["added"]) == ({"d"} if at == 30 else set())
        assert all(set(x["p"]) == active for x in loss_records(fork)[at:])


@pytest.mark.slow
def test_falling_back_to_before_a_pivot_drops_that_phase_for_good(tmp_path):
    """The newest checkpoints are corrupt and the resume lands before a pivot: the pivot's
    phase never happened, so phases.json must lose it (else a later restart jumps into it and
    replay no longer matches .state.json)."""
    arms = _sources(tmp_path)
    run = tmp_path / "run"
    keep = ["--keep-last", "10"]
    assert run_proxy(run, "--max-steps", "20", *COMMON, *keep, *arms("a", "b")).returncode == 0
    r = subprocess.run([sys.executable, "-m", "proxy", "pivot", "--run-dir", str(run), "--caps",
                        "a=0.6", "--label", "v2", "--max-steps", "40"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]                # a stopped-run pivot at step 20
    r = run_proxy(run, "--max-steps", "40", *COMMON, *keep)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p["start_step"] for p in json.loads((run / "phases.json").read_text())["phases"]] == [0, 20]
    for s in (20, 30, 40):                                   # corrupt: resume falls back to 10
        f = run / f"step_{s:06d}.bin"
        b = bytearray(f.read_bytes())
        b[-1] ^= 0xFF
        f.write_bytes(bytes(b))
    r = run_proxy(run, "--max-steps", "40", *COMMON, *keep)
    assert r.returncode == 0 and "before the start of phase(s) 1 'v2'" in r.stderr, r.stderr[-3000:]
    assert [p["start_step"] for p in json.loads((run / "phases.json").read_text())["phases"]] == [0]
    r = run_proxy(run, "--max-steps", "50", *COMMON, *keep)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = loss_records(run)
    assert [x["step"] for x in recs] == list(range(1, 51))
    assert all(x["phase"]["index"] == 0 for x in recs)
    layout = RunLayout(run)
    assert replay_run(layout, load_run_config(layout.run_json), 50).bandit.to_dict() == _state(run)


def test_a_change_inside_a_period_reposts_the_policy_in_progress():
    """A restart from a checkpoint in the middle of a policy period: the rest of that period must
    be drawn without a retired arm (p summing to 1 over the arms left), not from the policy
    posted before the change."""
    changes = [ArmChange(0, 22, "retire", "b", "removed"), ArmChange(1, 22, "add", "d", "added")]
    mix = MixtureController(ARMS, Phase(0, "initial", 0), "heldout_progress", 5, 5, changes)
    rng = random.Random(3)
    for k in range(1, 23):
        mix.observe(_record(k, rng, {"a", "b", "c"}))
    mix.apply_changes(22)
    pol = mix.policies_from(0)
    current = pol[str((23 - 1) // 5)]                       # the period of step 23
    assert current["first_step"] <= 23 and set(current["p"]) == {"a", "c", "d"}
    assert abs(sum(current["p"].values()) - 1) < 1e-12


def test_default_arms_can_be_named_one_by_one():
    from shared.data.arms import parse_arm_option
    from shared.run.config import DEFAULT_ARMS
    assert [parse_arm_option(f"{a.name}={a.kind}") for a in DEFAULT_ARMS] == list(DEFAULT_ARMS)


def test_a_pending_change_is_not_applied_before_it_is_stamped():
    """Between `run --arm` recording a change and the start that stamps it (step null), a
    replay must describe the run as it was: the pending new arm is not in the bandit yet."""
    changes = [ArmChange(0, None, "add", "d", "added"), ArmChange(1, None, "retire", "b", "gone")]
    mix = MixtureController(ARMS, Phase(0, "initial", 0), "heldout_progress", 5, 5, changes)
    rng = random.Random(4)
    for k in range(1, 11):
        mix.observe(_record(k, rng, {"a", "b", "c"}))
    mix.apply_changes(10)
    assert mix.bandit.arms == ["a", "b", "c"] and not mix.bandit.retired and not mix.bandit.added


@pytest.mark.slow
def test_a_repetitive_arm_is_held_at_its_post_warmup_share_in_a_real_run(tmp_path):
    """docs/bandit.md#the-repetition-guard end to end: creation measures each arm's compression
    ratio into data/arms.json and names the repetitive one; from the first record after the
    warm-up the bandit holds that arm at or below its share then, every record's p obeys it,
    `.state.json` carries the hold, `status` shows it, and a replay of `.loss.json` gives the
    same state (also across a resume)."""
    src = tmp_path / "src"
    src.mkdir()
    words = ["region", "value", "entry", "table", "field", "option"]
    (src / "trap.txt").write_text("".join(f"- item {i % 50}: " + " ".join([words[i % 6]] * 3) + "\n"
                                          for i in range(2000)))
    prose = src / "prose.txt"
    prose.write_text("\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))[:60000])
    code = src / "code.txt"
    code.write_text("\n".join(p.read_text() for p in sorted((ROOT / "proxy").glob("*.py")))[:60000])
    arms = ["--arm", f"trap=text:{src / 'trap.txt'}", "--arm", f"prose=text:{prose}",
            "--arm", f"code=text:{code}"]
    run = tmp_path / "run"
    layout = RunLayout(run)
    r = run_proxy(run, "--max-steps", "20", *COMMON, "--bandit-warmup", "10", *arms)
    assert r.returncode == 0, r.stderr[-3000:]
    index = read_arm_index(layout)
    assert index["trap"].compression >= 20 > max(index["prose"].compression, index["code"].compression)
    assert "arm trap" in r.stderr and "repetitive, the bandit will not raise its share" in r.stderr
    r = run_proxy(run, "--max-steps", "40", *COMMON, "--bandit-warmup", "10", *arms)  # a resume
    assert r.returncode == 0, r.stderr[-3000:]
    st = _state(run)
    rep = st["repetition"]
    assert rep["decided"] and set(rep["held"]) == {"trap"}
    recs = loss_records(run)
    start = next(x["p"]["trap"] for x in recs if x["step"] == 11)
    assert rep["held"]["trap"] == pytest.approx(start)
    assert all(x["p"]["trap"] <= rep["held"]["trap"] + 1e-12 for x in recs if x["step"] > 10)
    assert st["version"] > 0  # the bandit did update
    assert replay_run(layout, load_run_config(layout.run_json), 40).bandit.to_dict() == st
    out = subprocess.run([sys.executable, "-m", "proxy", "status", "--run-dir", str(run)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "trap: p=" in out.stdout and "(repetitive)" in out.stdout, out.stdout
