"""The merged trace: message arrows (every send its receive), clock alignment by ping exchange,
--trace-steps, the event cap, track names -- unit tests on :class:`dtrain.trace.Tracer`, a
two-process clock test with a deliberately shifted clock, and real 4-process dp, ps (straggler)
and 1f1b pipeline runs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from _dist import run_distributed
from _helpers import dtrain_cli, read_metrics

from dtrain.errors import ConfigError
from dtrain.trace import MSG_TID, Tracer, align_clock, merge_traces, parse_trace_steps


def _events(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    data = json.loads((out / "trace.json").read_text())
    return data["traceEvents"], data["otherData"]


def test_trace_steps_parse_and_bad_input_is_refused():
    assert parse_trace_steps("") is None
    assert parse_trace_steps("20-40") == (20, 40) and parse_trace_steps("7") == (7, 7)
    for bad in ("a-b", "40-20", "-3", "1-2-3"):
        with pytest.raises(ConfigError, match="trace-steps"):
            parse_trace_steps(bad)


def test_a_tracer_records_only_its_window_and_stops_at_the_cap():
    t = Tracer(0, steps=(2, 3))
    for step in range(6):
        t.at_step(step)
        with t.span("step", step=step):
            pass
    assert [e["args"]["step"] for e in t.events] == [2, 3]
    capped = Tracer(0, max_events=4)
    for step in range(10):
        capped.at_step(step)
        capped.add("x", time.perf_counter(), 0.0)
    assert len(capped.events) == 4 and capped.truncated_at == 3 and not capped.recording
    off = Tracer(0, enabled=False)
    with off.span("x"):
        pass
    assert off.events == [] and not off.recording


def test_channels_number_messages_alike_at_both_ends_even_when_not_recording():
    sender, receiver = Tracer(0, steps=(5, 5)), Tracer(1, steps=(5, 5))
    keys_s = [sender.channel("g", 0, 1, 7) for _ in range(3)]
    keys_r = [receiver.channel("g", 0, 1, 7) for _ in range(3)]
    assert keys_s == keys_r and len(set(keys_s)) == 3
    assert sender.channel("g", 0, 1, 8) != keys_s[0] and sender.channel("h", 0, 1, 7) != keys_s[0]


def test_overlapping_messages_go_on_separate_lanes_and_merge_applies_offsets(tmp_path):
    t = Tracer(1)
    t0 = time.perf_counter()
    for i in range(3):  # three sends in flight at once, then one after them
        t.message("send", 0, f"g:1>0:0#{i}", t0 - 0.003 + 0.001 * i, 4)
    time.sleep(0.002)
    t.message("send", 0, "g:1>0:0#3", time.perf_counter(), 4)
    t.clock = {"offset_s": 0.5, "error_s": 1e-4, "rounds": 8}
    t.dump(tmp_path)
    r = Tracer(0)
    for i in range(3):
        r.message("recv", 1, f"g:1>0:0#{i}", t0, 4)
    r.dump(tmp_path)
    merge_traces(tmp_path)
    events, meta = _events(tmp_path)
    sends = [e for e in events if e.get("flow_out")]
    lanes: dict[int, list[tuple[float, float]]] = {}
    for e in sends:
        lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert {e["tid"] for e in sends[:3]} == {MSG_TID, MSG_TID + 1, MSG_TID + 2}  # all overlap
    for spans in lanes.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert meta["clock_offset_us"] == {"0": 0.0, "1": 500000.0} and meta["clock_error_us"]["1"] == 100.0
    assert meta["messages"] == 3 and meta["unmatched_messages"] == 1  # the fourth send has no receive
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names[(1, None)] == "rank 1" and names[(1, MSG_TID)] == "messages 0"
    # rank 1's events moved by its offset: its first send now starts ~0.5 s after rank 0's receive
    recv0 = min(e["ts"] for e in events if e.get("flow_in"))
    assert min(e["ts"] for e in sends) - recv0 == pytest.approx(5e5 - 3e3, abs=1e3)  # posted 3 ms before t0


def _ping(rank: int, world: int, shift: float) -> dict[str, float]:
    t = Tracer(rank)
    if rank == 1:
        t._wall0 += shift  # this rank's clock runs `shift` seconds ahead
    align_clock(t, timeout_s=30)
    return t.clock


@pytest.mark.procs
def test_clock_alignment_measures_a_shifted_clock_within_its_stated_error():
    clocks = run_distributed(_ping, 3, 0.25, timeout=90)
    assert clocks[0]["offset_s"] == 0.0
    # rank 1 reads 0.25 s more than rank 0 at the same instant: rank 0's time is its own less 0.25 s
    assert clocks[1]["offset_s"] == pytest.approx(-0.25, abs=clocks[1]["error_s"] + 1e-3)
    assert clocks[2]["offset_s"] == pytest.approx(0.0, abs=clocks[2]["error_s"] + 1e-3)
    assert all(0 < c["error_s"] < 0.05 and c["rounds"] == 8 for c in clocks[1:])


# ---------------------------------------------------------------- real runs

RUN = ["--epochs", "1", "--no-progress"]
RUNS = {  # name: flags (cnn on digits)
    "dp": ["--workers", "4", "--max-steps", "6"],
    "ps": ["--workers", "3", "--strategy", "ps", "--servers", "1", "--straggler", "1:3", "--max-steps", "6"],
    "pipeline": ["--workers", "4", "--strategy", "pipeline", "--schedule", "1f1b", "--max-steps", "4"],
    "window": ["--workers", "2", "--max-steps", "12", "--trace-steps", "4-6"],
    "tensor": [
        "--workers",
        "2",
        "--strategy",
        "tensor",
        "--model",
        "gpt-tiny",
        "--dataset",
        "pytext",
        "--max-steps",
        "2",
        "--eval-samples",
        "8",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The runs, one at a time (four processes each on a small machine): name -> run folder."""
    root = tmp_path_factory.mktemp("trace")
    out = {}
    for name, flags in RUNS.items():
        p = dtrain_cli("run", *RUN, *flags, "--out", str(root / name), timeout=240)
        assert p.returncode == 0, f"{name}: {p.stderr[-3000:]}"
        out[name] = root / name
    return out


