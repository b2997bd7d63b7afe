"""The picture of a run that `python -m proxy plot` writes (docs/operations.md).

Three panels over steps, from `.loss.json` and `phases.json`: the training loss with its EMA
(beta 0.95), the held-out probe loss per arm, and the arm mixture (the p recorded with each
step) as a stacked area. Pivots (phase starts after step 0) are vertical dashed lines labelled
with the phase label; collapse alarms are red markers. matplotlib with the Agg backend (no
display needed). Default output: DIR/loss.png.

Memory does not grow with the history (docs/operations.md#watching): the records are read one line
at a time and each series is kept as at most MAX_POINTS buckets (`Buckets`, which says how).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from proxy.run_files.loss_ema import BETA, LossEma, finite_number
from proxy.run_files.phases import phase_entries
from shared.run.layout import RunLayout
from shared.run.loss_history import iter_records

MAX_POINTS = 2048  # buckets per series: about two per pixel column of the 1000-pixel figure


class Buckets:
    """A series of points (step, value) reduced to at most `cap` buckets of `width` consecutive
    points each (the last one possibly partial); `width` doubles, merging neighbours pairwise,
    whenever a point would need bucket number cap + 1. Memory: `cap` buckets, whatever the
    number of points. A bucket is a list [first step, count, *stats]; `start(value)` makes the
    stats of one point, `add(stats_list, value)` adds a point in place, `merge(a, b)` returns
    the stats of two neighbouring buckets. Raises ValueError when cap is odd or < 2."""

    def __init__(
        self,
        start: Callable[[Any], list],
        add: Callable[[list, Any], None],
        merge: Callable[[list, list], list],
        cap: int = MAX_POINTS,
    ) -> None:
        if cap < 2 or cap % 2:
            raise ValueError(f"cap {cap}: must be an even number >= 2")
        self._start, self._add, self._merge, self.cap = start, add, merge, cap
        self.width, self.points = 1, 0
        self.buckets: list[list] = []

    def push(self, step: int, value) -> None:
        """Add one point (steps in increasing order)."""
        self.points += 1
        if self.buckets and self.buckets[-1][1] < self.width:
            b = self.buckets[-1]
            b[1] += 1
            self._add(b, value)
            return
        if len(self.buckets) == self.cap:  # every bucket is full: halve their number
            bs = self.buckets
            self.buckets = [
                [bs[i][0], bs[i][1] + bs[i + 1][1], *self._merge(bs[i], bs[i + 1])]
                for i in range(0, len(bs), 2)
            ]
            self.width *= 2  # cap is even and every bucket was full: all are full again
        self.buckets.append([step, 1, *self._start(value)])


# A loss bucket: [step, count, sum, lowest, highest, ema at its last point]; a point is (x, ema).
def _loss_start(p) -> list:
    return [p[0], p[0], p[0], p[1]]


def _loss_add(b: list, p) -> None:
    b[2] += p[0]
    b[3] = min(b[3], p[0])
    b[4] = max(b[4], p[0])
    b[5] = p[1]


def _loss_merge(a: list, b: list) -> list:
    return [a[2] + b[2], min(a[3], b[3]), max(a[4], b[4]), b[5]]


# A mean bucket: [step, count, sum]; a mixture bucket: [step, count, {arm: sum of p}].
def _sum_add(b: list, x) -> None:
    b[2] += x


def _mix_add(b: list, p: dict) -> None:
    for a, x in p.items():
        b[2][a] = b[2].get(a, 0.0) + x


def _mix_merge(a: list, b: list) -> list:
    return [{k: a[2].get(k, 0.0) + b[2].get(k, 0.0) for k in a[2] | b[2]}]


def series(records: Iterable[dict], max_points: int = MAX_POINTS) -> dict:
    """The plotted series from `records` (dicts in step order, consumed one at a time):
    steps (each bucket's first step), loss (bucket means), loss_low / loss_high (bucket
    extremes), ema (the bias-corrected EMA at each bucket's last step), count (finite losses
    seen), width (finite losses per loss bucket but the last; 1: every loss drawn), probe
    {arm: (steps, mean losses)}, eval (the validation curve) and arm_loss (each arm's training
    loss) of the same shape, mix_steps, mix {arm: [mean p]}, alarms [step]. Each series holds
    at most `max_points` buckets (`Buckets`); with fewer points than that every value is the
    record's own. Non-finite losses are left out of the loss line; an arm missing from a
    record's p counts as 0 there."""
    e = LossEma()
    loss = Buckets(_loss_start, _loss_add, _loss_merge, max_points)
    per_arm: dict[str, dict[str, Buckets]] = {"probe": {}, "eval": {}, "arm_loss": {}}
    mix = Buckets(lambda p: [dict(p)], _mix_add, _mix_merge, max_points)
    alarms = Buckets(lambda _: [], lambda b, _: None, lambda a, b: [], max_points)
    for r in records:
        x = r.get("loss")
        if finite_number(x):
            loss.push(r["step"], (float(x), e.update(x)))
        for field, into in per_arm.items():
            for a, v in (r.get(field) or {}).items():
                if finite_number(v):
                    if a not in into:
                        into[a] = Buckets(
                            lambda v: [v], _sum_add, lambda a, b: [a[2] + b[2]], max_points
                        )
                    into[a].push(r["step"], float(v))
        p = r.get("p")
        if p:
            mix.push(r["step"], {a: float(v) for a, v in p.items()})
        if r.get("alarm"):
            alarms.push(r["step"], None)
    arms = sorted({a for b in mix.buckets for a in b[2]})
    lb = loss.buckets
    return {
        "steps": [b[0] for b in lb],
        "loss": [b[2] / b[1] for b in lb],
        "loss_low": [b[3] for b in lb],
        "loss_high": [b[4] for b in lb],
        "ema": [b[5] for b in lb],
        "count": loss.points,
        "width": loss.width,
        **{
            field: {
                a: ([b[0] for b in s.buckets], [b[2] / b[1] for b in s.buckets])
                for a, s in into.items()
            }
            for field, into in per_arm.items()
        },
        "mix_steps": [b[0] for b in mix.buckets],
        "mix": {a: [b[2].get(a, 0.0) / b[1] for b in mix.buckets] for a in arms},
        "alarms": [b[0] for b in alarms.buckets],
    }


