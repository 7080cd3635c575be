"""``forged bench --plot FILE.svg``: latency against concurrency as an SVG, written by
hand, so that the package (which has no matplotlib) can plot too.

Both axes are logarithmic, as in the PNG: concurrency doubles from run to run, and
latencies span milliseconds to minutes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from html import escape

WIDTH, HEIGHT = 700, 450
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 110  # the legend sits below the axes
COLOURS = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989"]

Series = tuple[str, list[tuple[float, float]], bool]  # label, points, dashed


Axis = Callable[[float], float]


def _scale(lo: float, hi: float, size: float, flip: bool) -> tuple[int, int, Axis]:
    """A log axis from decade ``lo`` to decade ``hi`` onto ``size`` pixels."""
    a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    b = max(b, a + 1)

    def at(v: float) -> float:
        f = (math.log10(v) - a) / (b - a)
        return size * (1 - f) if flip else size * f

    return a, b, at


def svg(series: list[Series], title: str, xlabel: str, ylabel: str) -> str:
    pts = [p for _, ps, _ in series for p in ps if p[0] > 0 and p[1] > 0]
    if not pts:
        return _frame(title, ["<text x='350' y='225' text-anchor='middle'>no data</text>"])
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    xa, xb, x = _scale(min(p[0] for p in pts), max(p[0] for p in pts), w, False)
    ya, yb, y = _scale(min(p[1] for p in pts), max(p[1] for p in pts), h, True)
    out = _axes(xa, xb, x, ya, yb, y, w, h, xlabel, ylabel)
    for i, (label, ps, dashed) in enumerate(series):
        colour = COLOURS[i // 2 % len(COLOURS)]
        good = [(x(px), y(py)) for px, py in ps if px > 0 and py > 0]
        line = " ".join(f"{LEFT + a:.1f},{TOP + b:.1f}" for a, b in good)
        dash = " stroke-dasharray='6 4'" if dashed else ""
        out.append(f"<polyline points='{line}' fill='none' stroke='{colour}' "
                   f"stroke-width='2'{dash}/>")
        out += [f"<circle cx='{LEFT + a:.1f}' cy='{TOP + b:.1f}' r='3' fill='{colour}'/>"
                for a, b in good]
        ly = HEIGHT - BOTTOM + 45 + 14 * i
        out.append(f"<line x1='{LEFT}' y1='{ly - 4}' x2='{LEFT + 24}' y2='{ly - 4}' "
                   f"stroke='{colour}' stroke-width='2'{dash}/>"
                   f"<text x='{LEFT + 30}' y='{ly}' font-size='11'>{escape(label)}</text>")
    # One legend line per series: three servers' six would run past HEIGHT.
    return _frame(title, out, max(HEIGHT, HEIGHT - BOTTOM + 50 + 14 * len(series)))


def _axes(xa: int, xb: int, x: Axis, ya: int, yb: int, y: Axis, w: float, h: float,
          xlabel: str, ylabel: str) -> list[str]:
    """The plot's box, a line and a label per decade (and 2, 5 between), axis names."""
    out = [f"<rect x='{LEFT}' y='{TOP}' width='{w}' height='{h}' fill='none' "
           "stroke='#888'/>"]
    for v in _ticks(xa, xb):
        px = LEFT + x(v)
        out.append(f"<line x1='{px:.1f}' y1='{TOP}' x2='{px:.1f}' y2='{TOP + h}' "
                   f"stroke='#ddd'/><text x='{px:.1f}' y='{TOP + h + 15}' "
                   f"text-anchor='middle' font-size='11'>{v:g}</text>")
    for v in _ticks(ya, yb):
        py = TOP + y(v)
        out.append(f"<line x1='{LEFT}' y1='{py:.1f}' x2='{LEFT + w}' y2='{py:.1f}' "
                   f"stroke='#ddd'/><text x='{LEFT - 5}' y='{py + 4:.1f}' "
                   f"text-anchor='end' font-size='11'>{v:g}</text>")
    out.append(f"<text x='{LEFT + w / 2}' y='{TOP + h + 32}' text-anchor='middle'>"
               f"{escape(xlabel)}</text><text x='16' y='{TOP + h / 2}' text-anchor='middle' "
               f"transform='rotate(-90 16 {TOP + h / 2})'>{escape(ylabel)}</text>")
    return out


def _ticks(a: int, b: int) -> list[float]:
    """1, 2 and 5 times each power of ten from 10**a to 10**b."""
    return [m * 10.0 ** d for d in range(a, b + 1) for m in (1, 2, 5)
            if 10.0 ** a <= m * 10.0 ** d <= 10.0 ** b]


def _frame(title: str, body: list[str], height: int = HEIGHT) -> str:
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{WIDTH}' height='{height}' "
            f"viewBox='0 0 {WIDTH} {height}' font-family='sans-serif'>"
            f"<rect width='100%' height='100%' fill='white'/>"
            f"<text x='{WIDTH / 2}' y='24' text-anchor='middle' font-size='15'>"
            f"{escape(title)}</text>" + "".join(body) + "</svg>\n")
