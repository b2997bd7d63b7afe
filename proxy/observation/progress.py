"""The proxy's progress line and end-of-run summary.

    step    110/600 | loss 5.2548 (ema 5.5467) | 10,839 tok/s | mfu 42.8% | lr 1.23e-03 | 0:01:12
    elapsed, eta 0:05:21 | p ...

Elapsed time counts from this proxy's start; the ETA to `--max-steps` uses the workers' own
record times over the last `RATE_WINDOW` steps (so checkpoints, probes and audits are in it).
MFU is the worker's per-step figure (worker/perf.py) rescaled to the line's windowed tokens/s
(`rescaled_mfu`), and left out above 100 % (`credible_mfu`, with one warning).

The summary (`format_summary`) is logged when the run stops (docs/operations.md#watching).

What it is not: the throughput accounting (worker/perf.py) or `status` (proxy/commands/status.py).
"""

from __future__ import annotations

import logging
import math
import shlex
import sys
import time
from collections import deque
from pathlib import Path

from proxy.run_files.loss_ema import recent_mean
from proxy.run_files.sidecars import read_audits
from shared.checkpoint.directory import scan_for_resume
from shared.checkpoint.file_format import CheckpointError
from shared.run.loss_history import tail_records

log = logging.getLogger("proxy")

RATE_WINDOW = 50  # steps over which the ETA's rate is measured


def python_command() -> str:
    """The interpreter to put in a printed command: the one running now, relative to the
    working directory when it lies under it (`.venv/bin/python`), else its absolute path; a
    bare `python` may be another interpreter without this project installed."""
    exe, cwd = Path(sys.executable or "python"), Path.cwd()
    return str(exe.relative_to(cwd) if exe.is_relative_to(cwd) else exe)


