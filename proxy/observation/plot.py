"""The picture of a run that `python -m proxy plot` writes (docs/operations.md).

Three panels over steps, from `.loss.json` and `phases.json`: the training loss with its EMA
(beta 0.95), the held-out probe loss per arm, and the arm mixture (the p recorded with each
step) as a stacked area. Pivots (phase starts after step 0) are vertical dashed lines labelled
with the phase label; collapse alarms are red markers. matplotlib with the Agg backend (no
display needed). Default output: DIR/loss.png.
"""

from __future__ import annotations

import math
from pathlib import Path

from proxy.run_files.loss_ema import BETA, LossEma
from proxy.run_files.phases import phase_entries
from shared.loss_history import read_records
from shared.run_layout import RunLayout


def series(records: list[dict]) -> dict:
    """The plotted series: steps, loss, ema, probe {arm: (steps, losses)}, mix {arm: [p]},
    alarms [step]. Non-finite losses are left out of the loss line."""
    steps, loss, ema, e = [], [], [], LossEma()
    probe: dict[str, tuple[list, list]] = {}
    arms = sorted({a for r in records for a in (r.get("p") or {})})
    mix: dict[str, list[float]] = {a: [] for a in arms}
    mix_steps, alarms = [], []
    for r in records:
        x = r.get("loss")
        if isinstance(x, (int, float)) and math.isfinite(x):
            steps.append(r["step"])
            loss.append(x)
            ema.append(e.update(x))
        for a, v in (r.get("probe") or {}).items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                probe.setdefault(a, ([], []))
                probe[a][0].append(r["step"])
                probe[a][1].append(v)
        if r.get("p"):
            mix_steps.append(r["step"])
            for a in arms:
                mix[a].append(float(r["p"].get(a, 0.0)))
        if r.get("alarm"):
            alarms.append(r["step"])
    return {
        "steps": steps,
        "loss": loss,
        "ema": ema,
        "probe": probe,
        "mix_steps": mix_steps,
        "mix": mix,
        "alarms": alarms,
    }


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the PNG; returns its path. Raises FileNotFoundError when the run has no history."""
    import matplotlib  # heavy (about a second): only `plot` needs it, so it is imported here

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = RunLayout(run_dir)
    if not layout.loss.exists():
        raise FileNotFoundError(f"{layout.loss}: no history to plot (has the run started?)")
    s = series(read_records(layout.loss))
    phases = phase_entries(layout)
    out = Path(out) if out else layout.root / "loss.png"
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    ax1.plot(s["steps"], s["loss"], lw=0.6, alpha=0.5, label="loss")
    ax1.plot(s["steps"], s["ema"], lw=1.5, label=f"EMA ({BETA:g}, bias-corrected)")
    for st in s["alarms"]:
        ax1.axvline(st, color="red", lw=1.0)
    ax1.set_ylabel("training loss (nats)")
    ax1.legend(loc="upper right")
    for a, (xs, ys) in sorted(s["probe"].items()):
        ax2.plot(xs, ys, marker=".", lw=1.0, label=a)
    ax2.set_ylabel("held-out probe loss (nats)")
    if s["probe"]:
        ax2.legend(loc="upper right", fontsize="small")
    if s["mix_steps"]:
        names = sorted(s["mix"])
        ax3.stackplot(s["mix_steps"], [s["mix"][a] for a in names], labels=names, alpha=0.8)
        ax3.legend(loc="upper right", fontsize="small")
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
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize="small",
            )
    fig.suptitle(f"{layout.root.name}: {len(s['steps']):,} steps, {len(phases)} phase(s)")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)  # --out into a folder not made yet
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