def read_series(path: Path, max_points: int = MAX_POINTS) -> dict:
    """`series` of the history at `path`, streamed line by line (`iter_records`: tolerant, a
    missing file gives empty series). Memory: one line plus `max_points` buckets per series."""
    return series(iter_records(path), max_points)


def plot_run(
    run_dir: Path, out: Path | None = None, gates: Iterable[tuple[int, bool]] = ()
) -> Path:
    """Write the PNG; returns its path. Raises FileNotFoundError when the run has no history.
    Memory is bounded by MAX_POINTS per series, not by the history's length (`series`). The
    mixture panel marks `gates`, the (step, opened) where the default policy's gate opened and
    closed (proxy/mixture/rebuild.py `gate_changes`)."""
    import matplotlib  # heavy (about a second): only `plot` needs it, so it is imported here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = RunLayout(run_dir)
    if not layout.loss.exists():
        raise FileNotFoundError(f"{layout.root}: no history to plot yet (no {layout.loss.name})")
    s = read_series(layout.loss)
    phases = phase_entries(layout)
    out = Path(out) if out else layout.plot
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    if len(s["steps"]) < s["count"]:  # decimated: the band is each bucket's lowest..highest
        ax1.fill_between(
            s["steps"], s["loss_low"], s["loss_high"], lw=0, alpha=0.25, label="loss range"
        )
    ax1.plot(s["steps"], s["loss"], lw=0.6, alpha=0.5, label="loss")
    ax1.plot(s["steps"], s["ema"], lw=1.5, label=f"EMA ({BETA:g}, bias-corrected)")
    every_arm = sorted(set(s["mix"]) | set(s["arm_loss"]) | set(s["eval"]) | set(s["probe"]))
    color = {a: f"C{(i + 2) % 10}" for i, a in enumerate(every_arm)}  # C0, C1: loss, EMA
    for a, (xs, ys) in sorted(s["arm_loss"].items()):
        ax1.plot(xs, ys, lw=0.7, alpha=0.6, color=color[a], label=f"{a} (training)")
    for st in s["alarms"]:
        ax1.axvline(st, color="red", lw=1.0)
    ax1.set_ylabel("training loss (nats)")
    ax1.legend(loc="best", fontsize="small")
    for a, (xs, ys) in sorted(s["eval"].items()):
        ax2.plot(xs, ys, marker=".", lw=1.2, color=color[a], label=f"{a} (validation)")
    for a, (xs, ys) in sorted(s["probe"].items()):
        ax2.plot(xs, ys, ls="--", lw=0.8, color=color[a], label=f"{a} (bandit probe)")
    ax2.set_ylabel("held-out loss (nats)")
    if s["probe"] or s["eval"]:
        ax2.legend(loc="best", fontsize="small")
    else:
        ax2.text(
            0.5,
            0.5,
            "no held-out loss yet: the validation runs every --eval-every steps",
            ha="center",
            va="center",
            transform=ax2.transAxes,
            color="gray",
        )
    if s["mix_steps"]:
        names = sorted(s["mix"])
        ax3.stackplot(
            s["mix_steps"],
            [s["mix"][a] for a in names],
            labels=names,
            colors=[color[a] for a in names],
            alpha=0.8,
        )
        ax3.legend(loc="upper right", fontsize="small")
    side = dict(xycoords=("data", "axes fraction"), rotation=90, ha="right", fontsize="small")
    for step, opened in gates:
        ax3.axvline(step, color="green" if opened else "gray", ls=":", lw=1.2)
        ax3.annotate("gate open" if opened else "gate closed", (step, 0.02), va="bottom", **side)
    ax3.set_ylim(0, 1)
    ax3.set_ylabel("arm mixture p")
    ax3.set_xlabel("step")
    for ph in phases:
        if ph.get("start_step", 0) > 0:
            for ax in (ax1, ax2, ax3):
                ax.axvline(ph["start_step"], color="k", ls="--", lw=1.0)
            ax1.annotate(
                f"pivot {ph.get('index')}: {ph.get('label')}",
                (ph["start_step"], 1.0),
                va="top",
                **side,
            )
    fig.suptitle(f"{layout.root.name}: {s['count']:,} steps, {len(phases)} phase(s)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)  # --out into a folder not made yet
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
