"""``dtrain report A [B ...]`` and report.html (dtrain.observe.report_html,
dtrain.observe.report_data, dtrain.observe.charts).

Unit tests build the page from synthetic rows, summaries and traces (no processes): the sections are
there, text is escaped, unknown trace events are ignored, the deltas and a pipeline's bubble from
its spans are the known values. Then three real runs (dp, ps, a 1f1b pipeline; 2 workers, 10 steps,
``--trace``): the dp-vs-ps comparison page is opened in headless Chromium (skipped where it is not
installed), and the pipeline's bubble from the trace's spans is checked against its metrics rows."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from _browser import MISSING, chromium, load
from _helpers import dtrain_cli, dtrain_runs, read_metrics

from dtrain.cli import build_parser
from dtrain.observe.charts import downsample, fmt, ticks
from dtrain.observe.report_data import (
    RunData,
    TraceDigest,
    deltas,
    digest_trace,
    figures,
    pipeline_bubbles,
    rank_breakdown,
    schedule_shape,
    span_bubbles,
)
from dtrain.observe.report_html import build_html, write_report

MS = 1e3  # trace times are microseconds


def _x(name: str, pid: int, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _pipeline_trace() -> dict[str, Any]:
    """Two ranks, two steps of 10 ms each. Rank 0 computes F 1 ms + B 2 ms per step (bubble 0.7),
    rank 1 F 2 ms + B 3 ms (bubble 0.5); receives and sends are not compute. Plus what a newer
    tracer writes: metadata, flows, a communication track, unknown keys, and junk."""
    ev: list[Any] = []
    for step in range(2):
        base = 100_000.0 + step * 20 * MS
        for rank, (f, b) in enumerate(((1, 2), (2, 3))):
            ev.append(_x("step", rank, 0, base, 10 * MS, step=step))
            ev.append(_x(f"{rank}F0", rank, 1, base + 0.5 * MS, f * MS, stage=rank, mb=0, op="F"))
            ev.append(_x(f"{rank}RB0", rank, 1, base + 3 * MS, 2 * MS, stage=rank, mb=0, op="RB"))
            ev.append(_x(f"{rank}B0", rank, 1, base + 6 * MS, b * MS, stage=rank, mb=0, op="B"))
            ev.append(_x("allreduce", rank, 2, base + 9 * MS, 0.5 * MS, bucket=0, op="F"))  # tid 2: not an action
    ev += [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "rank 0"}},
        {"name": "send", "ph": "s", "id": 1, "pid": 0, "tid": 1, "ts": 100_500.0},
        {"name": "send", "ph": "f", "id": 1, "pid": 1, "tid": 1, "ts": 101_000.0, "bp": "e"},
        _x("0F9", 0, 1, 900_000.0, 1 * MS, stage=0, mb=9, op="F") | {"cat": "new", "sf": 3},  # outside any step
        "junk",
        {"ph": "X", "pid": 0, "tid": 1, "name": "no-times"},
        _x("step", "r0", 0, 0.0, 1.0, step=0),
    ]
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"clock_offsets_us": {"1": 12.5}}}


def _rows(strategy_step_s: float, ranks: int = 2, steps: int = 4, **extra: Any) -> list[dict[str, Any]]:
    rows = []
    for s in range(steps):
        for r in range(ranks):
            step = 0.1 if s == 0 else strategy_step_s  # the first step is slow and left out
            rows.append(
                dict(
                    step=s,
                    rank=r,
                    loss=2.0 - 0.1 * s,
                    lr=0.05,
                    samples_per_s=64 / step,
                    compute_s=step / 2,
                    comm_s=step / 4,
                    wait_s=step / 4,
                    bytes_sent=1000,
                    step_s=step,
                    **extra,
                )
            )
    return rows


def _run(name: str, step_s: float, summary: dict[str, Any], **kw: Any) -> RunData:
    base = {
        "strategy": name,
        "workers": 2,
        "steps": 4,
        "global_batch": 64,
        "samples_per_s": 64 / step_s,
        "metric_name": "test_accuracy",
        "metric": 0.9,
        "final_loss": 1.7,
        "bytes_sent_per_step": 1000.0,
        "metric_history": [{"train_s": 0.1, "step": 4, "epoch": 0, "value": 0.9}],
    }
    return RunData(Path(f"/runs/{name}"), {**base, **summary}, kw.pop("rows", _rows(step_s)), **kw)


def test_the_digest_keeps_steps_and_actions_and_ignores_every_other_event():
    d = digest_trace(_pipeline_trace())
    assert sorted(d.steps) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert d.steps[(1, 1)] == (120_000.0, 10 * MS)
    assert len(d.acts) == 2 * 2 * 3 + 1  # F, RB, B per rank and step, and the stray F; no tid-2 span
    assert {a.op for a in d.acts} == {"F", "RB", "B"}
    assert digest_trace([]) == TraceDigest() == digest_trace({"otherData": {}}) == digest_trace("x")


def test_the_bubble_from_spans_is_the_idle_share_of_each_step():
    b = span_bubbles(digest_trace(_pipeline_trace()))
    assert b == pytest.approx({(0, 0): 0.7, (0, 1): 0.7, (1, 0): 0.5, (1, 1): 0.5})
    rows = [
        dict(step=s, rank=r, loss=1.0, step_s=0.01, compute_s=0.003, bubble=0.7 - 0.2 * r)
        for s in range(2)
        for r in range(2)
    ]
    run = _run(
        "pipeline",
        0.01,
        {"pipeline": {"schedule": "1f1b", "microbatches": 4}},
        rows=rows,
        trace=digest_trace(_pipeline_trace()),
    )
    got = pipeline_bubbles(run)
    assert got["spans"] == pytest.approx(0.6)  # step 1 only (the first is warm-up): (0.7 + 0.5) / 2
    assert got["rows"] == pytest.approx(0.6)
    assert got["closed_form"] == pytest.approx(1 / 5)  # (P-1)/(M+P-1), P=2 ranks in the trace, M=4
    assert got["tf_ms"] == pytest.approx(1.5) and got["tb_ms"] == pytest.approx(2.5)
    assert got["plan"] == pytest.approx(0.2)  # equal stages: the simulation meets the closed form


def test_the_schedule_drawn_is_the_one_the_runs_options_play():
    """The report asks the run's strategy (its options, built from config.toml) for the schedule it plays:
    the folder's table, the trace's ranks and stages where there is a trace, nothing for a strategy that plays
    none or one not registered here."""
    table = {"schedule": "interleaved", "microbatches": 8, "chunks": 3}
    assert schedule_shape(_run("pipeline", 0.01, {}, config={"strategy": "pipeline", "pipeline": table})) == (
        "interleaved",
        2,
        8,
        3,
    )
    gpipe = {"strategy": "pipeline", "pipeline": {"schedule": "gpipe", "microbatches": 6, "chunks": 3}}
    assert schedule_shape(_run("pipeline", 0.01, {"workers": 3}, config=gpipe)) == ("gpipe", 3, 6, 1)
    assert schedule_shape(_run("dp", 0.01, {}, config={"strategy": "dp", "dp": {"algorithm": "ring"}})) is None
    assert schedule_shape(_run("mine", 0.01, {}, config={"strategy": "mine"})) is None


def test_deltas_are_relative_to_the_first_run():
    a = _run("dp", 0.010, {})
    b = _run("ps", 0.015, {"samples_per_s": 3200.0, "metric": 0.8, "bytes_sent_per_step": 1500.0, "final_loss": 1.9})
    assert figures(a)["step_ms"] == pytest.approx(10.0)  # the median after step 0 (100 ms)
    (d,) = deltas([a, b])
    assert d["step_ms"] == pytest.approx({"value": 15.0, "diff": 5.0, "rel": 0.5})
    assert d["samples_per_s"]["diff"] == pytest.approx(-3200.0) and d["samples_per_s"]["rel"] == pytest.approx(-0.5)
    assert d["metric"] == pytest.approx({"value": 0.8, "diff": -0.1, "rel": None})  # accuracy: points, not %
    assert d["bytes_per_step"]["rel"] == pytest.approx(0.5)
    assert d["final_loss"]["diff"] == pytest.approx(0.2)


def test_the_rank_breakdown_adds_up_to_the_step():
    rows = [
        dict(step=s, rank=r, compute_s=0.003, comm_s=0.002 + w, wait_s=0.002 + w, step_s=0.010)
        for s in range(3)
        for r, w in ((0, 0.004), (1, 0.0))
    ]
    split = rank_breakdown(rows)
    for r in (0, 1):
        assert sum(split[r]) == pytest.approx(0.010)
    assert split[0][2] == pytest.approx(0.004)  # rank 0 waited 4 ms for rank 1, which arrived last
    assert split[1][2] == pytest.approx(0.0)
    assert split[0][1] == pytest.approx(0.002)  # the exchange itself, once both were there


def test_the_page_has_every_section_escaped_and_nothing_external():
    a = _run(
        "dp",
        0.010,
        {"strategy": "dp<script>alert(1)</script>"},
        config={"dp": {"algorithm": "ring", "bucket_mb": 25.0}},
    )
    b = _run(
        "ps",
        0.015,
        {"staleness": {"max": 2, "mean": 0.5, "hist": {"0": 10, "1": 6, "2": 2}}},
        config={"ps": {"servers": 1, "consistency": "ssp:2"}},
    )
    rows = [r | {"b_simple": 100.0 * (1 + r["step"]), "batch": 64} for r in _rows(0.012)]
    c = _run(
        "pipeline",
        0.012,
        {"pipeline": {"schedule": "1f1b", "microbatches": 4}},
        rows=rows,
        trace=digest_trace(_pipeline_trace()),
        prediction={"label": "pipeline 1f1b", "step_s": 0.006},
    )
    page = build_html([a, b, c])
    for sid in ("summary", "deltas", "curves", "breakdown", "staleness", "options", "pipeline", "prediction"):
        assert f'<section id="{sid}">' in page, sid
    assert "<script>alert(1)" not in page and "dp&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert len(re.findall(r'<svg class="chart', page)) == 9  # 3 curves, metric, noise, per rank, staleness, 2 grids
    assert page.count('class="series run-2"') == 6  # 3 curves, the metric, B_simple and the batch
    assert "2.00x" in page  # measured 12 ms / predicted 6 ms
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page
    assert "100000" not in page and "ssp:2" in page and "bucket_mb" in page
    assert len(_pages_deltas(page)) == 3


def _pages_deltas(page: str) -> list[str]:
    table = re.search(r'<table class="deltas">(.*?)</table>', page, re.S)
    assert table is not None
    return re.findall(r"<tr><td>", table.group(1))


def test_svg_helpers():
    assert ticks(0, 10, 5) == [0, 2, 4, 6, 8, 10]
    assert fmt(153128.0) == "153,128" and fmt(0.012341) == "0.01234" and fmt(0.0) == "0"
    xs, ys = downsample(list(range(1000)), list(range(1000)), 400)
    assert len(xs) <= 401 and xs[-1] == 999 and ys == xs


def test_report_takes_several_runs_and_an_out_path():
    ns = build_parser().parse_args(["report", "a", "b", "--out", "x.html", "--predict"])
    assert (ns.run_dirs, ns.out, ns.predict) == (["a", "b"], "x.html", True)
    assert build_parser().parse_args(["report", "a"]).predict is False


# ---------------------------------------------------------------------------------------------- real runs

RUN = ["--workers", "2", "--epochs", "1", "--max-steps", "10", "--trace", "--no-progress"]
RUNS = {
    "dp": [],
    "ps": ["--strategy", "ps", "--servers", "1"],
    "pipeline": ["--strategy", "pipeline", "--schedule", "1f1b"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three runs, two at a time: name -> run folder."""
    return {
        name: path for name, (path, _) in dtrain_runs(tmp_path_factory.mktemp("report"), RUN, RUNS, timeout=180).items()
    }


