"""Live TensorBoard scalars from the proxy: `run --tensorboard` writes RUN/tensorboard/
(docs/operations.md#watching).

What it is: a writer of TensorBoard event files built on the `tensorboard` package's own
RecordWriter and protobufs (the `[tensorboard]` extra; no torch, no TensorFlow), fed by the
proxy as it files records (`step_scalars`, `policy_scalars`, checkpoint events, sample audits).
It also holds what proxy/observation/wandb_log.py shares: the finite-value filter, the package
check and the backfill from the history (`replay_history`).

Resume (`start`): steps the event files hold past the resume step S (a crash, or a resume from
an older checkpoint) are purged by rewriting the files without them (`_write_only`), and the live
file starts with a SessionLog START at S + 1, TensorBoard's own "restarted here" marker, so every
reader (the Python loader and the Rust data server) shows each step once. The backfill reads what
the files hold as step ranges (memory does not grow with the history), so no step is written
twice, however often TensorBoard was switched on and off.

What it is not: the history (.loss.json stays the audit trail; the event files can be deleted
and are rebuilt from it by the backfill) or `plot` (proxy/observation/plot.py).
"""

from __future__ import annotations

import bisect
import collections
import importlib
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from proxy.run_files.loss_ema import LossEma, finite_number
from proxy.run_files.sidecars import read_audits
from shared.atomic_io import fsync_dir
from shared.run.loss_history import iter_records

log = logging.getLogger("proxy")

FLUSH_SECS = 2  # the writer's flush period: what "live" means, seconds
EVENT_GLOB = "events.out.tfevents.*"
PARTIAL_PREFIX = ".partial"  # a file being written in the logdir, which no reader loads
KEPT = ".kept"  # the suffix of the file a purge or a sort rewrites the others into


def package_missing(extra: str, *modules: str) -> str | None:
    """None when every one of `modules` imports, else the message that names the `extra`
    package and its install command (the caller exits 2 before creating anything)."""
    try:
        for m in modules:
            importlib.import_module(m)
    except Exception as e:  # ImportError, or a broken install (protobuf)
        return (
            f"--{extra} needs the `{extra}` package ({type(e).__name__}: {e}); "
            f"install it with: pip install -e '.[{extra}]'"
        )
    return None


def check_available() -> str | None:
    """None when the `tensorboard` package's writer imports, else the message saying how to
    install it (`package_missing`)."""
    return package_missing(
        "tensorboard",
        "tensorboard.compat.proto.event_pb2",
        "tensorboard.summary.writer.record_writer",
    )


def finite_scalars(values: dict) -> dict[str, float]:
    """The finite numbers of `values` (tag -> value) as floats; None, NaN, bools and strings
    are left out."""
    return {k: float(v) for k, v in values.items() if finite_number(v)}


