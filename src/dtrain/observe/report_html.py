"""``report.html``: one self-contained page (inline SVG and CSS, a few lines of script, no network)
for one run folder, or a comparison of several on the same axes.

What the page shows, each part only where a run has the data:

1. a summary table (one column per run) and, for several runs, the differences from the first
   (:func:`~dtrain.observe.report_data.deltas`: step time, samples/s, the metric, bytes per step, final loss);
2. curves: training loss, throughput and step time per step, the metric over training time, and
   the gradient noise scale beside the batch in use (``--noise-scale``);
3. per rank the mean step split into own work, communication and waiting for a later rank (the
   definitions of :mod:`dtrain.observe.attribution`), the parameter server's staleness histogram, and the
   strategy's options (algorithm, bucket size, compression, servers, schedule) with bytes per step;
4. a pipeline's measured schedule, drawn from the trace's action spans of its median step, next to
   the schedule's plan (:func:`dtrain.pipeline.schedules.simulate` at the measured mean forward and
   backward times), with the bubble three ways: the metrics rows' ``bubble``, the one computed from
   the trace's spans (:func:`~dtrain.observe.report_data.span_bubbles`) and the closed form ``(P-1)/(v*M+P-1)``;
5. the performance model's predicted step beside the measured one, where the summary holds a
   prediction or ``dtrain report --predict`` made one
   (:func:`~dtrain.observe.report_data.predict`; it may calibrate first).

The raw trace is never embedded: :func:`~dtrain.observe.report_data.digest_trace` keeps the step windows and the
pipeline's actions ("X" events; every other event kind and unknown key is ignored), and series longer than
400 points are sampled down. The page records JavaScript errors in ``<html data-js-errors>`` and its
load-and-layout time in ``<body data-render-ms>`` (what the browser test reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from pathlib import Path
from typing import Any

from dtrain.errors import DTrainError
from dtrain.observe.charts import PALETTE, Box, Series, bar_chart, downsample, fmt, line_chart, timeline
from dtrain.observe.report_data import (
    COMPUTE_OPS,
    DELTA_KEYS,
    RunData,
    TraceDigest,
    after_warmup,
    by_rank,
    deltas,
    figures,
    load_run,
    number,
    per_step,
    pipeline_bubbles,
    predict,
    rank_breakdown,
    schedule_shape,
)

__all__ = ["build_html", "write_report", "report_runs", "page", "table", "section"]

_OP_COLOURS = {"F": "#4e79a7", "B": "#59a14f", "I": "#8cd17d", "W": "#b6992d", "U": "#e15759"}
_KIND_COLOURS = (("own work", "#4e79a7"), ("communication", "#f28e2b"), ("waiting for a later rank", "#bab0ac"))


# ---------------------------------------------------------------------------------------------- page parts


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str = "") -> str:
    def cell(v: Any) -> str:
        return "" if v is None else fmt(v) if isinstance(v, float) else str(v)

    h = "".join(f"<th>{escape(x)}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{escape(cell(v))}</td>" for v in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def section(title: str, body: str, sid: str) -> str:
    return f'<section id="{sid}"><h2>{escape(title)}</h2>\n{body}\n</section>' if body else ""


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _short(i: int, run: RunData) -> str:
    """A run's legend entry: its letter and strategy (the run list at the top has the rest)."""
    return f"{_letter(i)}: {run.summary.get('strategy', run.path.name)}"


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"R{i}"


def _summary_part(runs: Sequence[RunData]) -> str:
    keys = (
        "strategy",
        "workers",
        "world_size",
        "steps",
        "global_batch",
        "wall_s",
        "train_s",
        "samples_per_s",
        "metric_name",
        "metric",
        "final_loss",
        "bytes_sent_per_step",
        "time_to_target_s",
        "noise_scale",
    )
    rows: list[list[Any]] = []
    for k in keys:
        vals = [r.summary.get(k) for r in runs]
        if any(v is not None for v in vals):
            rows.append([k, *vals])
    rows.append(["step ms (median)", *[figures(r)["step_ms"] for r in runs]])
    head = ["", *[f"{_letter(i)}: {r.label}" for i, r in enumerate(runs)]]
    out = table(head, rows, "summary")
    for i, r in enumerate(runs):
        att = r.summary.get("attribution")
        if isinstance(att, dict) and att.get("line"):
            out += f'<p class="note">{_letter(i)}: {escape(str(att["line"]))}</p>'
    return out


