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


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float]]], *, unit: str = "",
               width: int = 520, height: int = 180) -> str:
    """An SVG chart of each series (name -> [(time, value)]) over the same time axis, with the value axis from
    0 to the highest value, a legend, and the last value of each series. "no data yet" while there is none."""
    left, right, top, bottom = 44, 10, 24, 34
    pw, ph = width - left - right, height - top - bottom
    points = [p for s in series.values() for p in s]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" aria-label="{escape(title)}">',
             f'<text x="{left}" y="15" class="chart-title">{escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>']
    if len(points) < 2:
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" fill="#888">'
                     'no data yet</text></svg>')
        return "".join(parts)
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
    lx = left
    for i, (name, s) in enumerate(sorted(series.items())):
        colour = COLOURS[i % len(COLOURS)]
        if s:
            path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in s)
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}">'
                         f'<title>{escape(name)}</title></polyline>')
        last = _number(s[-1][1]) if s else "-"
        label = f"{name}: {last}"
        parts.append(f'<rect x="{lx}" y="{height - 12}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{lx + 14}" y="{height - 3}" class="legend" data-series="{escape(name)}">'
                     f'{escape(label)}</text>')
        lx += 24 + 7 * len(label)
    parts.append("</svg>")
    return "".join(parts)


__all__ = ["COLOURS", "line_chart"]