@pytest.mark.procs
@pytest.mark.parametrize("name", ["dp", "ps", "pipeline", "tensor"])
def test_every_send_has_its_receive_and_the_clock_error_is_stated(runs, name):
    events, meta = _events(runs[name])
    sends = [e for e in events if e.get("flow_out")]
    recvs = {e["bind_id"]: e for e in events if e.get("flow_in")}
    assert sends and meta["unmatched_messages"] == 0 and meta["messages"] == len(sends) == len(recvs)
    for s in sends:
        r = recvs[s["bind_id"]]
        assert s["args"]["msg"] == r["args"]["msg"] and s["args"]["bytes"] == r["args"]["bytes"]
        assert s["args"]["peer"] == r["pid"] and r["args"]["peer"] == s["pid"]
        # aligned clocks: a message completes at its receiver after it was posted by its sender
        assert r["ts"] + r["dur"] >= s["ts"] - 2 * meta["clock_error_max_us"]
    ranks = {e["pid"] for e in events if e["ph"] == "X"}
    assert set(meta["clock_error_us"]) == {str(r) for r in ranks}
    assert 0 < meta["clock_error_max_us"] < 50_000 and meta["clock_error_us"]["0"] == 0.0


@pytest.mark.procs
def test_the_tracks_hold_each_strategys_phases(runs):
    names = {n: {e["name"] for e in _events(d)[0] if e["ph"] == "X"} for n, d in runs.items()}
    assert {"forward", "backward", "optimizer", "allreduce(ring)", "wait for buckets"} <= names["dp"]
    assert any(n.startswith("bucket ") for n in names["dp"])
    assert {"ps push", "ps wait for servers", "ps pull", "ps apply"} <= names["ps"]
    assert {"0F0", "0B0", "3F0", "3B0", "pipeline"} <= names["pipeline"]
    assert {"allreduce(ring)", "optimizer"} <= names["tensor"]  # the f/g operators' collectives
    ps_events, _ = _events(runs["ps"])
    waits = [e for e in ps_events if e["name"] == "ps wait for servers"]
    assert waits and all("staleness" in e["args"] for e in waits)
    # the straggler (worker rank 1) computes 3x slower: the others wait longer than it does
    by_rank = {r: sum(e["dur"] for e in waits if e["pid"] == r) for r in (1, 2, 3)}
    assert by_rank[1] < min(by_rank[2], by_rank[3])