def fmt_duration(seconds: float | None) -> str:
    """`h:mm:ss` (or `Nd h:mm:ss` past a day); "--" for None or a non-finite value."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--"
    s = int(round(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h}:{m:02d}:{s:02d}"


def rescaled_mfu(rec: dict, tok_per_s: float | None) -> float | None:
    """MFU at `tok_per_s` (the line's windowed tokens/s), from the record's own MFU and
    tokens/s (their ratio is FLOPs per token / peak FLOP/s); None when unknown."""
    m, t = rec.get("mfu"), rec.get("tokens_per_s")
    if not isinstance(m, (int, float)) or not isinstance(t, (int, float)) or t <= 0:
        return None
    return m / t * (tok_per_s if tok_per_s else t)


def credible_mfu(rec: dict, tok_per_s: float | None) -> float | None:
    """`rescaled_mfu` when it is in [0, 1], else None (a peak that is too low cannot give a
    credible fraction)."""
    value = rescaled_mfu(rec, tok_per_s)
    return value if value is not None and 0 <= value <= 1 else None


def wall_seconds_per_update(records: list[dict], window: int = RATE_WINDOW) -> float | None:
    """Wall seconds per update over the last `window` steps of `records` (dicts with `step` and
    `time`, seconds since the epoch), checkpoints and audits included, as the progress line's
    ETA measures it. The window stops at a break in the steps or at a pause longer than 60 s and
    50 times the median step (a stop and resume is not training speed). None before 2 records."""
    pts = [
        (r["time"], r["step"])
        for r in records[-(window + 1) :]
        if isinstance(r.get("time"), (int, float)) and isinstance(r.get("step"), int)
    ]
    gaps = sorted(b[0] - a[0] for a, b in zip(pts, pts[1:]) if b[1] == a[1] + 1 and b[0] > a[0])
    if not gaps:
        return None
    pause = max(60.0, 50 * gaps[len(gaps) // 2])
    i = len(pts) - 1
    while i > 0 and pts[i][1] == pts[i - 1][1] + 1 and 0 < pts[i][0] - pts[i - 1][0] <= pause:
        i -= 1
    (t_a, s_a), (t_b, s_b) = pts[i], pts[-1]
    return (t_b - t_a) / (s_b - s_a) if s_b > s_a else None


class ProgressLine:
    """Formats the progress line; keeps the times it needs. `max_steps`: the run's target."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.t0 = time.monotonic()  # this proxy's start
        self.start_step: int | None = None  # the first incarnation's resume step
        self.window: deque = deque(maxlen=RATE_WINDOW + 1)  # (worker time, step)
        self._mfu_warned = False

    def on_incarnation(self, step: int) -> None:
        """A worker (re)starts from `step`: the rate window restarts (a restart's gap is not
        training speed)."""
        if self.start_step is None:
            self.start_step = step
        self.window.clear()

    def eta_seconds(self, step: int) -> float | None:
        """Seconds to `max_steps` at the window's rate; None before two records."""
        if len(self.window) < 2:
            return None
        (t_a, s_a), (t_b, s_b) = self.window[0], self.window[-1]
        if s_b <= s_a or t_b <= t_a:
            return None
        return max(0, self.max_steps - step) * (t_b - t_a) / (s_b - s_a)

    def observe(self, rec: dict) -> None:
        """Take a filed step record (`step`, `time` in seconds since the epoch)."""
        if isinstance(rec.get("time"), (int, float)):
            self.window.append((rec["time"], rec["step"]))

    def line(self, rec: dict, ema: float | None, tok_per_s: float | None) -> str:
        """The progress line for step record `rec` (call `observe(rec)` first)."""
        p = " ".join(f"{a}={v:.2f}" for a, v in sorted(rec.get("p", {}).items()))
        loss = f"{rec['loss']:.4f}" if rec.get("loss") is not None else "nan"
        mfu = credible_mfu(rec, tok_per_s)
        if mfu is None and rec.get("mfu") is not None and not self._mfu_warned:
            self._mfu_warned = True
            log.warning(
                "MFU left out of the progress line: %.0f%% of the peak the worker "
                "measured is not a credible fraction (on CPU the matmul peak is timed "
                "once at worker start and a busy machine makes it too low; see "
                "worker/perf.py)",
                100 * (rescaled_mfu(rec, tok_per_s) or 0.0),
            )
        mfu_s = f" | mfu {mfu:.1%}" if mfu is not None else ""
        lr = f"{rec['lr']:.2e}" if isinstance(rec.get("lr"), (int, float)) else "-"
        elapsed = fmt_duration(time.monotonic() - self.t0)
        eta = fmt_duration(self.eta_seconds(rec["step"]))
        return (
            f"step {rec['step']:>6}/{self.max_steps} | loss {loss} (ema {ema or 0:.4f}) | "
            f"{tok_per_s or 0:,.0f} tok/s{mfu_s} | lr {lr} | {elapsed} elapsed, eta {eta} | "
            f"p {p}"
        )


def _heldout(layout) -> tuple[int | None, dict]:
    """(step, {arm: held-out loss}) of the newest validation or probe in the history's tail or
    the newest sample audit in .samples.json, whichever is later; (None, {}) when there is
    none."""
    best: tuple[int | None, dict] = (None, {})
    for r in reversed(tail_records(layout.loss)):
        held = r.get("eval") or r.get("probe")
        if isinstance(held, dict) and held:
            best = (r["step"], held)
            break
    audits = read_audits(layout.samples)
    if audits and isinstance(audits[-1], dict) and audits[-1].get("step", -1) > (best[0] or -1):
        arms = audits[-1].get("arms", {})
        return audits[-1]["step"], {
            n: v["loss"] for n, v in arms.items() if isinstance(v.get("loss"), (int, float))
        }
    return best


MEAN_STEPS = 50  # the summary's plain mean of the last losses
PROMPT_TOKENS = 48  # tokens of the first arm read for the suggested sample prompt
PROMPT_CHARS = 24


def suggested_prompt(layout) -> str:
    """A sample prompt from the run's own data: the start of the first line of the first active
    arm's token file, decoded (at most PROMPT_CHARS characters, cut at a word's end), so the
    suggestion fits a C corpus as well as Python; "The " when it cannot be read."""
    try:
        # the tokenizers library costs ~0.35 s to import: only `run`'s start-up line needs it,
        # and `status` imports this module
        import numpy as np

        from shared.data.token_files import read_arm_index
        from shared.data.tokenizer import RunTokenizer

        arm = next(iter(read_arm_index(layout).values()))
        ids = np.asarray(arm.tokens(layout.root)[:PROMPT_TOKENS])
        text = RunTokenizer.load(layout.tokenizer).decode(ids.tolist())
        line = next((x.strip() for x in text.splitlines() if x.strip()), "")
        if len(line) > PROMPT_CHARS:
            cut = line.rfind(" ", 0, PROMPT_CHARS + 1)
            line = line[: cut + 1] if cut > 0 else line[:PROMPT_CHARS]
        return line or "The "
    except Exception:  # noqa: BLE001 - a suggestion only: never fail the summary for it
        return "The "


def format_summary(
    layout,
    cfg,
    start_step: int | None,
    end_step: int,
    ema: float | None,
    wall_s: float,
    max_steps: int,
    creation_s: float | None = None,
) -> str:
    """The end-of-run summary as one multi-line string (first line "run summary: ...").

    start_step: the step this proxy resumed from (None: no worker ran); end_step: the last
    step filed; tokens are sequences x context per step (cfg.batch_size x block_size); ema: the
    bias-corrected loss EMA (proxy/run_files/loss_ema.py), printed beside the plain mean of the
    last MEAN_STEPS losses; wall_s: seconds of training (from the supervisor's start),
    creation_s: seconds this start spent creating the run (None: it resumed one)."""
    per_step = cfg.batch_size * cfg.model.block_size
    start = end_step if start_step is None else start_step
    run = str(layout.root)
    lines = [
        f"run summary: {run}",
        f"  steps       {end_step - start:,} this start ({start:,} -> {end_step:,}), "
        f"{end_step:,} of {cfg.max_steps:,} planned in total"
        + (f" (this start's --max-steps {max_steps:,})" if max_steps != cfg.max_steps else ""),
        f"  tokens      {(end_step - start) * per_step:,} this start, "
        f"{end_step * per_step:,} in total",
        "  wall time   "
        + (
            f"{fmt_duration(creation_s + wall_s)} (creation "
            f"{fmt_duration(creation_s)}, training {fmt_duration(wall_s)})"
            if creation_s is not None
            else f"{fmt_duration(wall_s)} training (a resumed run: no creation)"
        ),
    ]
    mean, n = recent_mean(tail_records(layout.loss), MEAN_STEPS)
    lines.append(
        (
            "  train loss  EMA "
            + (f"{ema:.4f}" if ema is not None else "-")
            + (f", mean of the last {n} steps {mean:.4f}" if mean is not None else "")
        )
        if ema is not None or mean is not None
        else "  train loss  -"
    )
    at, probe = _heldout(layout)
    if probe:
        lines.append(
            f"  held-out    (step {at:,}) "
            + ", ".join(f"{a} {v:.3f}" for a, v in sorted(probe.items()))
        )
    try:
        info, _ = scan_for_resume(layout.root, cfg.n_params)
    except CheckpointError:
        info = None
    lines.append(
        f"  checkpoint  {info.path} (step {info.step:,})" if info else "  checkpoint  none yet"
    )
    # before the plan (run.json), a plain `run` goes on to it; past it, a longer --max-steps
    # with --replan re-plans the schedule to the new end (docs/configuration.md#the-schedule)
    more, why = "", ""
    if end_step >= cfg.max_steps:
        more = f" --max-steps {max(cfg.max_steps * 2, end_step + 1)} --replan"
        why = "   (past the plan: --replan continues the learning rate to the new end)"
    py = python_command()
    lines += [
        "  next:",
        f"    resume  {py} -m proxy run --run-dir {run}{more}{why}",
        f"    sample  {py} -m proxy sample --run-dir {run} --prompt "
        f"{shlex.quote(suggested_prompt(layout))} --samples 3",
        f"    plot    {py} -m proxy plot --run-dir {run} --out {run}/loss.png",
        f"    export  {py} -m proxy export --from-run {run} --format hf --to {Path(run).name}-hf",
    ]
    return "\n".join(lines)
