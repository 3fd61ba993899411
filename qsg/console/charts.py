"""Line charts drawn on the server as inline SVG: no script and no charting library in the page, so that the
charts work offline, under the console's strict Content-Security-Policy, and in a screenshot."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

# Colour-blind-safe (Okabe-Ito), cycled over the series.
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")


def _number(v: float) -> str:
    if v >= 100 or float(v).is_integer():
        return f"{v:.0f}"
    return f"{v:.1f}"


# The most lines one chart draws: beyond it the lines cannot be told apart, and the chart (fetched by every open
# tab every few seconds) would grow with the group. The series with the highest last values are drawn, and the
# title says how many of how many.
MAX_SERIES = 12
LEGEND_CHAR_PX = 7  # a legend's character at the stylesheet's 10 px font, generously
LEGEND_ROW_PX = 14
LEGEND_NAME_CHARS = 40  # a longer name is cut (the line's tooltip has it whole)


def top_series(series: Mapping[str, Sequence[tuple[float, float]]],
               limit: int = MAX_SERIES) -> dict[str, Sequence[tuple[float, float]]]:
    """The ``limit`` series whose last value is highest (ties: the highest value ever, then the name)."""
    if len(series) <= limit:
        return dict(series)

    def rank(item: tuple[str, Sequence[tuple[float, float]]]) -> tuple[float, float, str]:
        name, s = item
        return (-(s[-1][1] if s else 0.0), -max((v for _, v in s), default=0.0), name)

    return dict(sorted(series.items(), key=rank)[:limit])


def _legend_layout(labels: Sequence[str], left: int, width: int) -> list[tuple[int, int]]:
    """(x, row) of each legend, wrapped onto a new row when the next would reach past the chart's right edge."""
    out: list[tuple[int, int]] = []
    x, row = left, 0
    for label in labels:
        w = 24 + LEGEND_CHAR_PX * len(label)
        if x > left and x + w > width:
            x, row = left, row + 1
        out.append((x, row))
        x += w
    return out


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float]]], *, unit: str = "",
               width: int = 520, height: int = 180, limit: int = MAX_SERIES) -> str:
    """An SVG chart of each series (name -> [(time, value)]) over the same time axis, with the value axis from
    0 to the highest value, a legend, and the last value of each series. "no data yet" while there is none.
    At most ``limit`` series are drawn (top_series); the legends wrap onto as many rows as they need, and the
    chart is as much taller, so that every legend is inside it."""
    left, right, top, bottom = 44, 10, 24, 34
    pw, ph = width - left - right, height - top - bottom
    shown = top_series(series, limit)
    if len(shown) < len(series):
        title = f"{title} (the {len(shown)} highest of {len(series)})"
    points = [p for s in shown.values() for p in s]
    if len(points) < 2:
        return "".join(_header(title, width, height, left, top, pw, ph)) + (
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" fill="#888">no data yet</text></svg>')
    names = sorted(shown)
    labels = [f"{_cut(name)}: {_number(shown[name][-1][1]) if shown[name] else '-'}" for name in names]
    layout = _legend_layout(labels, left, width - right)
    rows = 1 + max(row for _, row in layout)
    parts = _header(title, width, height + (rows - 1) * LEGEND_ROW_PX, left, top, pw, ph)
    t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
    vmax = max(v for _, v in points) or 1.0
    span = (t1 - t0) or 1.0

    def x(t: float) -> float:
        return left + (t - t0) / span * pw

    def y(v: float) -> float:
        return top + ph - v / vmax * ph

    parts += [f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" class="axis">{_number(vmax)}</text>',
              f'<text x="{left - 4}" y="{top + ph}" text-anchor="end" class="axis">0</text>',
              f'<text x="{left}" y="{top + ph + 14}" class="axis">-{_number(span)} s</text>',
              f'<text x="{left + pw}" y="{top + ph + 14}" text-anchor="end" class="axis">now</text>',
              f'<text x="{left - 4}" y="{top + ph / 2}" text-anchor="end" class="axis">{escape(unit)}</text>']
    for i, (name, label, (lx, row)) in enumerate(zip(names, labels, layout, strict=True)):
        colour = COLOURS[i % len(COLOURS)]
        dash = "" if i < len(COLOURS) else ' stroke-dasharray="6 3"'  # a colour's second line is dashed
        s = shown[name]
        if s:
            path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in s)
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="{path}">'
                         f'<title>{escape(name)}</title></polyline>')
        ly = height + row * LEGEND_ROW_PX
        parts.append(f'<rect x="{lx}" y="{ly - 12}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{lx + 14}" y="{ly - 3}" class="legend" data-series="{escape(name)}">'
                     f'{escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _cut(name: str) -> str:
    return name if len(name) <= LEGEND_NAME_CHARS else name[:LEGEND_NAME_CHARS - 1] + "\u2026"


def _header(title: str, width: int, height: int, left: int, top: int, pw: int, ph: int) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" aria-label="{escape(title)}">',
            f'<text x="{left}" y="15" class="chart-title">{escape(title)}</text>',
            f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>']


__all__ = ["COLOURS", "MAX_SERIES", "line_chart", "top_series"]
