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

What it is not: the history (.loss.json stays the audit trail; the event files can be deleted
and are never read back by the run) or `plot` (proxy/observation/plot.py).
"""
from __future__ import annotations

import logging
import math
import os
import struct
import time
from typing import Any
from pathlib import Path

log = logging.getLogger("proxy")

INSTALL_HINT = "pip install -e '.[tensorboard]'"
FLUSH_SECS = 2          # the writer's flush period: what "live" means, seconds
EVENT_GLOB = "events.out.tfevents.*"


def check_available() -> str | None:
    """None when the `tensorboard` package's writer can be imported, else the message that
    names the package and the install command (the caller exits 2 before creating anything)."""
    try:
        from tensorboard.compat.proto import event_pb2  # noqa: F401
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
    except Exception as e:  # ImportError, or a broken protobuf install
        return (f"--tensorboard needs the `tensorboard` package ({type(e).__name__}: {e}); "
                f"install it with: {INSTALL_HINT}")
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
        out.append(data[i + 12:i + 12 + n])
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
        return EventFileWriter(str(self.logdir), flush_secs=FLUSH_SECS,
                               filename_suffix=f".{os.getpid()}.{self._n_files:03d}{suffix}")

    def start(self, step: int) -> int:
        """A worker resumes from `step`: purge logged steps > `step`, open a fresh event file
        and mark the restart (SessionLog START at step + 1). Returns the events purged."""
        from tensorboard.compat.proto import event_pb2  # optional extra
        if self._writer is not None:
            self._writer.close()
        purged = self._purge_after(step)
        self._writer = self._new_writer("")
        self._writer.add_event(event_pb2.Event(
            step=step + 1, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        self._writer.flush()
        if purged:
            log.info("tensorboard: %d events past step %d purged (abandoned by the resume)",
                     purged, step)
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
        w = self._new_writer(".kept")
        for ev in kept:
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
        return dropped

    def scalars(self, step: int, values: dict, wall_time: float | None = None) -> None:
        """One Summary event at `step` holding every finite number in `values` (tag -> value);
        others (None, NaN, strings) are skipped."""

        from tensorboard.compat.proto import event_pb2, summary_pb2  # optional extra
        vals = [summary_pb2.Summary.Value(tag=t, simple_value=float(v))
                for t, v in values.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if not vals or self._writer is None:
            return
        self._writer.add_event(event_pb2.Event(wall_time=wall_time or time.time(), step=step,
                                               summary=summary_pb2.Summary(value=vals)))

    def close(self) -> None:
        """Flush and close the live event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def step_scalars(rec: dict, ema: float | None) -> dict:
    """Tags -> values of one `.loss.json` step record (docs/history.md)."""
    out = {"train/loss": rec.get("loss"), "train/loss_ema": ema, "train/lr": rec.get("lr"),
           "train/grad_norm": rec.get("grad_norm"), "perf/tokens_per_s": rec.get("tokens_per_s"),
           "perf/mfu": rec.get("mfu") if (rec.get("mfu") or 0) <= 1 else None,
           "train/tokens": rec.get("tokens")}
    for arm, p in (rec.get("p") or {}).items():
        out[f"arms/p/{arm}"] = p
    for arm, v in (rec.get("arm_loss") or {}).items():
        out[f"arms/train_loss/{arm}"] = v
    for arm, v in (rec.get("probe") or {}).items():
        out[f"heldout/{arm}"] = v
    return out
