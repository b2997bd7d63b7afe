"""Live TensorBoard scalars from the proxy: `run --tensorboard` writes RUN/tensorboard/.

What it is: a writer of TensorBoard event files built on the `tensorboard` package's own
EventFileWriter and protobufs (the `[tensorboard]` extra; no torch, no TensorFlow), fed by the
proxy as it files records: train loss and its EMA, learning rate, grad norm, tokens/s, MFU,
each arm's probability and held-out loss, and checkpoint events (step, bytes, seconds). Then
`tensorboard --logdir RUN/tensorboard` shows the curves while the run trains.

Resume: when the proxy resumes from step S but the event files hold steps past S (a crash, or
a resume from an older checkpoint), those abandoned steps are purged: the files are rewritten
without them (kept events first, old files removed after the new one is closed and fsynced),
and the live file starts with a SessionLog START at S + 1, TensorBoard's own "restarted here"
marker. Every reader (the Python loader and the Rust data server) then shows each step once.

Backfill: switched on for a run that already trained (or after steps were trained without it),
`start(step, loss_path, samples_path)` writes every step record of `.loss.json` up to the resume
step that the event files do not hold yet (the same scalars, the loss EMA recomputed with
proxy/run_files/loss_ema.py, the record's own wall time) and every sample audit of `.samples.json` not yet
logged (held-out losses as scalars, the prompts and continuations as text under `audit/samples`).
What the files hold is read first as step ranges (memory does not grow with the history; the
history is streamed), so no step is written twice, however often TensorBoard was switched on and
off.

What it is not: the history (.loss.json stays the audit trail; the event files can be deleted
and are rebuilt from it by the backfill) or `plot` (proxy/observation/plot.py).
"""

from __future__ import annotations

import logging
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

from proxy.run_files.loss_ema import LossEma
from proxy.run_files.sidecars import read_audits
from shared.run.loss_history import iter_records

log = logging.getLogger("proxy")

INSTALL_HINT = "pip install -e '.[tensorboard]'"
FLUSH_SECS = 2  # the writer's flush period: what "live" means, seconds
EVENT_GLOB = "events.out.tfevents.*"


