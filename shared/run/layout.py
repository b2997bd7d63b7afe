"""The run directory's names (docs/architecture.md#the-run-directory), in one place for both sides,
and the messages about a directory that is not (yet) a run.

What it is not: any file's reader or writer (each has its own module).
"""

from __future__ import annotations

import itertools
import socket
from dataclasses import dataclass
from pathlib import Path

from shared.atomic_io import read_json
from shared.processes import alive


def creating_proxy(root) -> int | None:
    """The pid of the live proxy on this host that owns `root` (its `.proxy.owner.json`), else
    None. Read-only: it never takes the run lock, so it cannot get in a starting proxy's way."""
    try:
        owner = read_json(RunLayout(root).proxy_owner, expect=dict, missing_ok=False)
        pid = int(owner["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if owner.get("host") != socket.gethostname() or not alive(pid):
        return None
    try:  # the owner file outlives its proxy: a reused pid must be a proxy of this run
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"proxy" not in argv or not any(Path(root).name.encode() in x for x in argv):
        return None
    return pid


# What a run directory holds besides its dot-files (docs/architecture.md#the-run-directory)
RUN_ENTRIES = frozenset(
    {
        "run.json",
        "tokenizer.json",
        "phases.json",
        "checkpoints.json",
        "data",
        "logs",
        "archive",
        "rejected",
        "tensorboard",
        "wandb",
        "fork.json",
        "loss.png",
    }
)


def foreign_entries(root) -> list[str]:
    """Names in directory `root` that no run writes (sorted; dot-files and step_*.bin count as
    a run's), so a new run is not created among someone's files. [] when `root` is missing."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        e.name + ("/" if e.is_dir() else "")
        for e in root.iterdir()
        if not e.name.startswith(".")
        and e.name not in RUN_ENTRIES
        and not (e.name.startswith("step_") and e.name.endswith(".bin"))
    )


def last_creation_error(root, nbytes: int = 1 << 16) -> str | None:
    """The first ERROR message the last creation attempt logged in `root`/logs/proxy.log (the
    lines after its last "creating run"), or None: killed or stopped attempts log none."""
    log = RunLayout(root).proxy_log
    try:
        with open(log, "rb") as f:
            f.seek(max(0, log.stat().st_size - nbytes))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    start = max((i for i, line in enumerate(lines) if " INFO creating run " in line), default=None)
    if start is None:
        return None
    for i in range(start, len(lines)):
        if " ERROR " in lines[i]:
            # a message of several lines (every bad arm on its own): the lines that follow
            # without a log record's timestamp belong to it
            more = itertools.takewhile(lambda x: x[:1].isspace(), lines[i + 1 : i + 21])
            return " ".join([lines[i].split(" ERROR ", 1)[1], *(x.strip() for x in more)])
    return None


def missing_run_json(root) -> str:
    """The error for a `--run-dir` without run.json: a creation that was stopped or killed
    before it wrote run.json (data/ or tokenizer.json are there; docs/data.md#crash-safe-creation)
    or not a run directory at all (no such directory, a file, a folder without run.json). Names
    the path and the fix; every command that takes a run directory says it in these words."""
    root = Path(root)
    if not root.exists() or root.is_file():
        return (
            f"{root}: not a run directory ("
            + ("no such directory" if not root.exists() else "a file, not a directory")
            + "); pass the --run-dir given to `python -m proxy run`"
        )
    creator = creating_proxy(root)
    if creator is not None:
        return (
            f"{root}: being created by proxy pid {creator} (alive: tokenizing its arms, "
            f"no run.json yet); wait for it, and follow it in {RunLayout(root).proxy_log}"
        )
    failed = last_creation_error(root)
    if failed:
        return (
            f"{root}: the last attempt to create this run failed (no run.json): {failed}; "
            f"fix that and run the `python -m proxy run --run-dir {root} ...` command again "
            f"(the log: {RunLayout(root).proxy_log})"
        )
    if (root / "data").is_dir() or (root / "tokenizer.json").exists():
        return (
            f"{root}: the creation of this run is unfinished (no run.json yet: it was "
            f"stopped or killed while creating); run the same `python -m proxy run "
            f"--run-dir {root} ...` command to finish it"
        )
    return (
        f"{root}: not a run directory (no run.json); pass the --run-dir given to "
        "`python -m proxy run`"
    )


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run directory. Pure names: creating nothing except in `ensure()`."""

    root: Path

    def __init__(self, root) -> None:
        object.__setattr__(self, "root", Path(root))

    run_json = property(lambda s: s.root / "run.json")
    tokenizer = property(lambda s: s.root / "tokenizer.json")
    phases = property(lambda s: s.root / "phases.json")
    loss = property(lambda s: s.root / ".loss.json")
    loss_rewound = property(lambda s: s.root / ".loss.rewound.json")
    samples = property(lambda s: s.root / ".samples.json")
    state = property(lambda s: s.root / ".state.json")
    handshake = property(lambda s: s.root / ".handshake.json")
    handshake_lock = property(lambda s: s.root / ".handshake.lock")
    reports = property(lambda s: s.root / ".reports.jsonl")
    proxy_lock = property(lambda s: s.root / ".proxy.lock")
    proxy_owner = property(lambda s: s.root / ".proxy.owner.json")
    status = property(lambda s: s.root / ".status.json")
    pivot_request = property(lambda s: s.root / ".pivot.request.json")
    pivot_request_lock = property(lambda s: s.root / ".pivot.request.lock")
    state_snapshots = property(lambda s: s.root / ".state.snapshots.jsonl")
    compile_cache = property(lambda s: s.root / ".compile-cache")  # TORCHINDUCTOR_CACHE_DIR
    data = property(lambda s: s.root / "data")
    arms_index = property(lambda s: s.root / "data" / "arms.json")
    archive = property(lambda s: s.root / "archive")
    logs = property(lambda s: s.root / "logs")
    proxy_log = property(lambda s: s.root / "logs" / "proxy.log")  # rotated: proxy.log.1 .. .4
    manifest = property(lambda s: s.root / "checkpoints.json")  # shared/checkpoint/manifest.py
    manifest_lock = property(lambda s: s.root / ".checkpoints.json.lock")
    rejected = property(lambda s: s.root / "rejected")  # checkpoints a resume rejected
    fork_json = property(lambda s: s.root / "fork.json")
    tensorboard = property(lambda s: s.root / "tensorboard")
    wandb = property(lambda s: s.root / "wandb")
    plot = property(lambda s: s.root / "loss.png")  # `plot`'s default output
    nodes = property(lambda s: s.root / ".nodes")  # several nodes: docs/architecture.md
    nodes_job = property(lambda s: s.root / ".nodes" / "job.json")
    nodes_lock = property(lambda s: s.root / ".nodes" / ".lock")

    def node_record(self, host: str, pid: int) -> Path:
        """The record of the node whose proxy is `pid` on `host` (docs/architecture.md#several-nodes)."""
        return self.nodes / f"{host}-{pid}.json"

    @property
    def own_files(self) -> frozenset[str]:
        """The names of the root's files that only the run lock's holder writes, or a `pivot`
        command under `.pivot.request.lock` (the request): with both locks held, an atomic
        write's temporary of one of them is dead whatever its age."""
        return frozenset(
            p.name
            for p in (
                self.run_json,
                self.tokenizer,
                self.phases,
                self.manifest,
                self.fork_json,
                self.loss,
                self.loss_rewound,
                self.samples,
                self.state,
                self.handshake,
                self.proxy_owner,
                self.status,
                self.pivot_request,
                self.state_snapshots,
            )
        )

    def pivot_archive(self, step: int) -> Path:
        return self.archive / f"pivot-{step}"

    def pivot_archive_tmp(self, step: int | str) -> Path:
        """Where the archive of the pivot at `step` is made before its one rename ("*": the
        glob of every one)."""
        return self.archive / f"pivot-{step}.tmp"

    def ensure(self) -> None:
        for d in (self.root, self.data, self.archive, self.logs):
            d.mkdir(parents=True, exist_ok=True)
