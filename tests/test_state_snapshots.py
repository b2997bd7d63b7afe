"""Fast resume of the bandit: a snapshot at a checkpoint plus the history's tail gives
exactly the state a replay from the phase start gives, and a rewind invalidates later snapshots."""

import json
import random

from proxy.mixture.controller import MixtureController
from proxy.mixture.rebuild import rebuild_mixture
from proxy.run_files.phases import Phase, write_phases
from proxy.run_files.state_snapshots import append_snapshot, find_snapshot, mark_rewound
from shared.data.token_files import ArmData, write_arm_index
from shared.run.config import RunConfig
from shared.run.layout import RunLayout
from shared.run.loss_history import LossHistory, iter_records, iter_records_after

ARMS = ["a", "b", "c"]


def _record(k, rng):
    counts = {x: 0 for x in ARMS}
    for _ in range(8):
        counts[rng.choice(ARMS)] += 1
    r = {
        "step": k,
        "loss": 3.0 + rng.random(),
        "arms": counts,
        "p": {x: 1 / 3 for x in ARMS},
        "arm_loss": {x: 3 + rng.random() for x in ARMS if counts[x]},
        "phase": {"label": "initial", "index": 0},
    }
    if k % 5 == 0:
        r["probe"] = {x: 3.0 - k * 1e-3 * (i + 1) + rng.random() * 0.01 for i, x in enumerate(ARMS)}
    return r


def _controller():
    """As proxy/mixture/rebuild.py new_controller builds it for _run_layout's arms (900 training
    tokens each, blocks of the default preset's 128)."""
    return MixtureController(
        ARMS,
        Phase(0, "initial", 0),
        "heldout_progress",
        20,
        5,
        epoch_size={x: 900 / 128 for x in ARMS},
    )


def _run_layout(tmp_path) -> RunLayout:
    """A run directory with what a rebuild reads: phases.json and data/arms.json."""
    layout = RunLayout(tmp_path)
    layout.arms_index.parent.mkdir(parents=True, exist_ok=True)
    write_phases(layout, [Phase(0, "initial", 0)])
    write_arm_index(
        layout,
        [
            ArmData(
                name=x,
                kind="tokens",
                source=f"{x}.u16",
                fingerprint="",
                path=f"data/{x}.u16",
                n_tokens=1000,
                heldout_start=900,
            )
            for x in ARMS
        ],
    )
    return layout


def _live_run(tmp_path, seed: int, steps: int, snapshot_every: int = 0):
    """A run directory whose history has `steps` records folded by a live controller (a
    snapshot appended every `snapshot_every` steps): (layout, cfg, live controller)."""
    rng = random.Random(seed)
    layout = _run_layout(tmp_path)
    cfg = RunConfig(reward="heldout_progress", bandit_warmup=20, probe_every=5)
    live = _controller()
    with LossHistory(layout.loss) as h:
        for k in range(1, steps + 1):
            r = _record(k, rng)
            h.append(r)
            live.observe(r)
            if snapshot_every and k % snapshot_every == 0:
                append_snapshot(layout, live.to_snapshot())
    return layout, cfg, live


def test_snapshot_plus_tail_equals_replay_from_the_phase_start(tmp_path):
    """rebuild_mixture (what every resume runs) gives the same controller from the newest
    snapshot at or before the step plus the tail as from the phase start."""
    layout, cfg, live = _live_run(tmp_path, 0, 400, snapshot_every=50)
    for resume in (50, 137, 300, 400):
        fast = rebuild_mixture(layout, cfg, resume, [])
        assert fast.snapshot_step == resume - resume % 50
        assert fast.replayed == resume % 50
        slow = rebuild_mixture(layout, cfg, resume, [], use_snapshots=False)
        assert slow.snapshot_step is None and slow.replayed == resume
        assert fast.mix.to_snapshot() == slow.mix.to_snapshot()
        assert fast.mix.bandit.to_dict() == slow.mix.bandit.to_dict()
    assert live.bandit.to_dict() == slow.mix.bandit.to_dict()
    assert live.bandit.updates > 0, "the bandit never updated: the test would prove nothing"


def test_rewind_marker_hides_snapshots_past_the_checkpoint_resumed(tmp_path):
    layout = RunLayout(tmp_path)
    c = _controller()
    for step in (100, 200, 300):
        c.folded_through = step
        append_snapshot(layout, c.to_snapshot())
    mark_rewound(layout, 150)
    assert find_snapshot(layout, 0, 0, 10_000)["step"] == 100
    c.folded_through = 200  # the run trained 151..200 again and checkpointed
    append_snapshot(layout, c.to_snapshot())
    assert find_snapshot(layout, 0, 0, 10_000)["step"] == 200
    assert find_snapshot(layout, 1, 0, 10_000) is None  # another phase
    with open(tmp_path / ".state.snapshots.jsonl", "ab") as f:
        f.write(b'{"step": 250, "phase_in')  # torn line from a kill
    assert find_snapshot(layout, 0, 0, 10_000)["step"] == 200