def _deltas_part(runs: Sequence[RunData]) -> str:
    if len(runs) < 2:
        return ""
    base = figures(runs[0])
    rows: list[list[Any]] = [[f"A (base): {runs[0].label}", *[base[k] for k, _, _ in DELTA_KEYS]]]
    for i, d in enumerate(deltas(runs), 1):
        cells: list[Any] = [f"{_letter(i)}: {d['run']}"]
        for key, _, _ in DELTA_KEYS:
            v = d[key]
            if v["diff"] is None:
                cells.append(v["value"])
                continue
            rel = f" ({v['rel']:+.1%})" if v["rel"] is not None else ""
            cells.append(f"{fmt(v['value'])}, {'+' if v['diff'] >= 0 else ''}{fmt(v['diff'])}{rel}")
        rows.append(cells)
    return table(["run", *[label for _, label, _ in DELTA_KEYS]], rows, "deltas")


def _series(
    runs: Sequence[RunData], key: str, scale: float = 1.0, per_batch: bool = False, warm: bool = False
) -> list[Series]:
    """Per run, the mean over ranks of ``key`` per step (``warm``: after the first step)."""
    out = []
    for i, r in enumerate(runs):
        per = per_step(r.rows, key)
        if warm:
            keep = after_warmup(list(per))
            per = {s: v for s, v in per.items() if s in keep}
        if per_batch:  # global samples per second: the step's batch over the ranks' mean step time
            batch = per_step(r.rows, "batch") or {}
            g = number(r.summary.get("global_batch")) or 0.0
            per = {s: batch.get(s, g) / v for s, v in per.items() if v > 0}
        xs, ys = downsample(list(per), [v * scale for v in per.values()])
        if xs:
            out.append(Series(_short(i, r), xs, ys, _colour(i), f"run-{i}"))
    return out


def _curves_part(runs: Sequence[RunData]) -> str:
    charts = [
        line_chart(
            _series(runs, "loss"), title="training loss (mean over ranks)", xlabel="step", ylabel="loss", logy=True
        ),
        line_chart(
            _series(runs, "step_s", per_batch=True, warm=True),
            title="throughput (after the first step)",
            xlabel="step",
            ylabel="samples/s (batch / mean step time)",
        ),
        line_chart(
            _series(runs, "step_s", 1e3, warm=True),
            title="step time (after the first step)",
            xlabel="step",
            ylabel="ms",
        ),
    ]
    metric = []
    for i, r in enumerate(runs):
        hist = [h for h in r.summary.get("metric_history") or [] if isinstance(h, dict)]
        pts = [(number(h.get("train_s")), number(h.get("value"))) for h in hist]
        good = [(x, y) for x, y in pts if x is not None and y is not None]
        if good:
            metric.append(Series(_short(i, r), [p[0] for p in good], [p[1] for p in good], _colour(i), f"run-{i}"))
    if metric:
        name = next((str(r.summary.get("metric_name")) for r in runs if r.summary.get("metric_name")), "metric")
        charts.append(line_chart(metric, title=name, xlabel="training time (s)", ylabel=name))
    noise = _noise_series(runs)
    if noise:
        charts.append(
            line_chart(noise, title="gradient noise scale vs batch", xlabel="step", ylabel="samples", logy=True)
        )
    return '<div class="charts">' + "\n".join(charts) + "</div>"


def _noise_series(runs: Sequence[RunData]) -> list[Series]:
    out = []
    for i, r in enumerate(runs):
        pts = [
            (int(x["step"]), number(x.get("b_simple")), number(x.get("batch")))
            for x in r.rows
            if x.get("rank", 0) == 0 and x.get("b_simple") is not None
        ]
        b = [(s, v) for s, v, _ in pts if v is not None and v > 0]
        batch = [(s, v) for s, _, v in pts if v is not None]
        if b:
            xs, ys = downsample([p[0] for p in b], [p[1] for p in b])
            out.append(Series(f"{_letter(i)}: B_simple", xs, ys, _colour(i), f"run-{i}"))
        if batch:
            xs, ys = downsample([p[0] for p in batch], [p[1] for p in batch])
            out.append(Series(f"{_letter(i)}: batch", xs, ys, _colour(i), f"run-{i}", steps=True, dashed=True))
    return out


def _breakdown_part(runs: Sequence[RunData]) -> str:
    cats: list[str] = []
    groups: list[str] = []
    vals: list[list[float]] = [[], [], []]
    for i, r in enumerate(runs):
        for rank, split in rank_breakdown(r.rows).items():
            cats.append(f"{_letter(i)} r{rank}")
            groups.append(f"run-{i}")
            for j in range(3):
                vals[j].append(split[j] * 1e3)
    if not cats:
        return ""
    stacks = [(label, colour, vals[j]) for j, (label, colour) in enumerate(_KIND_COLOURS)]
    width = max(560, 60 * len(cats) + 200)
    return bar_chart(
        cats, stacks, title="mean step per rank (after the first step)", ylabel="ms", groups=groups, width=width
    )


