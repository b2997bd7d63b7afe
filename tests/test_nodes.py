"""Several nodes, one run (docs/architecture.md#several-nodes): two `python -m proxy run --nnodes 2`
launches on one machine stand in for two nodes (static rendezvous on 127.0.0.1, gloo, CPU), with
real signals and real files. The first tests start no worker (refusals before anything is
written, a few seconds each); the others train andrea-test. All are in the slow tier.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import psutil
import pytest

from proc_helpers import (
    ROOT,
    TINY,
    _env,
    assert_same_run,
    checkpoint_steps,
    clone,
    cmd,
    create_template,
    last_step,
    loss_records,
    manifest,
    run_processes,
    wait_for,
)
from worker.signals import USR1_BURST_S

STDLIB = Path(sysconfig.get_paths()["stdlib"])
ARMS = ["--arm", f"argparse=text:{STDLIB / 'argparse.py'}",
        "--arm", f"typing=text:{STDLIB / 'typing.py'}"]
FINAL = 24
PLAN = ["--max-steps", str(FINAL), "--checkpoint-every", "10", "--probe-every", "5",
        "--warmup-steps", "5", "--bandit-warmup", "0"]


def beacon_port(run) -> int:
    """The endpoint's port (the job beacon's): one per test directory, so tests run side by
    side (pytest-xdist) never meet."""
    return 20000 + zlib.crc32(str(Path(run).parent).encode()) % 20000


def node_cmd(run, *args, nnodes="2", rdzv_id="job1"):
    """One node's command."""
    return [*cmd(run, *args), "--nnodes", nnodes, "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{beacon_port(run)}", "--rdzv-id", rdzv_id]


def launch(run, name, *args, env=None, **kw) -> subprocess.Popen:
    """One node's `proxy run`; its output goes to run/../<name>.out."""
    out = open(Path(run).parent / f"{name}.out", "ab")
    return subprocess.Popen(node_cmd(run, *args, **kw), cwd=ROOT, env=_env(env), stdout=out,
                            stderr=subprocess.STDOUT)


def out(run, name) -> str:
    p = Path(run).parent / f"{name}.out"
    return p.read_text(errors="replace") if p.exists() else ""


def records(run) -> dict[str, dict]:
    d = Path(run) / ".nodes"
    return {p.name: json.loads(p.read_text()) for p in d.glob("*.json") if p.name != "job.json"} \
        if d.is_dir() else {}


def node_of(run, proc) -> dict:
    return next((r for r in records(run).values() if r.get("pid") == proc.pid), {})


def hello(run) -> dict:
    try:
        return json.loads((Path(run) / ".handshake.json").read_text()).get("worker") or {}
    except (OSError, ValueError):
        return {}


def rank0_pid(run) -> int | None:
    return hello(run).get("pid")


def paused(run, step) -> bool:
    """A rank is in the test pause of update `step` (worker/fault_injection.py's marker)."""
    return (Path(run) / f".test-pause-{step}").exists()


