"""Write BENCHMARKS.md (and its plots) from the harness's result files in ``benchmarks/results/``.

The page opens with one headline table, every comparison of every result file (the ratio with its spread, the
bar, the verdict, the workload and the command), then one short section a result file: its setup, its table,
a plot of every round's ratio against the bar, and its caveats. Nothing is typed into the page by hand; a
figure changes when its result file does (``benchmarks/run_all.py`` reruns them all and calls this).

Run::

    python benchmarks/render.py            # rewrite BENCHMARKS.md and benchmarks/results/plots/*.png
    python benchmarks/render.py --check    # exit 1 when BENCHMARKS.md is not what the result files give
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"
PLOTS = RESULTS / "plots"

# the families in the order a reader meets them (a result file's "family"); others follow, by name
FAMILIES = [
    "data parallelism",
    "sharded data parallelism",
    "pipeline parallelism",
    "tensor parallelism",
    "decentralized",
    "compression",
    "several machines",
    "performance model",
]

INTRO = """\
# Benchmarks

dtrain beside its peers (DDP, FSDP2, torch's pipelining, DTensor, averagers); `python benchmarks/render.py` makes
every figure from `benchmarks/results/`, `python benchmarks/run_all.py` reruns them (`--quick`: fewer steps, marked).
A comparison's systems run in rotated, interleaved rounds in one launch; a figure is the median of the rounds with its
interquartile range (IQR); a ratio is taken per round (above 1 favours dtrain) and its IQR judged against the bar:
**met** (all of it clears it), **not met** (none does) or **straddles**. Off the harness: `time_to_target.py`,
`ps_policies.py`, `model_vs_measured.py`, `large_batch.py`; the parameter server and the hybrid mesh have no peer.
"""


def load_all(folder: Path = RESULTS) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "src"))
    from dtrain.measure.harness import load_result

    results = [load_result(p) for p in sorted(folder.glob("*.json"))]

    def key(r: dict[str, Any]) -> tuple[int, str]:
        fam = r["family"]
        return (FAMILIES.index(fam) if fam in FAMILIES else len(FAMILIES), r["name"])

    return sorted(results, key=key)


def _ratio(q: dict[str, float]) -> str:
    return f"{q['median']:.2f} ({q['q1']:.2f}-{q['q3']:.2f})"


def _bar(bar: dict[str, Any]) -> str:
    return f">= {bar['value']:g}x" if bar["kind"] == "at_least" else f"within {bar['value']:.0%}"


def _machine(m: dict[str, Any]) -> str:
    return f"{m['cpus']} cpu{'s' if m['cpus'] != 1 else ''}" + (f", {m['gpu']}" if m.get("gpu") else "")


def _anchor(r: dict[str, Any]) -> str:
    return r["name"].replace("_", "-")


def headline(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Headline",
        "",
        "| family | comparison | ratio, median (IQR) | bar | verdict | rounds | machine |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        quick = " (quick)" if r.get("quick") else ""
        for c in (c for c in r["cases"] if c.get("headline", True)):
            for cmp in c["comparisons"]:
                lines.append(
                    f"| [{r['family']}](#{_anchor(r)}) | {cmp['ours']} / {cmp['peer']}, {c['name']} | "
                    f"{_ratio(cmp['ratio'])} | {_bar(cmp['bar'])} | {cmp['verdict']}{quick} | "
                    f"{cmp['ratio']['n']} | {_machine(r['machine'])} |"
                )
    return lines


def section(r: dict[str, Any]) -> list[str]:
    m, load = r["machine"], r["load"]
    lines = [
        f'## <a id="{_anchor(r)}"></a>{r["title"]}',  # the anchor in the heading; the paragraph straight under it
        f"**Workload**: {r['workload']}. **Metric**: {r['metric']} "
        f"({'higher' if r['higher_is_better'] else 'lower'} is better), {r['repeats']} rounds"
        f"{', a quick run' if r.get('quick') else ''}. "
        f"**Machine**: {_machine(m)}, {m['memory_gib']} GiB, torch {m['torch']}, python {m['python']}; "
        f"load average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after; commit {r['commit']}, "
        f"{r['date']}.",
        f"**Run**: `{r['command']}`",
    ]  # one paragraph with the workload
    lines += _table(r)
    lines += ["", f"![every round's ratio, {r['name']}](benchmarks/results/plots/{r['name']}.png)"]
    if r.get("notes"):
        lines += ["", r["notes"]]
    return lines


def _cells(c: dict[str, Any]) -> list[str]:
    """Each system's median (IQR), then each comparison's ratio, median (IQR; min-max), with its verdict."""
    cells = [
        f"{v['median']:.4g}" + ("" if v["min"] == v["max"] else f" ({v['q1']:.4g}-{v['q3']:.4g})")
        for v in c["systems"].values()
    ]  # a constant (a closed form): its value alone
    return cells + [
        f"{q['median']:.2f} ({q['q1']:.2f}-{q['q3']:.2f}; {q['min']:.2f}-{q['max']:.2f}) **{x['verdict']}**"
        for x in c["comparisons"]
        for q in [x["ratio"]]
    ]


def _shape(c: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(c["systems"]), tuple(f"{x['ours']} / {x['peer']}, {_bar(x['bar'])}" for x in c["comparisons"])


def _pair(c: dict[str, Any]) -> bool:
    """Two systems and one comparison between them."""
    return len(c["systems"]) == 2 and len(c["comparisons"]) == 1


def _head(cols: list[str]) -> list[str]:
    return ["", f"| {' | '.join(cols)} |", "|---" * len(cols) + "|"]


def _table(r: dict[str, Any]) -> list[str]:
    """A row a case: each system's median (IQR) of the rounds, then each comparison's ratio, median (IQR;
    min-max) with its verdict against the bar in the column's head; consecutive cases with the same systems
    and comparisons share a table (every round's figure is in the result file and the plot). Consecutive
    cases of two systems and one comparison that differ in their systems or bar share one table too, each
    row naming its own."""
    lines: list[str] = []
    shape: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    for pairs, run in itertools.groupby(r["cases"], key=_pair):
        group = list(run)
        if pairs and len({_shape(c) for c in group}) > 1:  # pairs of several kinds: one table, each row its own
            lines += _head(
                [
                    f"case: {r['metric']}, median (IQR)",
                    "ours",
                    "peer",
                    "ratio, above 1 favours ours: median (IQR; min-max)",
                ]
            )
            for c in group:
                x = c["comparisons"][0]
                a, b, ratio = _cells({"systems": {s: c["systems"][x[s]] for s in ("ours", "peer")}, "comparisons": [x]})
                lines.append(f"| {c['name']}: {x['ours']} / {x['peer']}, {_bar(x['bar'])} | {a} | {b} | {ratio} |")
            shape = None
            continue
        for c in group:
            if _shape(c) != shape:
                shape = _shape(c)
                lines += _head([f"case: {r['metric']}, median (IQR)", *shape[0], *shape[1]])
            lines.append(f"| {c['name']} | {' | '.join(_cells(c))} |")
    return lines


def page(results: list[dict[str, Any]]) -> str:
    lines = [INTRO.rstrip("\n"), "", *headline(results)]
    for r in results:
        lines += ["", *section(r)]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    """Every round's ratio of each comparison as a dot, its median as a bar, the bar as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        (c["name"] if len(c["comparisons"]) == 1 else f"{c['name']}: {cmp['ours']} / {cmp['peer']}", cmp)
        for c in r["cases"]
        for cmp in c["comparisons"]
    ]
    fig, ax = plt.subplots(figsize=(7.0, 0.9 + 0.4 * len(rows)), dpi=80)
    for i, (_, cmp) in enumerate(rows):
        ax.scatter(cmp["ratios"], [i] * len(cmp["ratios"]), s=14, color="tab:blue", alpha=0.6, zorder=3)
        q = cmp["ratio"]
        ax.plot([q["q1"], q["q3"]], [i, i], color="tab:blue", linewidth=5, alpha=0.35)
        ax.plot([q["median"]] * 2, [i - 0.3, i + 0.3], color="black", linewidth=1.5)
        bar = cmp["bar"]
        edges = [bar["value"]] if bar["kind"] == "at_least" else [1 - bar["value"], 1 + bar["value"]]
        for e in edges:
            ax.plot([e, e], [i - 0.4, i + 0.4], color="tab:red", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_xlabel("ratio per round (above 1 favours dtrain); dashed red: the bar", fontsize=8)
    ax.set_title(r["title"], fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with BENCHMARKS.md instead of writing it")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--page", type=Path, default=PAGE)
    a = ap.parse_args(argv)
    results = load_all(a.results)
    text = page(results)
    if a.check:
        same = a.page.exists() and a.page.read_text(encoding="utf-8") == text
        print(f"{a.page}: {'current' if same else 'differs from the result files: run benchmarks/render.py'}")
        return 0 if same else 1
    a.page.write_text(text, encoding="utf-8")
    for r in results:
        plot(r, PLOTS / f"{r['name']}.png")
    print(f"wrote {a.page} ({len(text.splitlines())} lines) and {len(results)} plots in {PLOTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
