"""``dtrain report RUN_DIR``: a text summary of a finished run, and plots when matplotlib is there.

``report.html`` and the comparison of several runs are :mod:`dtrain.observe.report_html`'s (this module
stays free of the planner's imports: ``dtrain run`` imports it to draw curves.png)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from dtrain.errors import DTrainError

__all__ = ["report", "step_table", "plot_run"]


def step_table(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean per-step figures over all ranks: compute/comm/wait seconds and bytes sent."""
    out: dict[str, float] = {}
    for key in ("compute_s", "comm_s", "wait_s", "bytes_sent"):
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def _plot(run_dir: Path, rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[Path]:
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
    noise = [(int(r["step"]), r["b_simple"], r["batch"]) for r in rows
             if r.get("rank", 0) == 0 and r.get("b_simple") is not None and "batch" in r]  # fmt: skip
    fig, axes = plt.subplots(1, 3 if noise else 2, figsize=(15 if noise else 10, 3.6))
    axes[0].plot(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps])
    axes[0].set(xlabel="step", ylabel="training loss (mean over ranks)", yscale="log", title="loss")
    hist = summary.get("metric_history") or [{"train_s": h[0], "value": h[2]} for h in
                                             summary.get("accuracy_history") or []]
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


def _attribution(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The attribution of a run whose summary.json has none (older runs), from its rows."""
    if not rows:
        return None
    from dtrain.observe.attribution import attribute

    return attribute(rows).to_dict()


def _load(d: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = json.loads((d / "summary.json").read_text())
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (d / "metrics.jsonl").is_file() else []
    return summary, rows


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the run's plots (curves.png) into its folder; nothing if matplotlib is missing."""
    d = Path(run_dir)
    summary, rows = _load(d)
    return _plot(d, rows, summary)


def report(run_dir: str | Path) -> str:
    """Summarise a run folder (summary.json + metrics.jsonl); writes curves.png if it can."""
    d = Path(run_dir)
    if not (d / "summary.json").is_file():
        raise DTrainError(f"{d} is not a finished run folder (no summary.json)")
    summary, rows = _load(d)
    lines = [f"run folder      {d}"]
    for k in ("strategy", "workers", "world_size", "steps", "wall_s", "train_s", "samples_per_s",
              "test_accuracy", "val_loss", "perplexity", "time_to_target_s", "final_loss", "bytes_sent_per_step"):
        v = summary.get(k)
        if v is not None:
            lines.append(f"{k:<15} {v:.4g}" if isinstance(v, float) else f"{k:<15} {v}")
    for k, v in step_table(rows).items():
        lines.append(f"mean {k:<10} {v:.4g}")
    if summary.get("noise_scale") is not None:
        lines.append(f"noise scale     B_simple {summary['noise_scale']:.4g} (smoothed, last step)")
    for d_ in summary.get("batch_decisions") or []:  # auto: one per epoch, or (--auto-every) one per change
        at = f"epoch {d_['epoch']:<3}" if "epoch" in d_ else f"step {d_['step']:<4}"
        lines.append(f"batch {at} {d_['batch']}")
    if "staleness" in summary:
        s = summary["staleness"]
        lines.append(f"staleness       max {s.get('max')} mean {s.get('mean', 0):.3g}")
    attribution = summary.get("attribution") or _attribution(rows)
    if attribution:  # who the others waited for, what bounds the step
        lines.append(f"attribution     {attribution['line']}")
    for p in _plot(d, rows, summary):
        lines.append(f"plot            {p}")
    return "\n".join(lines)
