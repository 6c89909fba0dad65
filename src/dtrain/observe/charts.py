"""Inline SVG charts for ``report.html``: lines, stacked bars and a timeline, as strings, no library.

Each function returns one ``<svg>`` element sized in CSS pixels. Every mark carries a ``<title>``
(the browser shows it on hover), and a mark that belongs to one run has the class ``run-<i>``, so
the page's script can hide a run by toggling that class. Text is escaped with :func:`html.escape`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["PALETTE", "Series", "Box", "fmt", "ticks", "downsample", "line_chart", "bar_chart", "timeline"]

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
Px = Callable[[float], float]  # a value to its pixel coordinate
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 58, 12, 26, 40  # plot margins: axis labels left and below, the title above


@dataclass(frozen=True)
class Series:
    """One line of a :func:`line_chart`: ``label`` in the legend, points ``(xs[i], ys[i])``.

    ``group`` is the CSS class of its marks (``"run-0"``), ``steps`` draws it as a step function
    (a batch size that holds until the next change), ``dashed`` as a dashed line.
    """

    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    colour: str
    group: str = ""
    steps: bool = False
    dashed: bool = False


@dataclass(frozen=True)
class Box:
    """One bar of a :func:`timeline`: from ``t0`` to ``t1`` on a row, ``text`` inside, ``tip`` on hover."""

    t0: float
    t1: float
    text: str
    colour: str
    tip: str


def fmt(v: float) -> str:
    """A number in at most 4 significant digits, no exponent for the usual ranges."""
    if v == 0 or not math.isfinite(v):
        return str(v) if not math.isfinite(v) else "0"
    a = abs(v)
    if 1e4 <= a < 1e15:  # bytes, samples/s: whole numbers with thousands separators
        return f"{v:,.0f}"
    if 1e-3 <= a < 1e4:
        return f"{v:.4g}"
    return f"{v:.3g}"


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values from ``lo`` to ``hi`` (1, 2 or 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def downsample(xs: Sequence[float], ys: Sequence[float], n: int = 400) -> tuple[list[float], list[float]]:
    """At most ``n`` points: every k-th point and the last one (a long run's curve keeps its shape)."""
    if len(xs) <= n:
        return list(xs), list(ys)
    k = math.ceil(len(xs) / n)
    idx = list(range(0, len(xs), k))
    if idx[-1] != len(xs) - 1:
        idx.append(len(xs) - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _open(width: int, height: int, title: str, cls: str) -> list[str]:
    return [
        f'<svg class="chart {cls}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(title)}">',
        f'<text class="title" x="{width / 2:.0f}" y="16" text-anchor="middle">{escape(title)}</text>',
    ]


def _axes(width: int, height: int, xlabel: str, ylabel: str) -> list[str]:
    x0, y0, x1 = _PAD_L, height - _PAD_B, width - _PAD_R
    return [
        f'<line class="axis" x1="{x0}" y1="{_PAD_T}" x2="{x0}" y2="{y0}"/>',
        f'<line class="axis" x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}"/>',
        f'<text class="label" x="{(x0 + x1) / 2:.0f}" y="{height - 6}" text-anchor="middle">{escape(xlabel)}</text>',
        f'<text class="label" transform="translate(12 {(_PAD_T + y0) / 2:.0f}) rotate(-90)" '
        f'text-anchor="middle">{escape(ylabel)}</text>',
    ]


def _scale(lo: float, hi: float, a: float, b: float, log: bool = False) -> tuple[list[float], Px]:
    """Tick values within ``[lo, hi]`` and the map of values onto pixels ``a .. b`` (log10 when ``log``)."""
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    if log:  # 1, 2, 5 times the powers of ten in range; just the powers when that is too many
        marks = [
            m * 10.0**d
            for d in range(math.floor(lo), math.ceil(hi) + 1)
            for m in (1, 2, 5)
            if lo - 1e-9 <= math.log10(m) + d <= hi + 1e-9
        ]
        if len(marks) > 7:
            marks = [m for m in marks if math.isclose(10 ** round(math.log10(m)), m)]
        if len(marks) < 2:  # less than a decade: round values in between
            marks = [m for m in ticks(10**lo, 10**hi, 4) if m > 0]
    else:
        marks = ticks(lo, hi)

    def to_px(v: float) -> float:
        w = math.log10(v) if log else v
        return a + (w - lo) / (hi - lo) * (b - a)

    return marks, to_px


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    width: int = 560,
    height: int = 270,
) -> str:
    """Lines of every series on shared axes, a legend in the top right; ``logy`` when all values are > 0."""
    pts = [(x, y) for s in series for x, y in zip(s.xs, s.ys) if math.isfinite(x) and math.isfinite(y)]
    out = _open(width, height, title, "line")
    if not pts:
        return "\n".join([*out, '<text class="label" x="60" y="60">no data</text>', "</svg>"])
    logy = logy and all(y > 0 for _, y in pts)
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    xt, fx = _scale(min(xs), max(xs), _PAD_L, width - _PAD_R)
    yt, fy = _scale(min(ys), max(ys), height - _PAD_B, _PAD_T, logy)
    out += _axes(width, height, xlabel, ylabel)
    out += _ticks(xt, fx, yt, fy, width, height)
    for i, s in enumerate(series):
        out += _polyline(s, fx, fy)
        ly = _PAD_T + 4 + 14 * i
        out.append(
            f'<g class="legend {s.group}"><line x1="{width - 150}" y1="{ly}" x2="{width - 132}" y2="{ly}" '
            f'stroke="{s.colour}" stroke-width="2"/><text x="{width - 128}" y="{ly + 4}">'
            f"{escape(s.label[:24])}</text></g>"
        )
    return "\n".join([*out, "</svg>"])


def _ticks(xt: list[float], fx: Px, yt: list[float], fy: Px, width: int, height: int) -> list[str]:
    out = []
    for t in xt:
        out.append(
            f'<text class="tick" x="{fx(t):.1f}" y="{height - _PAD_B + 14}" text-anchor="middle">{fmt(t)}</text>'
        )
    for t in yt:
        y = fy(t)
        out.append(
            f'<line class="grid" x1="{_PAD_L}" y1="{y:.1f}" x2="{width - _PAD_R}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{_PAD_L - 4}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>'
        )
    return out


def _polyline(s: Series, fx: Px, fy: Px) -> list[str]:
    good = [(x, y) for x, y in zip(s.xs, s.ys) if math.isfinite(x) and math.isfinite(y)]
    if s.steps:  # hold each value until the next x
        good = [p for i, (x, y) in enumerate(good) for p in ([(x, good[i - 1][1]), (x, y)] if i else [(x, y)])]
    coords = " ".join(f"{fx(x):.1f},{fy(y):.1f}" for x, y in good)
    dash = ' stroke-dasharray="5 3"' if s.dashed else ""
    out = [
        f'<g class="series {s.group}"><title>{escape(s.label)}</title>'
        f'<polyline fill="none" stroke="{s.colour}" stroke-width="1.6"{dash} points="{coords}"/>'
    ]
    if len(good) <= 60:  # few points: a dot each, its value on hover
        out += [
            f'<circle cx="{fx(x):.1f}" cy="{fy(y):.1f}" r="2.5" fill="{s.colour}"><title>'
            f"{escape(s.label)}: x {fmt(x)}, y {fmt(y)}</title></circle>"
            for x, y in good
        ]
    return [*out, "</g>"]


def bar_chart(
    categories: Sequence[str],
    stacks: Sequence[tuple[str, str, Sequence[float]]],
    *,
    title: str,
    ylabel: str,
    groups: Sequence[str] = (),
    width: int = 560,
    height: int = 270,
) -> str:
    """Stacked bars, one per category; ``stacks`` are ``(label, colour, value per category)`` from the
    bottom up; ``groups[i]`` is the CSS class of category ``i``'s bar."""
    out = _open(width, height, title, "bar")
    totals = [sum(vals[i] for _, _, vals in stacks) for i in range(len(categories))]
    if not categories or max(totals, default=0.0) <= 0:
        return "\n".join([*out, '<text class="label" x="60" y="60">no data</text>', "</svg>"])
    yt, fy = _scale(0.0, max(totals) * 1.05, height - _PAD_B, _PAD_T)
    out += _axes(width, height, "", ylabel)
    out += _ticks([], fy, yt, fy, width, height)
    slot = (width - _PAD_L - _PAD_R - 110) / len(categories)
    bar = min(46.0, slot * 0.7)
    for i, cat in enumerate(categories):
        x = _PAD_L + slot * i + (slot - bar) / 2
        base = 0.0
        group = groups[i] if i < len(groups) else ""
        out.append(f'<g class="bars {group}">')
        for label, colour, vals in stacks:
            v = vals[i]
            if v > 0:
                out.append(
                    f'<rect x="{x:.1f}" y="{fy(base + v):.1f}" width="{bar:.1f}" '
                    f'height="{fy(base) - fy(base + v):.1f}" fill="{colour}"><title>{escape(cat)}: '
                    f"{escape(label)} {fmt(v)}</title></rect>"
                )
            base += v
        out.append(
            f'<text class="tick" x="{x + bar / 2:.1f}" y="{height - _PAD_B + 14}" text-anchor="middle">'
            f"{escape(cat)}</text></g>"
        )
    for j, (label, colour, _) in enumerate(stacks):
        ly = _PAD_T + 6 + 16 * j
        out.append(
            f'<rect x="{width - 112}" y="{ly - 8}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{width - 98}" y="{ly + 1}">{escape(label)}</text>'
        )
    return "\n".join([*out, "</svg>"])


def timeline(
    rows: Sequence[Sequence[Box]],
    *,
    title: str,
    xlabel: str,
    row_labels: Sequence[str],
    span: float | None = None,
    width: int = 560,
) -> str:
    """One lane per row (a pipeline rank), each :class:`Box` drawn from ``t0`` to ``t1`` on a time axis
    from 0 to ``span`` (default: the latest ``t1``)."""
    height = _PAD_T + 26 * len(rows) + _PAD_B
    out = _open(width, height, title, "timeline")
    end = span if span is not None else max((b.t1 for r in rows for b in r), default=1.0)
    end = end if end > 0 else 1.0
    xt, fx = _scale(0.0, end, _PAD_L, width - _PAD_R)
    out += _axes(width, height, xlabel, "")
    out += _ticks(xt, fx, [], fx, width, height)
    for r, boxes in enumerate(rows):
        y = _PAD_T + 4 + 26 * r
        out.append(
            f'<text class="tick" x="{_PAD_L - 4}" y="{y + 15}" text-anchor="end">'
            f"{escape(row_labels[r] if r < len(row_labels) else str(r))}</text>"
        )
        for b in boxes:
            x0, x1 = fx(b.t0), fx(b.t1)
            w = max(0.5, x1 - x0)
            out.append(
                f'<rect x="{x0:.1f}" y="{y}" width="{w:.1f}" height="20" fill="{b.colour}" stroke="#fff" '
                f'stroke-width="0.5"><title>{escape(b.tip)}</title></rect>'
            )
            if b.text and w >= 7 * len(b.text):
                out.append(
                    f'<text class="cell" x="{(x0 + x1) / 2:.1f}" y="{y + 14}" text-anchor="middle">'
                    f"{escape(b.text)}</text>"
                )
    return "\n".join([*out, "</svg>"])