@pytest.mark.procs
def test_trace_steps_keeps_its_window_and_cuts_arrows_at_the_edges(runs):
    events, meta = _events(runs["window"])
    steps = {e["args"]["step"] for e in events if e["name"] == "step"}
    assert steps == {4, 5, 6} and meta["trace_steps"] == [4, 6]
    assert all(e["args"]["step"] in (4, 5, 6) for e in events if "msg" in e.get("args", {}))
    assert meta["unmatched_messages"] == 0 and meta["messages"] > 0
    assert len(read_metrics(runs["window"])) == 2 * 12  # the metrics keep every step


@pytest.mark.procs
def test_no_trace_with_trace_steps_is_refused_before_any_process_starts(tmp_path):
    p = dtrain_cli("run", "--no-trace", "--trace-steps", "2-3", "--out", str(tmp_path / "x"), timeout=60)
    assert p.returncode == 2 and "--trace-steps" in p.stderr and not (tmp_path / "x").exists()


def test_the_progress_bar_names_the_rank_with_the_most_own_work():
    import datetime

    import torch.distributed as dist

    from dtrain.training.live import LiveRanks

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    ranks = [LiveRanks(r, 4, store=store) for r in range(4)]  # rank 3 never posts (a server)
    own = {0: 0.010, 1: 0.012, 2: 0.050}
    for r, s in own.items():  # own work: the step less its exchange (here: all waiting)
        for step in range(12):
            ranks[r].observe({"step": step, "rank": r, "step_s": 0.08, "compute_s": s, "wait_s": 0.08 - s})
        ranks[r].observe({"step": 0, "rank": (r + 1) % 3, "step_s": 9.0, "compute_s": 9.0})  # another rank's row
    assert ranks[0].slowest() is None  # nobody has posted yet
    for r in own:
        ranks[r].post()
    assert ranks[0].read() == pytest.approx(own)
    assert ranks[0].slowest() == "r2 4.5x"  # 0.050 over the median of 0.010 and 0.012
    assert LiveRanks(0, 1).slowest() is None  # one process: nothing to compare


@pytest.mark.procs
def test_the_four_stage_pipelines_bubble_from_its_spans_is_within_10_percent_of_its_rows(runs):
    from dtrain.observe.report_data import load_run, pipeline_bubbles

    rows = [r for r in read_metrics(runs["pipeline"]) if r["step"] > 0]
    measured = sum(r["bubble"] for r in rows) / len(rows)
    b = pipeline_bubbles(load_run(runs["pipeline"]))
    assert b["spans"] == pytest.approx(measured, rel=0.10) and 0.0 < measured < 1.0
    assert b["closed_form"] == pytest.approx(3 / 7)  # 1f1b, P=4, M=4


def test_a_rank_file_that_is_not_json_is_left_on_disk_and_named_not_a_crash(tmp_path):
    """A worker killed while it wrote its trace (before the writes were atomic) left an empty file: the merge
    takes the other ranks, names the file in ``otherData`` and keeps it."""
    import json

    from dtrain.trace import merge_traces

    (tmp_path / "trace.rank0.json").write_text(json.dumps({"rank": 0, "events": [], "clock": {}}))
    (tmp_path / "trace.rank1.json").write_text("")
    merge_traces(tmp_path)
    merged = json.loads((tmp_path / "trace.json").read_text())
    assert list(merged["otherData"]["unreadable"]) == ["trace.rank1.json"]
    assert merged["otherData"]["clock_offset_us"] == {"0": 0.0}
    assert (tmp_path / "trace.rank1.json").exists() and not (tmp_path / "trace.rank0.json").exists()
