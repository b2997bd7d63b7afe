"""Progress of a long byte-counted job (tokenizing an arm): a tqdm bar on a terminal, plain log
lines every few seconds otherwise (docs/data.md#progress).

What it is not: the training progress lines (`proxy/observation/progress.py`).
"""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("andrea.data")


def megabytes(n: float) -> str:
    """`n` bytes as "1,234.5 MB" (decimal megabytes), the unit of every progress line."""
    return f"{n / 1e6:,.1f} MB"


class Progress:
    """`update(done)` with `done` bytes of `total`; `close()` ends the bar.

    stream: where the bar goes (stderr); a bar (tqdm) only when it is a TTY,
    else one log line "<label>: X of Y MB (P %), R MB/s, ETA S s" every `every` seconds
    (None: $ANDREA_PROGRESS_SECONDS, else 5)."""

    def __init__(self, label: str, total: int, stream=None, every: float | None = None) -> None:
        self.label, self.total = label, max(0, int(total))
        self.stream = sys.stderr if stream is None else stream
        if every is None:
            try:
                every = max(0.0, float(os.environ.get("ANDREA_PROGRESS_SECONDS", "5")))
            except ValueError:
                every = 5.0
        self.every = every
        self.last = self.rate_t0 = time.monotonic()  # the rate counts from here (`restart_rate`)
        self.done = self.rate_from = 0
        self.bar = None
        if getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm  # only a terminal needs it

            self.bar = tqdm(
                total=self.total,
                desc=label,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                file=self.stream,
                dynamic_ncols=True,
                mininterval=0.25,
            )

    def line(self) -> str:
        dt = max(1e-9, time.monotonic() - self.rate_t0)
        rate = (self.done - self.rate_from) / dt
        pct = 100.0 * self.done / self.total if self.total else 100.0
        eta_s = f"{(self.total - self.done) / rate:,.0f} s" if rate > 0 else "?"
        return (
            f"{self.label}: {megabytes(self.done)} of {megabytes(self.total)} ({pct:.0f} %), "
            f"{rate / 1e6:,.1f} MB/s, ETA {eta_s}"
        )

    def update(self, done: int) -> None:
        done = min(int(done), self.total) if self.total else int(done)
        gained, self.done = done - self.done, done
        if self.bar is not None:
            self.bar.update(max(0, gained))
            return
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            log.info("%s", self.line())

    def restart_rate(self) -> None:
        """Measure the rate (and so the ETA) from now and the bytes done so far: what came
        before was not work at this job's speed (a resumed arm's part re-read only for its hash)."""
        self.rate_from, self.rate_t0 = self.done, time.monotonic()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
