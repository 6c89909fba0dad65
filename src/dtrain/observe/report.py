"""``dtrain report RUN_DIR``: a text summary of a finished run, and plots when matplotlib is there.

``report.html`` and the comparison of several runs are :mod:`dtrain.observe.report_html`'s; the run
folder's files and ``curves.png`` are :mod:`dtrain.rundir`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dtrain.rundir.curves import plot, plot_run
from dtrain.rundir.files import read_metrics, read_summary

__all__ = ["report", "step_table", "plot_run"]  # plot_run: dtrain.rundir.curves's, under its old name


def step_table(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean per-step figures over all ranks: compute/comm/wait seconds and bytes sent."""
    out: dict[str, float] = {}
    for key in ("compute_s", "comm_s", "wait_s", "bytes_sent"):
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def _attribution(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The attribution of a run whose summary has none (older runs), from its rows."""
    if not rows:
        return None
    from dtrain.rundir.attribution import attribute

    return attribute(rows).to_dict()


def report(run_dir: str | Path) -> str:
    """Summarise a run folder (its summary and metrics rows); writes curves.png if it can."""
    d = Path(run_dir)
    summary, rows = read_summary(d), read_metrics(d)
    lines = [f"run folder      {d}"]
    for k in (
        "strategy",
        "workers",
        "world_size",
        "steps",
        "wall_s",
        "train_s",
        "samples_per_s",
        "test_accuracy",
        "val_loss",
        "perplexity",
        "time_to_target_s",
        "final_loss",
        "bytes_sent_per_step",
    ):
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
    for p in plot(d, rows, summary):
        lines.append(f"plot            {p}")
    return "\n".join(lines)
