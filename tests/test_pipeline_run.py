"""``dtrain run --strategy pipeline``: real processes through the CLI against a single-process run on the
same batches, the asynchronous 2bw schedule's flush and peak micro-batches in flight, and bad input
refused before any process starts. The Pipeline's own oracles are in tests/test_pipeline_dist.py."""

from __future__ import annotations

import pytest
from _helpers import dtrain_cli, read_metrics, read_summary

pytestmark = pytest.mark.procs  # every test here starts processes

COMMON = ["--epochs", "1", "--no-progress", "--no-trace", "--batch-size", "24", "--max-steps", "8"]


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out) if r["rank"] == 0}


def test_a_pipeline_run_trains_exactly_like_one_process(tmp_path):
    single, pipe = tmp_path / "single", tmp_path / "pipe"
    p = dtrain_cli("run", *COMMON, "--strategy", "dp", "--workers", "1", "--out", str(single))
    assert p.returncode == 0, p.stderr[-3000:]
    p = dtrain_cli(
        "run",
        *COMMON,
        "--strategy",
        "pipeline",
        "--workers",
        "3",
        "--microbatches",
        "4",
        "--schedule",
        "1f1b",
        "--balance",
        "params",
        "--out",
        str(pipe),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = _losses(single), _losses(pipe)
    assert sorted(a) == sorted(b) == list(range(8))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    sa, sb = read_summary(single), read_summary(pipe)
    assert sb["metric"] == pytest.approx(sa["metric"], abs=1e-9)  # accuracy of the gathered stages
    assert sum(sb["pipeline"]["cut"]) == 9 and len(sb["pipeline"]["cut"]) == 3
    rows = [r for r in read_metrics(pipe) if r["step"] == 7]
    assert sorted(r["stage"] for r in rows) == [0, 1, 2]
    assert all(0 <= r["bubble"] <= 1 and r["bytes_sent"] > 0 for r in rows)
    # the batch is counted once: samples/s of the pipeline is 8 steps x 24 samples over its training time
    assert sb["samples_per_s"] == pytest.approx(8 * 24 / sb["train_s"], rel=0.01)


def test_2bw_flushes_the_last_batch_and_holds_p_minus_s_micro_batches(tmp_path):
    out = tmp_path / "r"
    p = dtrain_cli(
        "run",
        *COMMON,
        "--strategy",
        "pipeline",
        "--workers",
        "3",
        "--microbatches",
        "6",
        "--schedule",
        "2bw",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = read_summary(out)
    assert s["pipeline"]["flush_updates"] == 1  # the evaluation at the end applied the last batch
    for stage in range(3):
        assert s[f"stage{stage}"]["peak_in_flight"] == {str(stage): 3 - stage}


def test_the_trace_has_a_span_per_action_and_each_send_its_receive(tmp_path):
    import json

    out = tmp_path / "t"
    flags = [a for a in COMMON if a != "--no-trace"]
    p = dtrain_cli(
        "run",
        *flags,
        "--max-steps",
        "2",
        "--strategy",
        "pipeline",
        "--workers",
        "2",
        "--microbatches",
        "4",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    events = json.loads((out / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    acts = [e for e in events if e.get("tid") == 1 and e.get("args", {}).get("op")]
    names = {(e["pid"], e["name"]) for e in acts}
    for m in range(4):
        assert (0, f"0F{m}") in names and (0, f"0B{m}") in names and (1, f"1F{m}") in names
    ops = [e["args"]["op"] for e in acts]
    assert ops.count("SF") == ops.count("RF") == 2 * 4  # 2 steps x 4 micro-batches, stage 0 -> 1
    assert ops.count("SB") == ops.count("RB") == 2 * 4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--microbatches", "5"], "5 micro-batches do not divide the batch of 24"),
        (["--workers", "10"], "fewer than the 10 stages"),
        (["--balance", "2,2"], "must give 3 positive layer counts"),
        (["--schedule", "interleaved", "--microbatches", "4"], "multiple"),
        (
            ["--checkpoint-every", "4", "--schedule", "2bw"],
            "checkpoints of a pipeline run with --schedule 2bw are not supported",
        ),
    ],
)
def test_bad_pipeline_input_is_refused_before_any_process_starts(tmp_path, flags, message):
    base = [*COMMON, "--strategy", "pipeline", "--workers", "3", "--out", str(tmp_path / "x")]
    p = dtrain_cli("run", *base, *flags)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "x" / "metrics.jsonl").exists()
