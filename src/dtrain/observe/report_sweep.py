"""``report.html`` of a sweep folder (``dtrain report SWEEP``): what ``dtrain sweep`` found and how.

From ``sweep.json`` and the trials' ``trial.json`` (:mod:`dtrain.search`): the best configuration, a table of
every trial (configuration, fate, metric, steps trained, exploits), the metric of every trial over its
steps, and for population-based training the lineage (who copied whom at which step, with what
hyper-parameters) and each hyper-parameter's schedule per trial over the steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtrain.errors import DTrainError
from dtrain.observe.charts import PALETTE, Series, line_chart
from dtrain.observe.report_html import page, section, table

__all__ = ["is_sweep", "sweep_report", "write_sweep_report"]

SWEEP_FILE = "sweep.json"


def is_sweep(folder: str | Path) -> bool:
    """Whether ``folder`` is a sweep folder (holds ``sweep.json``)."""
    return (Path(folder) / SWEEP_FILE).is_file()


def _load(folder: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((folder / SWEEP_FILE).read_text()))
    except (OSError, ValueError) as e:
        raise DTrainError(f"{folder / SWEEP_FILE}: cannot read it ({e})") from None


def _segments(folder: Path, trial: dict[str, Any]) -> list[dict[str, Any]]:
    p = folder / trial["folder"] / "trial.json"
    return list(json.loads(p.read_text()).get("segments", [])) if p.is_file() else []


def _value(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _trials_part(doc: dict[str, Any]) -> str:
    keys = list(doc["space"])
    rows = []
    for t in sorted(
        doc["trials"],
        key=lambda t: (t["metric"] is None, -(t["metric"] or 0) if doc["mode"] == "max" else (t["metric"] or 0)),
    ):
        exploits = "; ".join(f"from {e['from_trial']} at step {e['at_step']}" for e in t["exploits"])
        rows.append(
            [
                t["trial"],
                *[_value(t["config"].get(k)) for k in keys],
                t["fate"] + (f": {t['error']}" if t.get("error") else ""),
                t["metric"],
                t.get("steps_trained"),
                exploits,
            ]
        )
    return table(["trial", *keys, "fate", doc["metric"], "steps trained", "exploits"], rows, "trials")


def _metric_part(doc: dict[str, Any]) -> str:
    series = []
    for i, t in enumerate(doc["trials"]):
        h = [x for x in t["history"] if isinstance(x.get("value"), (int, float))]
        if h:
            series.append(
                Series(
                    t["trial"], [float(x["step"]) for x in h], [float(x["value"]) for x in h], PALETTE[i % len(PALETTE)]
                )
            )
    if not series:
        return ""
    return line_chart(
        series,
        title=f"{doc['metric']} of every trial",
        xlabel="step",
        ylabel=doc["metric"],
        logy=doc["metric"] == "val_loss",
    )


def _lineage_part(folder: Path, doc: dict[str, Any]) -> str:
    """PBT: every exploit as a row, and each hyper-parameter's value per trial over the steps."""
    rows, charts = [], []
    schedules: dict[str, list[Series]] = {k: [] for k in doc["space"]}
    for i, t in enumerate(doc["trials"]):
        segs = _segments(folder, t)
        points: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in doc["space"]}
        for s in segs:
            start = float((s.get("from") or {}).get("step") or 0)
            end = max([float(e["step"]) for e in s.get("evals", [])] + [start])
            for k in doc["space"]:
                if isinstance(s["hp"].get(k), (int, float)):
                    points[k][0].extend([start, end])
                    points[k][1].extend([float(s["hp"][k])] * 2)
            donor = s.get("from") or {}
            if donor.get("trial") not in (None, t["trial"]):
                rows.append(
                    [
                        donor.get("step"),
                        t["trial"],
                        donor["trial"],
                        _value(donor.get("value")),
                        ", ".join(f"{k}={_value(v)}" for k, v in s["hp"].items()),
                    ]
                )
        for k, (xs, ys) in points.items():
            if xs:
                schedules[k].append(Series(t["trial"], xs, ys, PALETTE[i % len(PALETTE)], steps=True))
    if not rows and doc["scheduler"] != "pbt":
        return ""
    for k, series in schedules.items():
        if series:
            charts.append(
                line_chart(series, title=f"{k} of every trial over the steps", xlabel="step", ylabel=k, logy=k == "lr")
            )
    head = ["step", "trial", "copied from", f"donor's {doc['metric']}", "went on with"]
    lineage = table(head, sorted(rows, key=lambda r: (r[0] or 0, r[1])), "lineage") if rows else "<p>no exploit</p>"
    return lineage + "".join(charts)


def sweep_report(folder: str | Path) -> tuple[str, str]:
    """(the page, the text summary ``dtrain report`` prints) of the sweep folder ``folder``."""
    folder = Path(folder)
    doc = _load(folder)
    best = doc.get("best")
    best_part = "<p>no trial reported</p>"
    if best:
        best_part = table(
            ["key", "value"],
            [
                ["trial", best["trial"]],
                [doc["metric"], best["metric"]],
                *[[k, _value(v)] for k, v in best["config"].items()],
            ],
        )
    title = f"dtrain sweep: {doc['search']} search, {doc['scheduler']}, {doc['trials_run']} trials"
    head = (
        f"<p>{folder}: {doc['metric']} ({doc['mode']}), {doc['steps_trained']} steps trained, "
        f"{doc['wall_s']:.0f} s; space: " + ", ".join(f"{k} = {v}" for k, v in doc["space"].items()) + "</p>"
    )
    html = page(
        title,
        head,
        [
            section("Best configuration", best_part, "best"),
            section("Trials", _trials_part(doc), "trials"),
            section("The metric over the steps", _metric_part(doc), "metric"),
            section("Population-based training: lineage and schedules", _lineage_part(folder, doc), "lineage"),
        ],
    )
    fates: dict[str, int] = {}
    for t in doc["trials"]:
        fates[t["fate"]] = fates.get(t["fate"], 0) + 1
    text = [title, "trials          " + ", ".join(f"{n} {f}" for f, n in fates.items())]
    if best:
        text.append(
            f"best            trial {best['trial']}: {doc['metric']} {best['metric']:.4f}; "
            + " ".join(f"{k}={_value(v)}" for k, v in best["config"].items())
        )
    return html, "\n".join(text)


def write_sweep_report(folder: str | Path, out: str | Path | None = None) -> tuple[Path, str]:
    """Write the sweep's report.html (into ``out``, a file or a folder; default: the sweep folder)."""
    html, text = sweep_report(folder)
    path = Path(out) if out is not None else Path(folder) / "report.html"
    if path.is_dir() or (out is not None and not path.suffix):
        path = path / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html)
    return path, text