def _staleness_part(runs: Sequence[RunData]) -> str:
    charts = []
    for i, r in enumerate(runs):
        st = r.summary.get("staleness")
        hist = st.get("hist") if isinstance(st, dict) else None
        if not isinstance(hist, dict) or not hist:
            continue
        keys = sorted(hist, key=lambda k: int(k) if str(k).lstrip("-").isdigit() else 0)
        counts = [float(hist[k]) for k in keys]
        charts.append(
            bar_chart(
                [str(k) for k in keys],
                [("gradients", _colour(i), counts)],
                title=f"{_letter(i)}: staleness (updates behind) of applied gradients",
                ylabel="gradients",
                groups=[f"run-{i}"] * len(keys),
            )
        )
    return '<div class="charts">' + "\n".join(charts) + "</div>" if charts else ""


def _options_part(runs: Sequence[RunData]) -> str:
    """The strategy's table of the run's configuration (algorithm, bucket size, compression, ...) with bytes
    per step."""
    keys: list[str] = []
    per_run: list[dict[str, Any]] = []
    for r in runs:
        opts = {f"{t}.{k}": v for t, tab in r.config.items() if isinstance(tab, dict) for k, v in tab.items()}
        opts["bytes sent per step"] = number(r.summary.get("bytes_sent_per_step"))
        per_run.append(opts)
        keys += [k for k in opts if k not in keys]
    if not any(len(o) > 1 for o in per_run):
        return ""
    rows = [[k, *[o.get(k) for o in per_run]] for k in keys]
    return table(["option", *[f"{_letter(i)}: {r.label}" for i, r in enumerate(runs)]], rows, "options")