@pytest.mark.procs
def test_dtrain_report_compares_two_runs_and_prints_where_the_page_is(runs, tmp_path):
    done = dtrain_cli("report", str(runs["dp"]), str(runs["ps"]), "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr
    page = tmp_path / "report.html"
    assert f"report.html     {page}" in done.stdout
    assert "compared with A: dp: dp" in done.stdout and "B: ps: ps" in done.stdout and "step ms (median)" in done.stdout
    assert page.stat().st_size < 5_000_000
    text = page.read_text()
    assert len(_pages_deltas(text)) == 2 and "ps.consistency" in text and "dp.bucket_mb" in text
    assert not (runs["dp"] / "report.html").exists()  # --out was given


@pytest.mark.procs  # headless Chromium
@pytest.mark.skipif(chromium() is None, reason=MISSING)
def test_the_comparison_renders_in_headless_chromium_without_errors(runs, tmp_path):
    path = write_report([runs["dp"], runs["ps"]], tmp_path / "two.html")
    page = load(path)
    print(
        f"render {page.attr('data-render-ms')} ms in the page, browser {page.wall_s:.2f} s, {path.stat().st_size} bytes"
    )
    assert page.attr("data-js-errors") == "[]"
    assert page.console == []  # the page logs nothing: no error, no warning
    assert float(page.attr("data-render-ms") or "inf") < 2000
    assert int(page.attr("data-charts") or 0) == 6  # loss, throughput, step time, metric, per rank, staleness
    for sid in ("summary", "deltas", "curves", "breakdown", "staleness", "options"):
        assert f'<section id="{sid}">' in page.dom, sid
    for i in (0, 1):  # both runs drawn on the shared axes and in the per-rank bars
        assert page.dom.count(f'class="series run-{i}"') == 4  # loss, throughput, step time, metric
        assert f'class="bars run-{i}"' in page.dom
    assert re.search(r"<polyline [^>]*points=\"(\d+\.\d,\d+\.\d ){8}", page.dom)  # the loss: one point a step


@pytest.mark.procs  # headless Chromium
@pytest.mark.skipif(chromium() is None, reason=MISSING)
def test_the_pipeline_page_draws_the_measured_and_planned_schedule(runs, tmp_path):
    page = load(write_report([runs["pipeline"]], tmp_path / "pipe.html"))
    assert page.attr("data-js-errors") == "[]" and page.console == []
    assert page.dom.count('class="chart timeline"') == 2
    rects = re.findall(r"<title>rank (\d) \dF\d", page.dom)  # forward actions of the measured step and the plan
    assert sorted(set(rects)) == ["0", "1"] and len(rects) == 2 * 2 * 4  # 2 ranks x 4 micro-batches, twice


@pytest.mark.procs
def test_the_bubble_from_the_trace_is_within_10_percent_of_the_metrics_rows(runs):
    from dtrain.observe.report_data import load_run

    rows = [r for r in read_metrics(runs["pipeline"]) if r["step"] > 0]
    measured = sum(r["bubble"] for r in rows) / len(rows)
    b = pipeline_bubbles(load_run(runs["pipeline"]))
    print(f"bubble: metrics rows {measured:.4f}, from spans {b['spans']:.4f}, closed form {b['closed_form']:.4f}")
    assert 0.0 < measured < 1.0
    assert b["spans"] == pytest.approx(measured, rel=0.10)
    assert b["rows"] == pytest.approx(measured)
    assert b["closed_form"] == pytest.approx(1 / 5)  # 1f1b, P=2, M=4 (the default micro-batches)
    json.loads((runs["pipeline"] / "trace.json").read_text())  # the trace is still there, untouched