def tree(proc) -> set[int]:
    try:
        return {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def training(run, procs, step):
    """Every node's ranks announced and the history past `step`."""
    return last_step(run) > step and all(node_of(run, p).get("ranks") for p in procs)


def reap(*procs, run=None):
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(30)
    if run is not None:
        for pid in run_processes(run):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------- the node files (fast)

def test_followers_take_the_lowest_free_node_rank_and_one_too_many_is_refused(tmp_path):
    from proxy.supervision.nodes import NodeRecord, NodeSetupError, assign_node_rank
    from shared.run.layout import RunLayout
    layout = RunLayout(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()

    def record(rank, pid, token="tok"):  # another node's proxy (on this host: checked by pid)
        r = NodeRecord(layout, "follower", rank, token, 1)
        r.pid, r.path = pid, r.path.with_name(f"{r.host}-{pid}.json")
        r.write()

    record(1, os.getppid())          # alive
    record(2, dead.pid)              # its proxy is gone: rank 2 is free again
    record(2, 1, "another-job")     # alive (pid 1), but of another job
    me = assign_node_rank(layout, "tok", 3, 1)
    assert me.node_rank == 2, "a dead follower's rank, or another job's, is free"
    with pytest.raises(NodeSetupError, match="already has its 3 nodes .* one too many"):
        assign_node_rank(layout, "tok", 3, 1)


def test_of_two_followers_that_took_one_node_rank_at_once_the_later_moves(tmp_path):
    """Where `.nodes/.lock` is not shared between hosts, two followers can take one node rank;
    the owner gathers only distinct ranks, and the later joiner moves to a free one."""
    import time

    from proxy.supervision.nodes import NodeRecord, NodeSetupError, wait_for_followers
    from shared.run.layout import RunLayout
    layout = RunLayout(tmp_path)
    first = NodeRecord(layout, "follower", 1, "tok", 1)
    first.pid, first.path = os.getppid(), first.path.with_name(f"{first.host}-{os.getppid()}.json")
    first.write(nnodes=3)
    later = NodeRecord(layout, "follower", 1, "tok", 1)  # this process, joined later
    later.write(nnodes=3)
    with pytest.raises(NodeSetupError):
        wait_for_followers(layout, "tok", 3, timeout=0.2)  # ranks 1 and 1: not gathered
    later.start_heartbeat()
    end = time.monotonic() + 30
    while later.node_rank == 1 and time.monotonic() < end:
        time.sleep(0.05)
    assert later.node_rank == 2 and first.node_rank == 1
    assert sorted(r["node_rank"] for r in wait_for_followers(layout, "tok", 3, 30)) == [1, 2]
    later.leave()


def test_the_rendezvous_deadline_names_the_node_ranks_that_never_joined(tmp_path):
    from proxy.supervision.nodes import NodeSetupError, assign_node_rank, wait_for_followers
    from shared.run.layout import RunLayout
    layout = RunLayout(tmp_path)
    assign_node_rank(layout, "tok", 4, 1)  # node rank 1 (this process)
    with pytest.raises(NodeSetupError, match=r"node rank\(s\) 2, 3 of --nnodes 4 never joined"):
        wait_for_followers(layout, "tok", 4, timeout=0.2)
    assert len(wait_for_followers(layout, "tok", 2, timeout=0.2)) == 1


def test_the_store_is_served_at_the_endpoint_host_only_when_it_is_this_machine():
    import socket

    from proxy.supervision.nodes import store_address
    assert store_address("127.0.0.1:29400") == "127.0.0.1"
    assert store_address("192.0.2.7:29400") == socket.gethostname()  # TEST-NET-1: not ours
    assert store_address(None) == socket.gethostname()


def test_a_node_record_keeps_beating_while_its_proxy_is_busy(tmp_path):
    """Other hosts judge a node by its heartbeat; the owner's main thread may be busy for
    minutes (creating the run, replaying the history), so a thread keeps the record fresh."""
    import time

    from proxy.supervision.nodes import NodeRecord, node_records, record_alive
    from shared.run.layout import RunLayout
    rec = NodeRecord(RunLayout(tmp_path), "owner", 0, "tok", 1)
    rec.write()
    first = node_records(RunLayout(tmp_path))[0]["heartbeat"]
    rec.start_heartbeat()
    end = time.monotonic() + 60  # busy (a loaded machine may run the thread late, never not)
    while node_records(RunLayout(tmp_path))[0]["heartbeat"] <= first and time.monotonic() < end:
        time.sleep(0.05)
    assert node_records(RunLayout(tmp_path))[0]["heartbeat"] > first
    rec.leave()
    assert not record_alive(node_records(RunLayout(tmp_path))[0]), "a node that left is gone"


def test_the_job_beacon_tells_a_second_owner_of_the_same_job_apart(tmp_path):
    from proxy.supervision.beacon import second_owner, serve
    from proxy.supervision.nodes import free_port
    endpoint = f"127.0.0.1:{free_port('127.0.0.1')}"
    me = {"rdzv_id": "j", "token": "mine", "run_dir": str(tmp_path), "host": "h2", "pid": 8}
    assert second_owner(endpoint, me, tmp_path) == (None, False), "nobody listening"
    b = serve(endpoint, {"rdzv_id": "j", "token": "first", "run_dir": "/shared/run",
                         "host": "h", "pid": 7})
    assert b is not None
    assert serve(endpoint, {"token": "x"}) is None, "one beacon per endpoint"
    assert second_owner(endpoint, {**me, "token": "first"}, tmp_path) == (None, True), "itself"
    assert second_owner(endpoint, {**me, "rdzv_id": "other"}, tmp_path) == (None, True)
    assert second_owner(endpoint, me, tmp_path, lambda tok: tok == "first") == (None, True), \
        "its records are in this directory: the same directory, not a second owner"
    why, heard = second_owner(endpoint, me, tmp_path)
    assert heard and "two owners of job --rdzv-id j" in why
    assert "/shared/run" in why and str(tmp_path) in why
    import time
    end = time.monotonic() + 30
    while me not in b.reports and time.monotonic() < end:
        time.sleep(0.01)
    assert me in b.reports, "the beacon hears who asked (its owner stops too)"
    b.close()
    assert serve("192.0.2.7:29400", {"token": "x"}) is None, "not this machine's address"


def test_an_owner_record_that_beats_holds_the_run_where_the_lock_is_not_shared(
        tmp_path, monkeypatch):
    """A filesystem whose flock is not shared between hosts: the multi-node owner's record
    (token, heartbeat) holds the run; a clean exit releases it at once."""
    from proxy.fault_injection import NO_FLOCK_ENV
    from proxy.run_files.run_lock import RunLock, RunLockError, read_owner
    from shared.run.layout import RunLayout
    monkeypatch.setenv(NO_FLOCK_ENV, "1")
    layout = RunLayout(tmp_path)
    job = {"rdzv_id": "j", "nnodes": 2, "nproc_per_node": 1}
    first = RunLock(layout, job={**job, "token": "a"})
    first.acquire()
    with pytest.raises(RunLockError, match="whose owner record beats") as e:
        RunLock(layout, job={**job, "token": "b"}).acquire()
    assert e.value.owner["job"]["token"] == "a", "the refusal carries the owner's job"
    first.release()
    assert read_owner(layout)["released"]
    second = RunLock(layout, job={**job, "token": "b"})
    second.acquire()  # a released record is free at once
    assert read_owner(layout)["job"]["token"] == "b"
    second.release()


def test_an_owner_record_of_another_host_is_alive_while_its_heartbeat_moves(tmp_path):
    import threading
    import time

    from proxy.run_files.run_lock import owner_alive, read_owner
    from shared.atomic_io import atomic_write_json
    from shared.run.layout import RunLayout
    layout = RunLayout(tmp_path)
    rec = {"host": "another-host", "pid": 1, "started_at": time.time(), "command": "run",
           "job": {"token": "t"}, "heartbeat": time.time()}
    atomic_write_json(layout.proxy_owner, rec)
    assert not owner_alive(layout, rec, watch_s=0.5), "a heartbeat that does not move: dead"
    assert not owner_alive(layout, {**rec, "heartbeat": time.time() - 60}), "stale: dead at once"
    stop = threading.Event()

    def beat():  # the other host's owner
        while not stop.wait(0.1):
            atomic_write_json(layout.proxy_owner, {**rec, "heartbeat": time.time()})

    t = threading.Thread(target=beat)
    t.start()
    try:
        assert owner_alive(layout, read_owner(layout), watch_s=30)
    finally:
        stop.set()
        t.join()


def test_of_two_owners_claiming_one_directory_at_once_the_earlier_keeps_it(tmp_path, monkeypatch):
    """Two hosts that both found the record free both write theirs: at the next beat the later
    claim yields (`lost`), the earlier one rewrites its record."""
    import time

    from proxy.fault_injection import NO_FLOCK_ENV
    from proxy.run_files.run_lock import RunLock, read_owner
    from shared.atomic_io import atomic_write_json
    from shared.run.layout import RunLayout
    monkeypatch.setenv(NO_FLOCK_ENV, "1")
    layout = RunLayout(tmp_path)
    lock = RunLock(layout, job={"token": "ours", "rdzv_id": "j", "nnodes": 2})
    lock.acquire()
    lost = []
    lock.on_lost = lambda: lost.append(1)
    ours = read_owner(layout)
    later = {**ours, "job": {"token": "later"}, "started_at": ours["started_at"] + 1}
    atomic_write_json(layout.proxy_owner, later)
    end = time.monotonic() + 30
    while read_owner(layout)["job"]["token"] != "ours" and time.monotonic() < end:
        time.sleep(0.05)
    assert read_owner(layout)["job"]["token"] == "ours" and lock.lost is None
    earlier = {**later, "started_at": ours["started_at"] - 1, "heartbeat": time.time()}
    atomic_write_json(layout.proxy_owner, earlier)

    def beating():  # the earlier claim's host keeps its record alive
        while lock.lost is None and time.monotonic() < end:
            atomic_write_json(layout.proxy_owner, {**earlier, "heartbeat": time.time()})
            time.sleep(0.1)
    beating()
    assert lock.lost is not None and lock.lost["job"]["token"] == "later" and lost == [1]
    lock.release()
    assert read_owner(layout)["job"]["token"] == "later", "a yielding owner leaves theirs alone"


# ---------------------------------------------------------------- bad set-ups (no worker starts)

@pytest.mark.slow
def test_a_node_with_another_nnodes_job_id_or_run_dir_is_refused_before_it_writes_anything(tmp_path):
    """Mismatched --nnodes / --rdzv-id, elastic --nnodes, and a second owner: a node whose
    --run-dir is another directory is refused at once (the job beacon), and the owner it asked
    stops too; where the filesystem does not share the lock, the owner record makes the second
    node a follower. Nothing of the run is written."""
    run = tmp_path / "run"
    owner = launch(run, "owner", *ARMS, "--rdzv-timeout", "120", nnodes="4")
    b = None
    try:
        wait_for(lambda: records(run), 120, what="the owner's record")
        for kw, says in ((dict(nnodes="2"), "mismatched --nnodes: its owner"),
                         (dict(nnodes="4", rdzv_id="other"),
                          "for the job --rdzv-id job1, not this node's")):
            r = subprocess.run(node_cmd(run, *ARMS, **kw), cwd=ROOT, env=_env(None),
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2, r.stderr[-2000:]
            assert says in r.stderr, r.stderr[-2000:]
            assert len(records(run)) == 1, "a refused node wrote a node record"
        r = subprocess.run(node_cmd(run, *ARMS, nnodes="1:2"), cwd=ROOT, env=_env(None),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "a run trains on a fixed number of nodes" in r.stderr
        # a filesystem that does not share flock between hosts: the beating record decides
        b = launch(run, "b", *ARMS, nnodes="4", env={"ANDREA_TEST_NO_FLOCK": "1"})
        wait_for(lambda: node_of(run, b).get("role") == "follower", 60, what="b to follow")
        assert node_of(run, b)["node_rank"] == 1
        owner.send_signal(signal.SIGTERM)  # a stop while the nodes gather: nothing started
        assert owner.wait(30) == 0
        assert b.wait(60) in (0, 1), out(run, "b")[-2000:]

        owner = launch(run, "owner", *ARMS, "--rdzv-timeout", "120")
        wait_for(lambda: node_of(run, owner), 120, what="the new owner's record")
        other = tmp_path / "not-shared"  # a node whose --run-dir is another directory
        r = subprocess.run(node_cmd(other, *ARMS), cwd=ROOT, env=_env(None),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr[-2000:]
        assert "two owners of job --rdzv-id job1" in r.stderr and str(run) in r.stderr, r.stderr
        assert not (other / ".nodes").exists() and not (other / "run.json").exists()
        assert owner.wait(60) == 2, "the owner that was asked stops too, not at its deadline"
        assert "this one stops too" in out(run, "owner") and str(other) in out(run, "owner")

        # the beacon served by a follower (the owner's --rdzv-endpoint is elsewhere): the
        # second owner is refused all the same, and the follower tells its owner
        port = beacon_port(run) + 1
        owner = subprocess.Popen(
            [*node_cmd(run, *ARMS, "--rdzv-timeout", "120", nnodes="4")[:-4],
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job1"],
            cwd=ROOT, env=_env(None), stdout=open(tmp_path / "owner2.out", "wb"),
            stderr=subprocess.STDOUT)
        wait_for(lambda: node_of(run, owner), 120, what="the third owner's record")
        b = launch(run, "b", *ARMS, nnodes="4")
        wait_for(lambda: node_of(run, b).get("role") == "follower", 60, what="b to follow")
        r = subprocess.run(node_cmd(other, *ARMS, nnodes="4"), cwd=ROOT, env=_env(None),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "two owners of job --rdzv-id job1" in r.stderr, r.stderr
        assert owner.wait(60) == 2
        assert "refused by the job beacon of node rank 1" in (tmp_path / "owner2.out").read_text()
        assert b.wait(60) in (0, 1)
    finally:
        reap(owner, b, run=run)
    assert not (run / "run.json").exists(), "the job never formed: no run may be created"


@pytest.mark.slow
def test_a_node_never_follows_the_last_starts_owner_record_while_the_new_owner_writes_its_own(
        tmp_path):
    """Nodes started together on a directory their job used before (a requeued Slurm job, the
    same --rdzv-id): a node may find the lock already held while the record still names the
    last start's owner, released. It waits for the new owner's record and follows that one."""
    import time

    from filelock import FileLock

    from shared.atomic_io import atomic_write_json
    from shared.run.layout import RunLayout
    run = tmp_path / "run"
    layout = RunLayout(run)
    (run / "logs").mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    job = {"rdzv_id": "job1", "nnodes": 2, "nproc_per_node": 1}
    atomic_write_json(layout.proxy_owner, {  # the last start's owner, released
        "host": os.uname().nodename, "pid": dead.pid, "started_at": time.time() - 60,
        "command": "run", "job": {**job, "token": "last"}, "heartbeat": time.time() - 50,
        "released": True})
    held = FileLock(str(layout.proxy_lock), timeout=0)
    held.acquire()  # the new owner has the lock, not yet its record
    b = launch(run, "b", *ARMS)
    try:
        wait_for(lambda: "waiting for the new owner's record" in out(run, "b")
                 or b.poll() is not None, 60, what="b to find the last start's record")
        atomic_write_json(layout.proxy_owner, {
            "host": os.uname().nodename, "pid": os.getpid(), "started_at": time.time(),
            "command": "run", "job": {**job, "token": "new"}, "heartbeat": time.time()})
        wait_for(lambda: node_of(run, b) or b.poll() is not None, 60, what="b to join")
        assert node_of(run, b).get("token") == "new", out(run, "b")[-2000:]
        b.send_signal(signal.SIGTERM)
        assert b.wait(60) == 0, out(run, "b")[-2000:]
    finally:
        reap(b, run=run)
        held.release()


@pytest.mark.slow
def test_a_rendezvous_that_never_completes_stops_naming_the_missing_node_before_creating(tmp_path):
    run = tmp_path / "run"
    r = subprocess.run(node_cmd(run, *ARMS, "--rdzv-timeout", "2"), cwd=ROOT, env=_env(None),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "node rank(s) 1 of --nnodes 2 never joined" in r.stderr, r.stderr[-2000:]
    assert "filesystem every node shares" in r.stderr
    assert not (run / "run.json").exists() and not (run / "data").exists()


@pytest.mark.slow
def test_a_stop_while_the_nodes_gather_ends_owner_and_follower_with_exit_0(tmp_path):
    """SIGTERM to the owner while it waits for the other nodes of --nnodes 4: it writes nothing
    and exits 0, and so does the follower that had joined (it exited 1, "the run's owner is
    gone", as if the owner had died)."""
    run = tmp_path / "run"
    a = launch(run, "a", *ARMS, nnodes="4")
    try:
        wait_for(lambda: node_of(run, a), 120, what="the owner's record")
        b = launch(run, "b", *ARMS, nnodes="4")
        wait_for(lambda: node_of(run, b), 120, what="the follower's record")
        assert node_of(run, b)["role"] == "follower"
        a.send_signal(signal.SIGTERM)
        assert a.wait(120) == 0, out(run, "a")[-2000:]
        assert b.wait(120) == 0, out(run, "b")[-2000:]
    finally:
        reap(a, run=run)
        if "b" in locals():
            reap(b, run=run)
    assert "stopped cleanly before this node's ranks started" in out(run, "b")
    assert not (run / "run.json").exists()


# ---------------------------------------------------------------- training on two nodes

@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return create_template(tmp_path_factory.mktemp("nodes") / "template", *ARMS, *PLAN)


def stops(run, before) -> list[tuple[int, str]]:
    """Checkpoints (step, why) written since `before` (a set of them)."""
    return [(s, why) for s, why, _ in manifest(run) if (s, why) not in before]


def written(run) -> set[tuple[int, str]]:
    return {(s, why) for s, why, _ in manifest(run)}


def one(run, before, why) -> int:
    """The step of the one checkpoint for `why` written since `before` (a cadence checkpoint
    may come with it); fails when there is none or more than one."""
    new = [s for s, w in stops(run, before) if w == why]
    assert len(new) == 1, stops(run, before)
    return new[0]


def stop_step(run, before) -> int:
    """The step at which a stop checkpointed since `before` (a set of checkpoints): its one
    `sigterm` checkpoint, or, where the stop fell on a cadence step whose checkpoint was already
    written, that one: a rank that gets the signal while it waits in the boundary's collective
    acts on it at the start of the next update, which stops at the same step and writes no
    second file (worker/trainer.py `_one_update`). Either way it is the newest
    checkpoint and the history ends there: no step lost."""
    new = stops(run, before)
    term = [s for s, w in new if w == "sigterm"]
    assert new and len(term) <= 1, new
    newest = max(s for s, _ in new)
    assert newest == last_step(run), (new, last_step(run))
    assert term == [newest] or (not term and (newest, "cadence") in new), new
    return newest


def wrote(run, before, why) -> bool:
    return any(w == why for _, w in stops(run, before))


HOLDS = {"ANDREA_TEST_PAUSE_AT_STEP": "4:hold,8:hold,12:hold,16:hold,20:hold"}


def release(run, step) -> None:
    """Let the update held at `step` go on (worker/fault_injection.py: `N:hold`)."""
    (Path(run) / f".test-release-{step}").touch()


def signal_then_release(run, proc, sig, name, says, step) -> None:
    """Send `sig` to node `name`'s proxy while update `step` is held, wait until its log says
    `says` (the signal reached that node's ranks), then let the update go on."""
    seen = len(out(run, name))
    proc.send_signal(sig)
    wait_for(lambda: says in out(run, name)[seen:], 120, what=f"{name}: {says}")
    release(run, step)


@pytest.mark.slow
def test_two_nodes_stopped_and_resumed_from_either_node_match_one_node_with_two_ranks(template, tmp_path):
    """One run, one owner, one history, one mixture: rank 0 and every file on the owner's side;
    SIGUSR1 to the owner, then to the follower, checkpoints once and both go on; SIGINT to the
    follower, SIGHUP to the owner, then SIGTERM to every process of both nodes at once, each
    stops everything with one agreed checkpoint and exit 0; the node that arrives first owns
    the run. The final checkpoint is byte-identical to one node with --nproc-per-node 2, and
    every update drew its rows from the same arms. Each signal is sent while an update is held
    (worker/fault_injection.py), so no step of it races the clock."""
    ref, two = clone(template, tmp_path / "ref"), clone(template, tmp_path / "two")
    r = subprocess.run([*cmd(ref, *PLAN), "--nproc-per-node", "2"], cwd=ROOT, env=_env(None),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    # start 1: a (owner) and b (follower); SIGUSR1 to each, then SIGINT to the follower
    a = launch(two, "a", *PLAN, env=HOLDS)
    wait_for(lambda: records(two), 120, what="the owner's record")
    b = launch(two, "b", *PLAN, env=HOLDS)
    try:
        wait_for(lambda: paused(two, 4), 240, what="two nodes training")
        assert node_of(two, a)["role"] == "owner" and node_of(two, b)["role"] == "follower"
        assert node_of(two, b)["node_rank"] == 1 and hello(two)["world_size"] == 2
        assert rank0_pid(two) in tree(a), "global rank 0 must run on the owner's node"
        third = subprocess.run(node_cmd(two, *PLAN), cwd=ROOT, env=_env(None),
                               capture_output=True, text=True, timeout=60)
        assert third.returncode == 2 and "one too many" in third.stderr, third.stderr[-2000:]
        st = json.loads(subprocess.run(
            [*cmd(two)[:3], "status", "--run-dir", str(two), "--json"], cwd=ROOT, env=_env(None),
            capture_output=True, text=True, timeout=60).stdout)
        assert [(n["node_rank"], n["role"], n["alive"]) for n in st["nodes"]] == \
            [(0, "owner", True), (1, "follower", True)]
        assert all(n["ranks"] for n in st["nodes"])
        for proc, name, at in ((a, "a", 4), (b, "b", 8)):  # SIGUSR1 to the owner, the follower
            wait_for(lambda at=at: paused(two, at), 120, what=f"update {at}")
            # a SIGUSR1 within USR1_BURST_S of the last request joins it (worker/signals.py):
            # the second one waits at least that long (a lower bound, never a race)
            time.sleep(2 * USR1_BURST_S)
            before = written(two)
            signal_then_release(two, proc, signal.SIGUSR1, name, "SIGUSR1 received", at)
            wait_for(lambda b4=before: wrote(two, b4, "sigusr1"), 120, what="the checkpoint")
            assert at <= one(two, before, "sigusr1") < at + 4
            assert a.poll() is None and b.poll() is None, "a checkpoint request stops nothing"
        wait_for(lambda: paused(two, 12), 120, what="update 12")
        before = written(two)
        signal_then_release(two, b, signal.SIGINT, "b", "SIGINT received", 12)  # follower only
        assert b.wait(120) == 0 and a.wait(120) == 0, out(two, "a")[-3000:] + out(two, "b")[-3000:]
        wait_for(lambda: not run_processes(two), 120, what="every process of both nodes to exit")
    finally:
        reap(a, b, run=two)
    assert 12 <= stop_step(two, before) < 16  # `sigterm`: the reason of every stop signal
    assert "SIGINT on node rank 1" in out(two, "a")
    assert "following the run" not in (two / "logs" / "proxy.log").read_text(), \
        "the follower must not write the owner's log"

    # start 2: b first (it owns the run now), then a; SIGHUP to the owner
    b = launch(two, "b", *PLAN, env=HOLDS)
    wait_for(lambda: node_of(two, b), 120, what="b's record")
    a = launch(two, "a", *PLAN, env=HOLDS)
    try:
        wait_for(lambda: paused(two, 16), 240, what="two nodes training again")
        assert node_of(two, b)["role"] == "owner" and rank0_pid(two) in tree(b)
        before = written(two)
        signal_then_release(two, b, signal.SIGHUP, "b", "SIGHUP received", 16)
        assert a.wait(120) == 0 and b.wait(120) == 0, out(two, "b")[-3000:]
        wait_for(lambda: not run_processes(two), 120, what="every process of both nodes to exit")
    finally:
        reap(a, b, run=two)
    assert 16 <= stop_step(two, before) < 20

    # start 3: SIGTERM to every process of both nodes at once (proxies, torchrun agents,
    # ranks), as Slurm's pre-emption does
    a = launch(two, "a", *PLAN, env=HOLDS)
    wait_for(lambda: node_of(two, a), 120, what="a's record")
    b = launch(two, "b", *PLAN, env=HOLDS)
    try:
        wait_for(lambda: paused(two, 20), 240, what="two nodes training again")
        before = written(two)
        seen = len(out(two, "a"))
        for pid in tree(a) | tree(b):
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: "SIGTERM received" in out(two, "a")[seen:], 120, what="the stop")
        release(two, 20)
        assert a.wait(120) == 0 and b.wait(120) == 0
        wait_for(lambda: not run_processes(two), 120, what="every process of both nodes to exit")
    finally:
        reap(a, b, run=two)
    assert 20 <= stop_step(two, before) < FINAL

    # start 4: to the end
    a = launch(two, "a", *PLAN)
    wait_for(lambda: node_of(two, a), 120, what="a's record")
    b = launch(two, "b", *PLAN)
    try:
        assert a.wait(240) == 0 and b.wait(240) == 0, out(two, "a")[-3000:]
    finally:
        reap(a, b, run=two)
    assert_same_run(ref, two, FINAL)  # byte-identical weights, m, v; the same arms every row
    assert [x["arms"] for x in loss_records(two)] == [x["arms"] for x in loss_records(ref)]


@pytest.mark.slow
def test_a_node_killed_by_sigkill_restarts_the_job_and_a_killed_owner_leaves_nothing_behind(
        template, tmp_path):
    """Every process of the follower's node killed at once: the owner's ranks fail, the owner
    restarts from the newest valid checkpoint once a node joins again (one history, never
    forked). Then kill -9 of the owner's proxy: its agent (parent-death signal) and ranks stop
    with it, the follower sees the owner gone and exits 1, and no process of the run is left."""
    run = clone(template, tmp_path / "run")
    args = ["--max-steps", "100000", "--checkpoint-every", "5", "--rdzv-timeout", "120"]
    a = launch(run, "a", *args)
    wait_for(lambda: records(run), 120, what="the owner's record")
    b = launch(run, "b", *args)
    c = None
    try:
        wait_for(lambda: training(run, (a, b), 6) and checkpoint_steps(run), 240,
                 what="two nodes training past a checkpoint")
        victims = tree(b)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        b.wait(30)
        wait_for(lambda: "restart 1 of" in out(run, "a"), 120, what="the owner to restart")
        newest = max(checkpoint_steps(run))
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                 for p in victims), 30, what="the killed node's processes")
        c = launch(run, "c", *args)
        wait_for(lambda: node_of(run, c).get("ranks") and "incarnation 2" in out(run, "a")
                 and "resumed_from" in hello(run), 240, what="a new incarnation with the new node")
        assert hello(run)["resumed_from"] == newest
        wait_for(lambda: last_step(run) >= newest + 3, 120, what="training to resume")
        steps = [r["step"] for r in loss_records(run)]  # one read: training goes on meanwhile
        assert steps == list(range(1, steps[-1] + 1)), "one history, never forked"
        a.kill()
        a.wait(30)
        assert c.wait(120) == 1, out(run, "c")[-3000:]
        wait_for(lambda: not run_processes(run), 60, what="nothing of the run to be left")
    finally:
        reap(a, b, c, run=run)
    assert "restart 1 of" in out(run, "a")
    assert "owner (proxy pid" in out(run, "c") and "is gone" in out(run, "c")


@pytest.mark.slow
def test_an_agent_waiting_for_its_rendezvous_dies_with_its_launcher_killed_by_sigkill(tmp_path):
    """The torchrun agent a proxy starts (proxy/supervision/launch.py `die_with_parent`) gets SIGTERM when
    its launcher dies, even by SIGKILL, also while it still waits for the other nodes (it
    waited for ever, re-parented to init)."""
    launcher = (
        "import subprocess, sys, time\n"
        "from proxy.supervision.launch import die_with_parent, static_argv\n"
        f"argv = static_argv(sys.executable, ['--run-dir', {str(tmp_path / 'run')!r}],\n"
        "                    {'nproc_per_node': 1, 'nnodes': 2, 'addr': '127.0.0.1', 'port': 0,\n"
        "                     'run_id': 'orphan-test'}, 0, 600)\n"
        "p = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([cmd(tmp_path)[0], "-c", launcher], cwd=ROOT, env=_env(None),
                            stdout=subprocess.PIPE, text=True)
    try:
        agent = int(proc.stdout.readline())
        wait_for(lambda: any(c.status == psutil.CONN_LISTEN
                             for c in psutil.Process(agent).net_connections("tcp")), 120,
                 what="the agent's store to wait for node rank 1")
        proc.kill()
        proc.wait(30)
        wait_for(lambda: not psutil.pid_exists(agent)
                 or psutil.Process(agent).status() == psutil.STATUS_ZOMBIE, 60,
                 what="the agent to die with its launcher")
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            psutil.Process(agent).kill()
        except (psutil.NoSuchProcess, UnboundLocalError):
            pass


# ---------------------------------------------------------------- the Slurm recipe

FAKE_SLURM = ROOT / "tests" / "fake_slurm"  # srun and scontrol stand-ins: "nodes" are processes


def sbatch(run, name, *args) -> subprocess.Popen:
    """`sbatch --nodes=2 scripts/slurm_multinode.sh RUN TINY args` as job 4242, on this machine
    (tests/fake_slurm: srun starts one task per node here and forwards signals as srun does;
    scontrol names 127.0.0.1 for every node and says when the job requeues itself). The batch
    shell's output goes to run/../<name>.out."""
    env = {
        "PATH": f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "fake[1-2]",
        "ANDREA_PYTHON": sys.executable, "ANDREA_GPUS_PER_NODE": "1",
        "ANDREA_RDZV_PORT": str(beacon_port(run)),
        "ANDREA_TEST_PAUSE_AT_STEP": "4:hold,10:hold,16:hold",
    }
    log = open(Path(run).parent / f"{name}.out", "ab")
    return subprocess.Popen(["bash", "scripts/slurm_multinode.sh", str(run), *TINY, *args],
                            cwd=ROOT, env=_env(env), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.mark.slow
def test_the_slurm_recipe_trains_two_nodes_through_a_checkpoint_request_time_limit_and_preemption(
        template, tmp_path):
    """scripts/slurm_multinode.sh under stand-ins for srun and scontrol: one shared directory,
    two nodes started together. USR2 to the batch shell checkpoints and training goes on; USR1
    (the time limit) stops every node with one checkpoint, exit 0, and the job requeues
    itself; SIGTERM to every process of the job (pre-emption) stops it with one checkpoint,
    exit 0; the requeued job resumes where the time limit left off, one history."""
    run = clone(template, tmp_path / "run")
    job = sbatch(run, "job1", *PLAN)
    try:
        wait_for(lambda: paused(run, 4), 240, what="two nodes training")
        assert len(records(run)) == 2 and hello(run)["world_size"] == 2
        before = written(run)
        # scancel --signal=USR2 --batch: a checkpoint
        signal_then_release(run, job, signal.SIGUSR2, "job1", "SIGUSR1 received", 4)
        wait_for(lambda: wrote(run, before, "sigusr1"), 120, what="the requested checkpoint")
        assert 4 <= one(run, before, "sigusr1") < 10
        wait_for(lambda: paused(run, 10), 120, what="training to go on after the checkpoint")
        before = written(run)
        # --signal=B:USR1@300: the time limit is near
        signal_then_release(run, job, signal.SIGUSR1, "job1", "SIGTERM received", 10)
        assert job.wait(120) == 0, out(run, "job1")[-3000:]
        wait_for(lambda: not run_processes(run), 120, what="every process of both nodes to exit")
    finally:
        reap(job, run=run)
    stop = stop_step(run, before)
    assert 10 <= stop < 16
    assert "fake scontrol: requeue 4242" in out(run, "job1")

    job = sbatch(run, "job2", *PLAN)  # the requeued job; pre-empted while it trains
    try:
        wait_for(lambda: paused(run, 16), 240, what="the requeued job training")
        assert hello(run)["resumed_from"] == stop
        before = written(run)
        seen = len(out(run, "job2"))
        for pid in tree(job):  # Slurm signals every process of the job
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        wait_for(lambda: "SIGTERM received" in out(run, "job2")[seen:], 120, what="the stop")
        release(run, 16)
        assert job.wait(120) == 0, out(run, "job2")[-3000:]
        wait_for(lambda: not run_processes(run), 120, what="every process of both nodes to exit")
    finally:
        reap(job, run=run)
    stop = stop_step(run, before)
    assert 16 <= stop < FINAL
    assert "requeue" not in out(run, "job2"), "pre-emption: Slurm requeues, not the script"
    steps = [r["step"] for r in loss_records(run)]
    assert steps == list(range(1, last_step(run) + 1)) and steps[-1] >= stop, "one history"
    assert len(records(run)) == 4, "two nodes per job, each its own record"