def check_available() -> str | None:
    """None when the `tensorboard` package's writer can be imported, else the message that
    names the package and the install command (the caller exits 2 before creating anything)."""
    try:
        from tensorboard.compat.proto import event_pb2  # noqa: F401
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
    except Exception as e:  # ImportError, or a broken protobuf install
        return (
            f"--tensorboard needs the `tensorboard` package ({type(e).__name__}: {e}); "
            f"install it with: {INSTALL_HINT}"
        )
    return None


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
        self._writer: Any = None  # an EventFileWriter once started (tensorboard is optional)
        self._n_files = 0

    def _new_writer(self, suffix: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # optional extra

        self._n_files += 1
        return EventFileWriter(
            str(self.logdir),
            flush_secs=FLUSH_SECS,
            filename_suffix=f".{os.getpid()}.{self._n_files:03d}{suffix}",
        )

    def start(
        self, step: int, loss_path: Path | None = None, samples_path: Path | None = None
    ) -> int:
        """A worker resumes from `step`: purge logged steps > `step`, open a fresh event file,
        backfill what `loss_path` (.loss.json) and `samples_path` (.samples.json) hold up to
        `step` that no event file has yet (see the module's docstring), and mark the restart
        (SessionLog START at step + 1). Returns the events purged."""
        from tensorboard.compat.proto import event_pb2  # optional extra

        if self._writer is not None:
            self._writer.close()
        purged = self._purge_after(step)
        if loss_path is not None:
            self._writer = self._new_writer(".backfill")
            out_of_order = self._backfill(step, Path(loss_path), samples_path)
            self._writer.close()
            if out_of_order:  # readers drop what follows a step that goes back: one sorted file
                self._rewrite(lambda ev: True, sort=True)
        self._writer = self._new_writer("")
        self._writer.add_event(
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

    def _purge_after(self, step: int) -> int:
        from tensorboard.compat.proto import event_pb2  # optional extra

        files = sorted(self.logdir.glob(EVENT_GLOB))
        kept, dropped = [], 0
        for f in files:
            for raw in read_events(f):
                ev = event_pb2.Event.FromString(raw)
                if ev.HasField("file_version"):
                    continue
                if ev.step > step:
                    dropped += 1
                else:
                    kept.append(ev)
        if not dropped:
            return 0
        self._write_only(kept)
        return dropped

    def _rewrite(self, keep, sort: bool = False) -> None:
        """Rewrite every event file as one holding the events `keep(ev)` accepts (in step order
        with `sort`; stable, so a step's events keep their order)."""
        from tensorboard.compat.proto import event_pb2

        evs = [
            ev
            for f in sorted(self.logdir.glob(EVENT_GLOB))
            for raw in read_events(f)
            if not (ev := event_pb2.Event.FromString(raw)).HasField("file_version") and keep(ev)
        ]
        if sort:
            evs.sort(key=lambda ev: ev.step)
        self._write_only(evs)

    def _write_only(self, events: list) -> None:
        """Write `events` into a new file, closed and fsynced, then remove every other one."""
        files = sorted(self.logdir.glob(EVENT_GLOB))
        w = self._new_writer(".kept")
        for ev in events:
            w.add_event(ev)
        w.close()  # flushed, closed and fsynced before anything old is removed
        kept_path = Path(w._file_name)
        fd = os.open(kept_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for f in files:
            if f != kept_path:
                f.unlink()

    def logged_ranges(self) -> tuple[list[list[int]], list[list[int]]]:
        """(steps holding `train/loss`, steps holding an `audit/samples` text) in the event
        files, each as sorted disjoint [first, last] ranges."""
        from tensorboard.compat.proto import event_pb2

        steps: list[list[int]] = []
        audits: list[list[int]] = []
        for f in sorted(self.logdir.glob(EVENT_GLOB)):
            for raw in read_events(f):
                ev = event_pb2.Event.FromString(raw)
                if not ev.HasField("summary"):
                    continue
                tags = {v.tag for v in ev.summary.value}
                if "train/loss" in tags:
                    _add_step(steps, ev.step)
                if AUDIT_TAG in tags:
                    _add_step(audits, ev.step)
        return steps, audits

    def _backfill(self, step: int, loss_path: Path, samples_path: Path | None) -> bool:
        """Write the records and audits up to `step` that the event files lack; True when one
        of them lies before a step the files hold (they then need sorting)."""
        steps, audits = self.logged_ranges()
        n_steps = n_audits = 0
        first_new = None
        pending = []  # the audits to write, in step order, each after its step's record
        if samples_path is not None:
            # read only: a garbage file is the run's to handle (proxy/run_files/sidecars.py)
            got = read_audits(Path(samples_path), garbage="default")
            pending = sorted(
                (
                    a
                    for a in got
                    if isinstance(a, dict)
                    and isinstance(a.get("step"), int)
                    and a["step"] <= step
                    and not _in_ranges(audits, a["step"])
                ),
                key=lambda a: a["step"],
            )

        def audits_upto(s: int) -> None:
            nonlocal n_audits, first_new
            while pending and pending[0]["step"] <= s:
                a = pending.pop(0)
                self.audit(a)
                n_audits += 1
                first_new = a["step"] if first_new is None else min(first_new, a["step"])

        ema = LossEma()
        if loss_path.exists():
            for rec in iter_records(loss_path):
                s = rec.get("step")
                if not isinstance(s, int) or s > step:
                    break
                audits_upto(s - 1)
                value = ema.update(rec.get("loss"))
                if not _in_ranges(steps, s):
                    self.scalars(s, step_scalars(rec, value), rec.get("time"))
                    n_steps += 1
                    first_new = s if first_new is None else min(first_new, s)
                audits_upto(s)
        audits_upto(step)
        if n_steps or n_audits:
            self._writer.flush()
            log.info(
                "tensorboard: backfilled %d step records and %d sample audits up to step %d "
                "from the run's history (steps already in the event files were left as "
                "they are)",
                n_steps,
                n_audits,
                step,
            )
        held = [r[1] for r in steps + audits]
        return first_new is not None and bool(held) and first_new < max(held)

    def audit(self, a: dict) -> None:
        """One sample audit (`{"step", "arms": {name: {"prompt", "text", "loss", ...}}}`): the
        held-out losses as `heldout/<arm>` scalars and the samples as one text summary."""
        import time

        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb

        arms = a.get("arms") or {}
        self.scalars(
            a["step"],
            {f"heldout/{n}": v.get("loss") for n, v in arms.items() if isinstance(v, dict)},
            a.get("time"),
        )
        md = "\n\n".join(
            f"**{n}** (held-out {v.get('loss')})\n\n    prompt: "
            + str(v.get("prompt", "")).replace("\n", "\n            ")
            + "\n      text: "
            + str(v.get("text", "")).replace("\n", "\n            ")
            for n, v in arms.items()
            if isinstance(v, dict)
        )
        if self._writer is not None and md:
            self._writer.add_event(
                event_pb2.Event(
                    wall_time=a.get("time") or time.time(),
                    step=a["step"],
                    summary=text_pb(AUDIT_TAG, md),
                )
            )

    def scalars(self, step: int, values: dict, wall_time: float | None = None) -> None:
        """One Summary event at `step` holding every finite number in `values` (tag -> value);
        others (None, NaN, strings) are skipped."""

        from tensorboard.compat.proto import event_pb2, summary_pb2  # optional extra

        vals = [
            summary_pb2.Summary.Value(tag=t, simple_value=float(v))
            for t, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ]
        if not vals or self._writer is None:
            return
        self._writer.add_event(
            event_pb2.Event(
                wall_time=wall_time or time.time(),
                step=step,
                summary=summary_pb2.Summary(value=vals),
            )
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
    import bisect

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
    import bisect

    i = bisect.bisect_right(ranges, [s, float("inf")])
    return bool(i) and ranges[i - 1][0] <= s <= ranges[i - 1][1]


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
    for arm, p in (rec.get("p") or {}).items():
        out[f"arms/p/{arm}"] = p
    for arm, v in (rec.get("arm_loss") or {}).items():
        out[f"arms/train_loss/{arm}"] = v
    for arm, v in (rec.get("probe") or {}).items():
        out[f"heldout/{arm}"] = v
    for arm, v in (rec.get("eval") or {}).items():
        out[f"eval/{arm}"] = v  # the validation curve
    return out


def policy_scalars(policy: dict) -> dict:
    """Tags -> values of the bandit's `explain()` (proxy/mixture/bandit.py): per arm the fitted
    slope, its standard error, epochs and target under arms/, the gain, its lower bound and
    the gate (1 open, 0 closed) under policy/ (docs/bandit.md#reading-the-policy)."""
    out: dict = {}
    for arm, a in (policy.get("arms") or {}).items():
        for key in ("slope", "slope_se", "epochs", "target"):
            if a.get(key) is not None:
                out[f"arms/{key}/{arm}"] = a[key]
    if "open" in policy:
        out["policy/gain"] = policy["gain"]
        out["policy/gain_bound"] = policy["bound"]
        out["policy/gate_open"] = 1.0 if policy["open"] else 0.0
    return out
