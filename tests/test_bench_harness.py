"""The benchmark harness: rotated rounds, per-round ratios, verdicts on the interquartile range, one schema."""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import pytest

from dtrain.measure.harness import SCHEMA, Bar, Benchmark, commit_of, load_result, summary


def test_summary_quartiles_stay_within_the_values() -> None:
    s = summary([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["q1"], s["q3"], s["min"], s["max"], s["n"]) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert summary([7.0])["q1"] == summary([7.0])["q3"] == 7.0
    with pytest.raises(ValueError):
        summary([])


@pytest.mark.parametrize(
    ("bar", "ratios", "verdict"),
    [
        (Bar.at_least(1.0), [1.02, 1.05, 1.03, 1.10, 1.04], "met"),
        (Bar.at_least(1.0), [0.90, 0.95, 0.97, 0.93, 0.96], "not met"),
        (Bar.at_least(1.0), [0.95, 0.99, 1.02, 1.04, 0.97], "straddles"),
        (Bar.within(0.05), [0.98, 1.01, 1.03, 0.99, 1.00], "met"),
        (Bar.within(0.05), [1.10, 1.12, 1.08, 1.20, 1.09], "not met"),
        (Bar.within(0.05), [0.90, 0.94, 1.00, 1.06, 1.10], "straddles"),
        # one wild round outside the middle half does not decide (min-max is reported beside it)
        (Bar.within(0.05), [0.65, 1.00, 1.01, 1.02, 1.03], "met"),
    ],
)
def test_verdict_judges_the_interquartile_range(bar: Bar, ratios: list[float], verdict: str) -> None:
    assert bar.verdict(summary(ratios)) == verdict


@pytest.mark.procs  # the result records the git commit: runs git
def test_rounds_rotate_and_ratios_pair_rounds(tmp_path: Path) -> None:
    calls: list[str] = []
    speed = {"ours": itertools.count(10.0, 1.0), "peer": itertools.count(10.0, 2.0)}

    def system(name: str) -> float:
        calls.append(name)
        return next(speed[name])

    bench = Benchmark(
        "toy",
        title="toy",
        family="test",
        workload="none",
        metric="s/step",
        higher_is_better=False,
        repeats=5,
        command=["bench", "--toy"],
        log=lambda _: None,
    )
    bench.add_case(
        "a",
        systems={"ours": lambda: system("ours"), "peer": lambda: system("peer")},
        compare=[("ours", "peer", Bar.at_least(1.0))],
    )
    bench.run()
    assert calls == ["ours", "peer", "peer", "ours", "ours", "peer", "peer", "ours", "ours", "peer"]
    res = bench.result()
    cmp = res["cases"][0]["comparisons"][0]
    # lower is better: the ratio is peer / ours, per round (round r: ours 10 + r, peer 10 + 2r)
    assert cmp["ratios"] == pytest.approx([(10 + 2 * r) / (10 + r) for r in range(5)])
    assert cmp["verdict"] == "met"  # round 0 ties at 1.0; the middle half of the rounds is above
    path = bench.save(tmp_path / "toy.json")
    data = load_result(path)
    assert data["schema"] == SCHEMA and data["command"] == "bench --toy" and data["load"]["after"]
    assert data["cases"][0]["systems"]["ours"]["samples"] == [10.0, 11.0, 12.0, 13.0, 14.0]


@pytest.mark.procs  # the result records the git commit: runs git
def test_fewer_than_five_rounds_give_no_verdict() -> None:
    bench = Benchmark(
        "toy",
        title="toy",
        family="test",
        workload="none",
        metric="x",
        higher_is_better=True,
        repeats=1,
        command=["x"],
        log=lambda _: None,
    )
    bench.add_case("a", samples={"ours": [2.0, 2.0], "peer": [1.0, 1.0]}, compare=[("ours", "peer", Bar.at_least(1))])
    assert bench.result()["cases"][0]["comparisons"][0]["verdict"] == "too few repeats"


def test_bad_cases_and_files_are_refused(tmp_path: Path) -> None:
    bench = Benchmark(
        "toy",
        title="toy",
        family="test",
        workload="none",
        metric="x",
        higher_is_better=True,
        repeats=5,
        command=["x"],
        log=lambda _: None,
    )
    with pytest.raises(ValueError, match="compares 'ours' with 'nobody'"):
        bench.add_case("a", samples={"ours": [1.0]}, compare=[("ours", "nobody", Bar.at_least(1))])
    with pytest.raises(ValueError, match="different numbers of rounds"):
        bench.add_case("a", samples={"ours": [1.0], "peer": [1.0, 2.0]}, compare=[])
    with pytest.raises(ValueError, match="either systems"):
        bench.add_case("a", compare=[])
    (tmp_path / "old.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="schema"):
        load_result(tmp_path / "old.json")


@pytest.mark.procs  # the result records the git commit: runs git
def test_the_commit_is_marked_changed_by_code_not_by_results(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    git("init", "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for f in ("src/a.py", "benchmarks/results/r.json", "BENCHMARKS.md"):
        (tmp_path / f).write_text("0\n")
    git("add", "-A")
    git("commit", "-q", "-m", "x")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("1\n")
    (tmp_path / "BENCHMARKS.md").write_text("1\n")
    assert commit_of(tmp_path / "src") == head  # from a subfolder too
    (tmp_path / "src" / "a.py").write_text("1\n")
    assert commit_of(tmp_path / "src") == head + "+changes"