def _measured_boxes(d: TraceDigest) -> tuple[int, list[list[Box]]] | None:
    """The step (after the first) whose span over all the pipeline's ranks is the median, and per rank its
    actions as boxes in ms from the step's earliest start."""
    lanes = by_rank(d)
    ranks = sorted(lanes)
    steps = after_warmup([s for (r, s) in d.steps if r in lanes])
    whole = {
        s: (min(d.steps[(r, s)][0] for r in ranks), max(sum(d.steps[(r, s)]) for r in ranks))
        for s in steps
        if all((r, s) in d.steps for r in ranks)
    }
    if not whole:
        return None
    order = sorted(whole, key=lambda s: (whole[s][1] - whole[s][0], s))
    step = order[len(order) // 2]
    origin = whole[step][0]
    out = []
    for r in ranks:
        t0, dur = d.steps[(r, step)]
        lane = []
        for a in lanes[r]:
            if t0 <= a.ts <= t0 + dur:
                compute = a.op in COMPUTE_OPS
                name = f"{a.stage}{a.op}{'' if a.mb is None else a.mb}"
                lane.append(
                    Box(
                        (a.ts - origin) / 1e3,
                        (a.ts + a.dur - origin) / 1e3,
                        f"{a.op}{'' if a.mb is None else a.mb}" if compute else "",
                        _OP_COLOURS.get(a.op, "#9c755f") if compute else "#d7d7d7",
                        f"rank {r} {name}: {a.dur / 1e3:.3g} ms",
                    )
                )
        out.append(lane)
    return step, out


def _plan_boxes(shape: tuple[str, int, int, int], tf: float, tb: float) -> tuple[float, list[list[Box]]]:
    from dtrain.pipeline.schedules import generate, simulate

    result = simulate(generate(*shape), tf, tb)
    lanes = [
        [
            Box(
                t0,
                t1,
                f"{a.op}{'' if a.mb is None else a.mb}",
                _OP_COLOURS.get(a.op, "#9c755f"),
                f"rank {r} {a} planned {t0:.3g}-{t1:.3g} ms",
            )
            for a, t0, t1 in played
        ]
        for r, played in enumerate(result.starts)
    ]
    return result.makespan, lanes


def _pipeline_part(runs: Sequence[RunData]) -> str:
    from dtrain.pipeline.schedules import ScheduleError

    parts = []
    for i, run in enumerate(runs):
        b = pipeline_bubbles(run)
        shape = schedule_shape(run)
        if shape is None and b["rows"] is None:
            continue
        measured = _measured_boxes(run.trace) if run.trace is not None else None
        plan = None
        if shape is not None:
            try:
                plan = _plan_boxes(shape, float(b["tf_ms"] or 1.0), float(b["tb_ms"] or 2.0))
            except ScheduleError:
                plan = None
        span = max([plan[0] if plan else 0.0] + [x.t1 for lane in (measured[1] if measured else []) for x in lane])
        labels = [f"rank {r}" for r in range(shape[1] if shape else len(measured[1]) if measured else 0)]
        html = [f"<h3>{_letter(i)}: {escape(run.label)}</h3>"]
        if measured is not None:
            html.append(
                timeline(
                    measured[1],
                    title=f"measured: step {measured[0]} (the median step), from the trace",
                    xlabel="ms from the step's start",
                    row_labels=labels,
                    span=span,
                    width=760,
                )
            )
        if plan is not None and shape is not None:
            tf, tb = fmt(float(b["tf_ms"] or 0)), fmt(float(b["tb_ms"] or 0))
            html.append(
                timeline(
                    plan[1],
                    title=f"plan: {shape[0]}, P={shape[1]}, M={shape[2]}, v={shape[3]}, at the "
                    f"measured mean F {tf} ms, B {tb} ms",
                    xlabel="ms",
                    row_labels=labels,
                    span=span,
                    width=760,
                )
            )
        rows = [
            ["measured (metrics rows' bubble, mean after the first step)", b["rows"]],
            ["measured (from the trace's spans: 1 - compute / step span)", b["spans"]],
            ["closed form (P-1)/(v*M+P-1)", b["closed_form"]],
            ["plan simulated at the measured F and B times", b["plan"]],
        ]
        html.append(table(["bubble (idle share of the step)", "value"], rows, "bubble"))
        parts.append('<div class="pipeline">' + "\n".join(html) + "</div>")
    return "\n".join(parts)


def _prediction_part(runs: Sequence[RunData]) -> str:
    rows = []
    for i, r in enumerate(runs):
        p, f = r.prediction, figures(r)
        if p is None:
            continue
        ps, ms = number(p.get("step_s")), f["step_ms"]
        rows.append(
            [
                f"{_letter(i)}: {r.label}",
                p.get("label"),
                ps * 1e3 if ps is not None else None,
                ms,
                f"{ms / (ps * 1e3):.2f}x" if ps and ms else None,
                number(p.get("samples_per_s")),
                f["samples_per_s"],
                number(p.get("bytes_per_step")),
                f["bytes_per_step"],
                p.get("why"),
            ]
        )
    if not rows:
        return (
            '<p class="note">No prediction: <code>dtrain report --predict RUN ...</code> adds the performance '
            "model's predicted step for each run's strategy (it calibrates this machine once, then takes a few "
            "seconds).</p>"
        )
    head = [
        "run",
        "as planned",
        "predicted step ms",
        "measured step ms",
        "measured / predicted",
        "predicted samples/s",
        "measured samples/s",
        "predicted bytes/step",
        "measured bytes/step",
        "why",
    ]
    return table(head, rows, "prediction")


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px 24px;color:#222;max-width:1600px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:17px;margin:22px 0 6px;border-bottom:1px solid #ddd} h3{font-size:14px}
table{border-collapse:collapse;margin:6px 0} th,td{border:1px solid #ccc;padding:2px 8px;text-align:left;
vertical-align:top} th{background:#f3f3f3} td{font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:8px} svg.chart{background:#fff;border:1px solid #e4e4e4}
svg text{font-size:11px;fill:#333} svg .title{font-size:12px;font-weight:600} svg .tick{font-size:10px;fill:#555}
svg .axis{stroke:#444} svg .grid{stroke:#eee} svg .cell{font-size:9px;fill:#fff;pointer-events:none}
.note{color:#444;margin:4px 0} .runs label{margin-right:14px} .swatch{display:inline-block;width:10px;height:10px;
margin:0 4px 0 2px}
"""
_HEAD_JS = """(function(){var errs=[];window.addEventListener('error',function(e){errs.push(String(e.message));
document.documentElement.setAttribute('data-js-errors',JSON.stringify(errs));});})();"""
_TAIL_JS = """(function(){
document.querySelectorAll('input[data-run]').forEach(function(box){box.addEventListener('change',function(){
document.body.classList.toggle('hide-run-'+box.getAttribute('data-run'),!box.checked);});});
window.addEventListener('load',function(){void document.body.offsetHeight;
document.body.setAttribute('data-charts',String(document.querySelectorAll('svg.chart').length));
document.body.setAttribute('data-render-ms',performance.now().toFixed(1));});})();"""


def _runs_part(runs: Sequence[RunData]) -> str:
    out = ['<p class="runs">']
    for i, r in enumerate(runs):
        box = f'<input type="checkbox" checked data-run="{i}"> ' if len(runs) > 1 else ""
        out.append(
            f'<label>{box}<span class="swatch" style="background:{_colour(i)}"></span>'
            f"{_letter(i)}: {escape(r.label)} <small>({escape(str(r.path))})</small></label>"
        )
    return "".join(out) + "</p>"


def build_html(runs: Sequence[RunData]) -> str:
    """The whole page for ``runs`` (the first is the base of the comparison)."""
    if not runs:
        raise DTrainError("report: no run folder given")
    hide = "".join(f".hide-run-{i} .run-{i}{{display:none}}" for i in range(len(runs)))
    title = "dtrain report: " + (runs[0].label if len(runs) == 1 else f"{len(runs)} runs compared")
    body = [
        section("Summary", _summary_part(runs), "summary"),
        section("Differences from run A", _deltas_part(runs), "deltas"),
        section("Curves", _curves_part(runs), "curves"),
        section("Compute, communication and waiting per rank", _breakdown_part(runs), "breakdown"),
        section("Parameter server staleness", _staleness_part(runs), "staleness"),
        section("Strategy options: algorithm, buckets, compression", _options_part(runs), "options"),
        section("Pipeline schedule: measured and planned", _pipeline_part(runs), "pipeline"),
        section("Performance model: predicted and measured step", _prediction_part(runs), "prediction"),
    ]
    return page(title, _runs_part(runs), body, css=hide)


def page(title: str, head: str, sections: Sequence[str], css: str = "") -> str:
    """A whole self-contained page: ``title``, ``head`` under it, then the non-empty ``sections``."""
    return (
        '<!DOCTYPE html>\n<html lang="en" data-js-errors="[]"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}{css}</style><script>{_HEAD_JS}</script></head>\n"
        f"<body><h1>{escape(title)}</h1>{head}\n"
        + "\n".join(b for b in sections if b)
        + f"\n<script>{_TAIL_JS}</script></body></html>\n"
    )


def write_report(
    run_dirs: Sequence[str | Path], out: str | Path | None = None, *, with_prediction: bool = False
) -> Path:
    """Write ``report.html`` for ``run_dirs`` into ``out`` (a file, or a folder -- one that exists or a
    name without a suffix -- to put report.html in; default: the first run folder); ``with_prediction``
    runs :func:`~dtrain.observe.report_data.predict` for runs without one."""
    runs = [load_run(d) for d in run_dirs]
    if with_prediction:
        for r in runs:
            if r.prediction is None and r.config:
                r.prediction = predict(r)
    path = Path(out) if out is not None else runs[0].path / "report.html"
    if path.is_dir() or (out is not None and not path.suffix):  # a folder, made if need be
        path = path / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(build_html(runs))
    return path


def _text_bubble(run: RunData) -> str | None:
    b = pipeline_bubbles(run)
    if b["rows"] is None and b["spans"] is None:
        return None
    named = {"rows": "measured", "spans": "from the trace", "closed_form": "closed form"}
    return "bubble          " + ", ".join(f"{named[k]} {b[k]:.3g}" for k in named if b[k] is not None)


def report_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None, *, predict: bool = False) -> str:
    """What ``dtrain report`` prints: each run's :func:`dtrain.observe.report.report` (and a pipeline's bubble),
    for several runs their differences from the first, and the path of the ``report.html`` written
    for all of them (into ``out``, or the first run folder)."""
    from dtrain.observe.report import report

    runs = [load_run(d) for d in run_dirs]
    parts = []
    for folder, run in zip(run_dirs, runs):
        bubble = _text_bubble(run)
        parts.append(report(folder) + (f"\n{bubble}" if bubble else ""))
    if len(runs) > 1:
        lines = [f"compared with A: {runs[0].label}"]
        for i, d in enumerate(deltas(runs), 1):
            cells = [
                f"{label} {'+' if v['diff'] >= 0 else ''}{fmt(v['diff'])}"
                + (f" ({v['rel']:+.1%})" if v["rel"] is not None else "")
                for key, label, _ in DELTA_KEYS
                if (v := d[key])["diff"] is not None
            ]
            lines.append(f"  {_letter(i)}: {d['run']}: " + ", ".join(cells))
        parts.append("\n".join(lines))
    path = write_report(run_dirs, out, with_prediction=predict)
    parts.append(f"report.html     {path}")
    return "\n\n".join(parts)