def read_events(path: Path) -> list[bytes]:
    """The serialized Event records of one event file (TFRecord framing: uint64 length,
    uint32 crc, data, uint32 crc); a torn last record (a killed writer) is dropped."""
    out = []
    data = Path(path).read_bytes()
    i = 0
    while i + 12 <= len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        if i + 12 + n + 4 > len(data):
            break
        out.append(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
    return out


def _name_second(path: Path) -> int:
    """The creation-second field of an event file's name (events.out.tfevents.SECOND...),
    -1 when it is not a number."""
    field = path.name.split(".")[3:4]
    return int(field[0]) if field and field[0].isdigit() else -1


class EventFile:
    """One event file being written into `logdir`: TFRecord framing by the `tensorboard`
    package's RecordWriter, the version record first. Events are flushed when one comes
    FLUSH_SECS or more after the last flush, and at `flush` and `close` (which also fsyncs).
    With `partial` the file is written under a name no reader loads (PARTIAL_PREFIX: no
    "tfevents" in it) and `close` renames it to its event-file name, so readers never see it
    half written.

    Readers (TensorBoard's loader and its data server) read a directory's files in name order
    and the name's first varying field is the creation second, so a file gets the second it is
    made in or, when a file in `logdir` already has that second or a later one, one past the
    newest: files made within one second are read in the order they were made (the package's
    own names break that tie with a process-wide counter compared as text, "10" before "9")."""

    def __init__(self, logdir: Path, suffix: str, partial: bool = False) -> None:
        from tensorboard.compat.proto import event_pb2  # optional extra
        from tensorboard.summary.writer.record_writer import RecordWriter  # optional extra

        newest = max((_name_second(f) for f in logdir.glob(EVENT_GLOB)), default=-1)
        second = max(int(time.time()), newest + 1)
        self.path = logdir / (
            f"events.out.tfevents.{second:010d}.{socket.gethostname()}.{os.getpid()}{suffix}"
        )
        self.written = logdir / f"{PARTIAL_PREFIX}{suffix}" if partial else self.path
        self._file = open(self.written, "wb" if partial else "xb")
        self._records = RecordWriter(self._file)
        self._flushed = time.monotonic()
        self.add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def add(self, event: Any) -> None:
        """Append one `event_pb2.Event`."""
        self._records.write(event.SerializeToString())
        if time.monotonic() - self._flushed >= FLUSH_SECS:
            self.flush()

    def flush(self) -> None:
        """Hand what is buffered to the operating system."""
        self._records.flush()
        self._flushed = time.monotonic()

    def close(self, publish: bool = True) -> None:
        """Flush, fsync and close the file; a `partial` one is renamed to `path` when
        `publish`, else left at `written` for the caller."""
        self.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        if publish and self.written != self.path:
            os.replace(self.written, self.path)
            fsync_dir(self.path.parent)


class TensorBoardLog:
    """Scalars into `logdir` (created). Call `start(step)` at each worker incarnation, then
    `scalars`; `close()` at the end. Raises RuntimeError (with the install hint) when the
    package is missing."""

    def __init__(self, logdir: Path) -> None:
        why = check_available()
        if why:
            raise RuntimeError(why)
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer: EventFile | None = None  # the live file once started

    def start(
        self, step: int, loss_path: Path | None = None, samples_path: Path | None = None
    ) -> int:
        """A worker resumes from `step`: purge logged steps > `step`, open a fresh event file,
        backfill what `loss_path` (.loss.json) and `samples_path` (.samples.json) hold up to
        `step` that no event file has yet (`replay_history`: the loss EMA recomputed, each
        record's own wall time), and mark the restart (SessionLog START at step + 1). Returns
        the events purged. The events stream from file to file (memory does not grow with the
        history) except when the backfill wrote steps below ones the files held (TensorBoard
        switched on mid-run, then off, then on): the files are then rewritten sorted by step,
        which holds their events in memory once."""
        from tensorboard.compat.proto import event_pb2  # optional extra

        self.close()  # the previous incarnation's live file
        self._finish_rewrite()
        purged = sum(1 for ev in self._events() if ev.step > step)
        if purged:
            self._write_only(lambda events: (ev for ev in events if ev.step <= step))
        if loss_path is not None:
            backfill = self._writer = EventFile(self.logdir, ".backfill", partial=True)
            wrote, out_of_order = self._backfill(step, Path(loss_path), samples_path)
            self._writer = None
            backfill.close(publish=wrote and not out_of_order)
            if out_of_order:  # readers drop what follows a step that goes back: one sorted file
                self._write_only(
                    lambda events: sorted(events, key=lambda ev: ev.step), backfill.written
                )  # a stable sort
            backfill.written.unlink(missing_ok=True)
        self._writer = EventFile(self.logdir, "")
        self._writer.add(
            event_pb2.Event(
                step=step + 1, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            )
        )
        self._writer.flush()
        if purged:
            log.info(
                "tensorboard: %d events past step %d purged (abandoned by the resume)", purged, step
            )
        return purged

    def _finish_rewrite(self) -> None:
        """Complete a `start` that was killed: drop its unpublished files (a backfill, a
        rewrite half written), and remove the files older than the newest kept file (by their
        names' creation second), which that rewrite had copied but not yet removed. Nothing
        else ever sorts before a kept file."""
        for f in self.logdir.glob(PARTIAL_PREFIX + "*"):
            f.unlink()
        files = list(self.logdir.glob(EVENT_GLOB))
        kept = max((_name_second(f) for f in files if f.name.endswith(KEPT)), default=-1)
        for f in files:
            if _name_second(f) < kept:
                f.unlink()

    def _events(self, files: list[Path] | None = None) -> Iterator[Any]:
        """The Events of `files` (default: every event file, in name order, which is the order
        they were made: `EventFile`), each file's version record left out, and any record
        that is not an Event (logged)."""
        from google.protobuf.message import DecodeError  # tensorboard's dependency
        from tensorboard.compat.proto import event_pb2  # optional extra

        for f in sorted(self.logdir.glob(EVENT_GLOB)) if files is None else files:
            for i, raw in enumerate(read_events(f)):
                try:
                    ev = event_pb2.Event.FromString(raw)
                except DecodeError:
                    log.warning(
                        "tensorboard: record %d of %s is not an event; left out (the history "
                        "rebuilds what it held: delete the file to backfill it)",
                        i,
                        f,
                    )
                    continue
                if not ev.HasField("file_version"):
                    yield ev

    def _write_only(
        self, select: Callable[[Iterator[Any]], Iterable[Any]], extra: Path | None = None
    ) -> None:
        """Write the events `select` picks from every file's (and unpublished `extra`'s, read
        last) into a new file, closed, fsynced and renamed into place, then remove every other
        one (`_finish_rewrite` completes a rewrite killed before that)."""
        files = sorted(self.logdir.glob(EVENT_GLOB))
        out = EventFile(self.logdir, KEPT, partial=True)
        for ev in select(self._events(files + ([extra] if extra else []))):
            out.add(ev)
        out.close()  # flushed and fsynced before anything old is removed
        for f in files:
            f.unlink()

    def _backfill(self, step: int, loss_path: Path, samples_path: Path | None) -> tuple[bool, bool]:
        """Write the records and audits up to `step` that the event files lack. Returns
        (whether any was written, whether one lies before a step the files hold: they then
        need sorting)."""
        steps: list[list[int]] = []  # the steps holding a `train/` tag in the event files
        audits: list[list[int]] = []  # those holding an `audit/samples` text; both as ranges
        for ev in self._events():
            tags = {v.tag for v in ev.summary.value}
            if any(t.startswith("train/") for t in tags):  # a step record's (a NaN loss too)
                _add_step(steps, ev.step)
            if AUDIT_TAG in tags:
                _add_step(audits, ev.step)
        # read only: a garbage file is the run's to handle (proxy/run_files/sidecars.py)
        got = read_audits(Path(samples_path), garbage="default") if samples_path else []
        n_steps, n_audits, first_new = replay_history(
            self,
            step,
            loss_path,
            got,
            lambda s: not _in_ranges(steps, s),
            lambda s: not _in_ranges(audits, s),
        )
        if n_steps or n_audits:  # the caller closes (flushes) the file
            log.info(
                "tensorboard: backfilled %d step records and %d sample audits up to step %d "
                "from the run's history (steps already in the event files were left as "
                "they are)",
                n_steps,
                n_audits,
                step,
            )
        return first_new is not None, first_new is not None and first_new < max(
            (r[1] for r in steps + audits), default=first_new
        )

    def audit(self, a: dict) -> None:
        """One sample audit (`{"step", "arms": {name: {"prompt", "text", "loss", ...}}}`): the
        held-out losses as `heldout/<arm>` scalars and the samples as one text summary."""
        from tensorboard.plugins.text.summary_v2 import text_pb  # optional extra

        arms = {n: v for n, v in (a.get("arms") or {}).items() if isinstance(v, dict)}
        self.scalars(
            a["step"], {f"heldout/{n}": v.get("loss") for n, v in arms.items()}, a.get("time")
        )
        md = "\n\n".join(
            f"**{n}** (held-out {v.get('loss')})\n\n    prompt: "
            + str(v.get("prompt", "")).replace("\n", "\n            ")
            + "\n      text: "
            + str(v.get("text", "")).replace("\n", "\n            ")
            for n, v in arms.items()
        )
        if md:
            self._add(a["step"], text_pb(AUDIT_TAG, md), a.get("time"))

    def scalars(self, step: int, values: dict, wall_time: float | None = None) -> None:
        """One Summary event at `step` holding every finite number in `values` (tag -> value);
        others (None, NaN, strings) are skipped."""
        from tensorboard.compat.proto import summary_pb2  # optional extra

        vals = [
            summary_pb2.Summary.Value(tag=t, simple_value=v)
            for t, v in finite_scalars(values).items()
        ]
        if vals:
            self._add(step, summary_pb2.Summary(value=vals), wall_time)

    def _add(self, step: int, summary: Any, wall_time: float | None) -> None:
        """One Summary event at `step` into the live file (none while no file is open)."""
        from tensorboard.compat.proto import event_pb2  # optional extra

        if self._writer is not None:
            self._writer.add(
                event_pb2.Event(wall_time=wall_time or time.time(), step=step, summary=summary)
            )

    def close(self) -> None:
        """Flush and close the live event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


AUDIT_TAG = "audit/samples"


def _add_step(ranges: list[list[int]], s: int) -> None:
    """Add step `s` to sorted disjoint [first, last] `ranges` (events come mostly in order,
    so this is nearly always the last range growing)."""
    i = bisect.bisect_right(ranges, [s, float("inf")])
    if i and ranges[i - 1][0] <= s <= ranges[i - 1][1]:
        return
    if i and ranges[i - 1][1] == s - 1:
        ranges[i - 1][1] = s
        if i < len(ranges) and ranges[i][0] == s + 1:  # joins the next range too
            ranges[i - 1][1] = ranges[i][1]
            del ranges[i]
    elif i < len(ranges) and ranges[i][0] == s + 1:
        ranges[i][0] = s
    else:
        ranges.insert(i, [s, s])


def _in_ranges(ranges: list[list[int]], s: int) -> bool:
    i = bisect.bisect_right(ranges, [s, float("inf")])
    return bool(i) and ranges[i - 1][0] <= s <= ranges[i - 1][1]


def replay_history(
    sink: Any,
    step: int,
    loss_path: Path,
    audits: list,
    new_record: Callable[[int], bool],
    new_audit: Callable[[int], bool],
) -> tuple[int, int, int | None]:
    """The backfill of both loggers: feed `sink` (`scalars`, `audit`) the `step_scalars` of
    each record of the history at `loss_path` up to `step` whose step `new_record` accepts,
    with the loss EMA over every record from the first, and each audit of `audits`
    (.samples.json's) up to `step` that `new_audit` accepts, in step order, after its step's
    record. Returns (records written, audits written, the lowest step written or None)."""
    pending = collections.deque(
        sorted(
            (
                a
                for a in audits
                if isinstance(a, dict)
                and isinstance(a.get("step"), int)
                and a["step"] <= step
                and new_audit(a["step"])
            ),
            key=lambda a: a["step"],
        )
    )
    n_records = n_audits = 0
    first: int | None = None

    def audits_upto(s: int) -> None:
        nonlocal n_audits, first
        while pending and pending[0]["step"] <= s:
            a = pending.popleft()
            sink.audit(a)
            n_audits += 1
            first = a["step"] if first is None else min(first, a["step"])

    ema = LossEma()
    for rec in iter_records(loss_path):
        s = rec.get("step")
        if not isinstance(s, int) or s > step:
            break
        audits_upto(s - 1)
        value = ema.update(rec.get("loss"))
        if new_record(s):
            sink.scalars(s, step_scalars(rec, value), rec.get("time"))
            n_records += 1
            first = s if first is None else min(first, s)
        audits_upto(s)
    audits_upto(step)
    return n_records, n_audits, first


def step_scalars(rec: dict, ema: float | None) -> dict:
    """Tags -> values of one `.loss.json` step record (docs/history.md)."""
    out = {
        "train/loss": rec.get("loss"),
        "train/loss_ema": ema,
        "train/lr": rec.get("lr"),
        "train/grad_norm": rec.get("grad_norm"),
        "perf/tokens_per_s": rec.get("tokens_per_s"),
        "perf/mfu": rec.get("mfu") if (rec.get("mfu") or 0) <= 1 else None,
        "train/tokens": rec.get("tokens"),
    }
    per_arm = {"p": "arms/p", "arm_loss": "arms/train_loss", "probe": "heldout", "eval": "eval"}
    for field, tag in per_arm.items():  # eval: the validation curve
        for arm, v in (rec.get(field) or {}).items():
            out[f"{tag}/{arm}"] = v
    return out


def policy_scalars(policy: dict) -> dict:
    """Tags -> values of the bandit's `explain()` (proxy/mixture/bandit.py): per arm the fitted
    slope, its standard error, epochs, share-steps owed and target under arms/, the gain, its lower bound and
    the gate (1 open, 0 closed) under policy/ (docs/bandit.md#reading-the-policy)."""
    out: dict = {}
    for arm, a in (policy.get("arms") or {}).items():
        for key in ("slope", "slope_se", "epochs", "owed", "target"):
            if a.get(key) is not None:
                out[f"arms/{key}/{arm}"] = a[key]
    if "open" in policy:
        out["policy/gain"] = policy["gain"]
        out["policy/gain_bound"] = policy["bound"]
        out["policy/gate_open"] = 1.0 if policy["open"] else 0.0
    return out
