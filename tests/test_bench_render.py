"""BENCHMARKS.md is what ``benchmarks/render.py`` makes of the committed result files, and a results page:
the headline table first, at most 500 lines, every comparison with its spread and verdict."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from dtrain.measure.harness import Bar, Benchmark

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
render = importlib.import_module("render")

PAGE_MAX_LINES = 500


def test_benchmarks_page_is_rendered_from_the_result_files() -> None:
    results = render.load_all()
    assert results, "benchmarks/results/ holds no result file of the harness's schema"
    text = render.page(results)
    assert (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8") == text, (
        "BENCHMARKS.md differs from what the result files give: run `python benchmarks/render.py`"
    )
    lines = text.splitlines()
    assert len(lines) <= PAGE_MAX_LINES, f"BENCHMARKS.md has {len(lines)} lines (at most {PAGE_MAX_LINES})"
    first_section = next(line for line in lines if line.startswith("## "))
    assert first_section == "## Headline"
    for r in results:
        assert (ROOT / "benchmarks" / "results" / "plots" / f"{r['name']}.png").is_file(), r["name"]


@pytest.mark.procs  # the result records the git commit: runs git
def test_page_shows_each_ratio_with_its_spread_and_an_honest_verdict(tmp_path: Path) -> None:
    bench = Benchmark(
        "toy_vs_peer",
        title="Toy against its peer",
        family="data parallelism",
        workload="toy",
        metric="steps/s",
        higher_is_better=True,
        repeats=5,
        command=["python", "toy.py"],
        log=lambda _: None,
    )
    bench.add_case(
        "wide",
        samples={"toy": [1.0, 1.1, 0.9, 1.05, 0.97], "peer": [1.0] * 5},
        compare=[("toy", "peer", Bar.at_least(1.0))],
    )
    bench.add_case(
        "narrow",
        samples={"toy": [1.2, 1.3, 1.25, 1.22, 1.28], "peer": [1.0] * 5},
        compare=[("toy", "peer", Bar.at_least(1.0))],
    )
    bench.add_case(
        "check",
        samples={"measured": [0.3] * 5, "closed form": [0.27] * 5},
        compare=[("measured", "closed form", Bar.within(0.1))],
        headline=False,
    )
    bench.start()
    bench.stop()
    bench.save(tmp_path / "toy_vs_peer.json")
    (tmp_path / "plots").mkdir()
    text = render.page(render.load_all(tmp_path))
    headline = text.split("## Headline", 1)[1].split("\n## ", 1)[0]
    assert "| toy / peer, wide | 1.00 (0.97-1.05) | >= 1x | straddles |" in headline
    assert "| toy / peer, narrow | 1.25 (1.22-1.28) | >= 1x | met |" in headline
    assert "measured / closed form" not in headline  # a check of an instrument: its section only
    # pairs of systems of several kinds side by side: one table, each row naming its systems and bar
    assert "| case: steps/s, median (IQR) | ours | peer | ratio, above 1 favours ours: median (IQR; min-max) |" in text
    assert "| wide: toy / peer, >= 1x | 1 (0.97-1.05) | 1 | 1.00 (0.97-1.05; 0.90-1.10) **straddles** |" in text
    assert (
        "| check: measured / closed form, within 10% | 0.3 | 0.27 | 1.11 (1.11-1.11; 1.11-1.11) **not met** |" in text
    )
    assert "**Run**: `python toy.py`" in text
    render.plot(render.load_all(tmp_path)[0], tmp_path / "plots" / "toy.png")
    assert (tmp_path / "plots" / "toy.png").read_bytes()[:4] == b"\x89PNG"


def test_cases_of_one_kind_share_a_table_headed_by_their_systems(tmp_path: Path) -> None:
    bench = Benchmark(
        "toy_check",
        title="Toy against a closed form",
        family="toy",
        workload="toy",
        metric="s",
        higher_is_better=False,
        repeats=5,
        command=["python", "toy.py"],
        log=lambda _: None,
    )
    for name, v in (("small", 0.3), ("large", 3.3)):
        bench.add_case(
            name,
            samples={"measured": [v] * 5, "closed form": [0.27] * 5},
            compare=[("measured", "closed form", Bar.within(0.1))],
            headline=False,
        )
    bench.add_case(
        "three",
        samples={"a": [1.0] * 5, "b": [1.0] * 5, "c": [2.0] * 5},
        compare=[("a", "c", Bar.at_least(1.0))],
        headline=False,
    )
    bench.start()
    bench.stop()
    bench.save(tmp_path / "toy_check.json")
    text = render.page(render.load_all(tmp_path))
    table = "| case: s, median (IQR) | measured | closed form | measured / closed form, within 10% |"
    assert text.count(table) == 1
    assert "| small | 0.3 | 0.27 | 0.90 (0.90-0.90; 0.90-0.90) **met** |" in text
    assert "| large | 3.3 | 0.27 | 0.08 (0.08-0.08; 0.08-0.08) **not met** |" in text
    assert "| case: s, median (IQR) | a | b | c | a / c, >= 1x |" in text  # three systems: a table of its own
    assert "| three | 1 | 1 | 2 | 2.00 (2.00-2.00; 2.00-2.00) **met** |" in text