def test_snapshots_of_an_older_format_are_replayed_over_not_restored(tmp_path):
    """A snapshot written before the bandit state carried the repetition guard (no "format")
    would restore a bandit without it, and differ from a replay: rebuild_mixture skips it and
    replays from the phase start, so the result is the replay's exactly."""
    layout, cfg, live = _live_run(tmp_path, 2, 100)
    old = live.to_snapshot()
    del old["format"]
    del old["bandit"]["repetition"]
    append_snapshot(layout, old)
    assert find_snapshot(layout, 0, 0, 100) is None
    fast = rebuild_mixture(layout, cfg, 100, [])
    assert fast.snapshot_step is None and fast.replayed == 100
    assert (
        fast.mix.bandit.to_dict()
        == rebuild_mixture(layout, cfg, 100, [], use_snapshots=False).mix.bandit.to_dict()
    )
    # format 3: fits over the whole phase ({"n", "sx", ...}), no judgement of slow arms
    three = live.to_snapshot()
    three["format"] = 3
    three["bandit"]["trend"]["fits"] = {
        a: f["current"] for a, f in three["bandit"]["trend"]["fits"].items()
    }
    del three["bandit"]["trend"]["slow"]
    append_snapshot(layout, three)
    assert find_snapshot(layout, 0, 0, 100) is None
    assert rebuild_mixture(layout, cfg, 100, []).snapshot_step is None
    append_snapshot(layout, live.to_snapshot())  # the current format is used
    assert rebuild_mixture(layout, cfg, 100, []).snapshot_step == 100


def test_iter_records_after_matches_the_whole_file_reader(tmp_path):
    rng = random.Random(1)
    path = tmp_path / ".loss.json"
    with LossHistory(path) as h:
        h.append_many(_record(k, rng) for k in range(1, 3001))
    for after, end in ((0, None), (10, 20), (2999, None), (3000, None), (1500, 2900), (-5, 3)):
        want = [r for r in iter_records(path) if after < r["step"] <= (end or 3000)]
        assert list(iter_records_after(path, after, end)) == want


def test_snapshot_file_stays_bounded_by_the_checkpoints_on_disk(tmp_path):
    """Hundreds of checkpoints, retention keeping a few: the file is compacted to the snapshots
    of checkpoints still on disk (plus the newest), a rewind marker still hides what it hid, and
    a resume from a kept checkpoint still finds its own snapshot."""
    from proxy.run_files.state_snapshots import COMPACT_AT, compact
    from shared.checkpoint.file_format import checkpoint_name

    layout = RunLayout(tmp_path)
    c = _controller()
    kept = {1000, 2000, 2900, 3000}
    for step in range(10, 3001, 10):
        c.folded_through = step
        if step in kept:
            (tmp_path / checkpoint_name(step)).write_bytes(b"")  # names are what retention keeps
        append_snapshot(layout, c.to_snapshot())
        if step == 2500:
            mark_rewound(layout, 2400)  # snapshots 2410..2500 no longer describe the run
        lines = RunLayout(tmp_path).state_snapshots.read_bytes().count(b"\n")
        assert lines <= COMPACT_AT + 1, (step, lines)
    compact(layout, at=0)  # what the next compaction leaves
    assert find_snapshot(layout, 0, 0, 3000)["step"] == 3000
    assert find_snapshot(layout, 0, 0, 2999)["step"] == 2900
    assert find_snapshot(layout, 0, 0, 2000)["step"] == 2000
    assert find_snapshot(layout, 0, 0, 1999)["step"] == 1000
    steps = [
        json.loads(x)["step"]
        for x in RunLayout(tmp_path).state_snapshots.read_text().splitlines()
        if "rewound_to" not in x
    ]
    assert not any(2400 < s <= 2500 for s in steps)  # the marker's effect survived compaction
    assert steps == [1000, 2000, 2900, 3000]


def test_a_format_4_snapshot_without_the_control_variate_flag_is_replayed_over(tmp_path):
    """Format 4 snapshots predate `trend.control_variate`: restoring one could not know whether
    the phase's fits use the unigram difference, and guessing made a resume differ from a
    replay. They are skipped (the phase replayed), and a current-format line whose flag is
    missing or not a bool is passed over with a warning, never restored: the result is the
    replay's exactly."""
    layout, cfg, live = _live_run(tmp_path, 3, 100)
    replay = rebuild_mixture(layout, cfg, 100, [], use_snapshots=False).mix.bandit.to_dict()
    old = live.to_snapshot()
    old["format"] = 4
    del old["bandit"]["trend"]["control_variate"]
    append_snapshot(layout, old)
    assert rebuild_mixture(layout, cfg, 100, []).snapshot_step is None
    for bad in ("missing", "false", {"x": 1}, 0):
        snap = live.to_snapshot()
        if bad == "missing":
            del snap["bandit"]["trend"]["control_variate"]
        else:
            snap["bandit"]["trend"]["control_variate"] = bad
        append_snapshot(layout, snap)
        fast = rebuild_mixture(layout, cfg, 100, [])
        assert fast.snapshot_step is None and fast.replayed == 100, bad
        assert fast.mix.bandit.to_dict() == replay, bad


def test_a_record_with_a_per_arm_field_of_the_wrong_type_names_the_file_and_step(tmp_path):
    """A hand-edited `.loss.json` record whose arm_loss, arm_unigram_loss, p, arms or probe is
    not a mapping {arm: number}, or whose phase has no integer index: the rebuild
    raises HistoryRecordError naming the file, the step and the field, never an
    AttributeError from deep in the bandit."""
    import pytest

    from proxy.mixture.rebuild import HistoryRecordError

    for field, value in [
        ("arm_unigram_loss", [1, 2]),
        ("arm_loss", "3.0"),
        ("p", 0.5),
        ("arms", [3, 5]),
        ("probe", [2.0]),
        ("phase", {"index": "zero"}),
    ]:
        d = tmp_path / field
        layout, cfg, _ = _live_run(d, 4, 60)
        recs = list(iter_records(layout.loss))
        recs[39][field] = value
        layout.loss.unlink()
        with LossHistory(layout.loss) as h:
            h.append_many(recs)
        with pytest.raises(HistoryRecordError) as e:
            rebuild_mixture(layout, cfg, 60, [], use_snapshots=False)
        msg = str(e.value)
        assert str(layout.loss) in msg and "step 40" in msg, msg
        assert field in msg, msg
