"""A run's ``curves.png``: the training loss over steps, the metric over training time, and (with
``--noise-scale`` or ``--batch-schedule auto``) the gradient noise scale beside the batch.

``dtrain run`` draws it when the run ends (and ``dtrain report`` again); nothing is drawn without
matplotlib.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from dtrain.rundir.files import read_metrics, read_summary

__all__ = ["plot_run", "plot"]


def plot(run_dir: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[Path]:
    """Draw ``curves.png`` into ``run_dir`` from its rows and summary; its path, or nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    by_step: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        by_step[int(r["step"])].append(float(r["loss"]))
    steps = sorted(by_step)
    noise = [
        (int(r["step"]), r["b_simple"], r["batch"])
        for r in rows
        if r.get("rank", 0) == 0 and r.get("b_simple") is not None and "batch" in r
    ]
    fig, axes = plt.subplots(1, 3 if noise else 2, figsize=(15 if noise else 10, 3.6))
    axes[0].plot(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps])
    axes[0].set(xlabel="step", ylabel="training loss (mean over ranks)", yscale="log", title="loss")
    hist = summary.get("metric_history") or [
        {"train_s": h[0], "value": h[2]} for h in summary.get("accuracy_history") or []
    ]
    name = summary.get("metric_name") or "test_accuracy"
    if hist:
        axes[1].plot([h["train_s"] for h in hist], [h["value"] for h in hist], marker="o")
        label = "validation loss (nats/token)" if name == "val_loss" else "test accuracy"
        axes[1].set(xlabel="training time (s)", ylabel=label, title=label.split(" (")[0])
    if noise:  # the gradient noise scale beside the batch in use (--noise-scale, --batch-schedule auto)
        axes[2].plot([n[0] for n in noise], [n[1] for n in noise], label="noise scale B_simple")
        axes[2].step([n[0] for n in noise], [n[2] for n in noise], where="post", label="global batch")
        axes[2].set(xlabel="step", ylabel="samples", yscale="log", title="gradient noise scale vs batch")
        axes[2].legend()
    fig.suptitle(f"{summary.get('strategy')} x {summary.get('workers')} workers")
    fig.tight_layout()
    path = run_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the run's plots (curves.png) into its folder; nothing if matplotlib is missing."""
    d = Path(run_dir)
    return plot(d, read_metrics(d), read_summary(d))
