"""`dtrain run --strategy ps` end to end: processes through torchrun's agent, the run folder's contract."""

import json

import pytest
from _helpers import dtrain_cli, read_metrics, read_summary

pytestmark = pytest.mark.procs  # every test here starts processes


def test_dtrain_run_ps_writes_staleness_and_the_table(tmp_path):
    out = tmp_path / "ps"
    p = dtrain_cli(
        "run",
        "--strategy",
        "ps",
        "--servers",
        "1",
        "--workers",
        "2",
        "--consistency",
        "ssp:1",
        "--epochs",
        "1",
        "--max-steps",
        "12",
        "--out",
        str(out),
        "--no-progress",
        "--timeout-s",
        "60",
        "--straggler",
        "2:2",  # the straggler's path runs; its timing is the benchmark's
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    s = read_summary(out)
    assert s["strategy"] == "ps" and s["world_size"] == 3 and s["workers"] == 2
    assert s["consistency"] == "ssp:1" and s["servers"] == 1
    for key in ("staleness", "clock_lag"):
        assert set(s[key]) == {"max", "mean", "hist"}
        # every applied gradient once (one server); the budget is 2 x 12, one more may be in flight
        assert 24 <= sum(s[key]["hist"].values()) <= 25
    assert s["clock_lag"]["max"] <= 1
    assert s["test_accuracy"] is not None and s["bytes_sent_per_step"] > 0
    rows = read_metrics(out)
    assert {r["rank"] for r in rows} == {1, 2}  # workers only: rank 0 serves
    assert len(rows) == sum(s["staleness"]["hist"].values())
    for k in ("step", "loss", "lr", "samples_per_s", "compute_s", "comm_s", "wait_s", "bytes_sent"):
        assert k in rows[0], k
    stats = json.loads((out / "ps_stats.json").read_text())
    assert [w["rank"] for w in stats["per_worker"]] == [1, 2]
    assert "parameter server: 1 server, 2 workers, consistency ssp:1" in p.stdout
