"""benchmarks/pipeline_balance.py: one real run of 2 processes on a tiny uneven MLP, every cut."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # every test here starts processes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
bench = importlib.import_module("pipeline_balance")


@pytest.mark.timeout(60)
def test_two_processes_every_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "balance.json"
    rc = bench.main(
        [
            "--nprocs",
            "2",
            "--width",
            "16",
            "--batch",
            "8",
            "--microbatches",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "2",
            "--profile-repeats",
            "1",
            "--timeout",
            "30",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "torch 2." in text and "samples/s" in text
    res = json.loads(out.read_text())["results"]
    children = res["children"]
    assert len(children) == 12 and len(res["layer_s"]) == 12
    assert set(res["cuts"]) == set(bench.CUTS)
    for cut, r in res["cuts"].items():
        assert r["samples_per_s"] > 0, cut
        assert len(r["sizes"]) == 2 and all(s >= 1 for s in r["sizes"]), (cut, r["sizes"])
        assert len(r["compute_s_per_step_per_stage"]) == 2
        assert r["predicted_over_optimum"] >= 1.0  # the brute force is the least over every cut
    assert res["cuts"]["equal"]["sizes"] == [6, 6]
    assert sum(res["cuts"]["time"]["sizes"]) == len(children)
    assert res["cuts"]["equal"]["over_equal"] == 1.0
    opt = res["optimum"]
    assert sum(opt["sizes"]) == len(children)
    assert opt["block_partition_slowest_s"] == opt["slowest_stage_s"]  # exact partition = brute force
