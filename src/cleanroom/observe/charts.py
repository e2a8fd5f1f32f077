"""Small inline-SVG charts for the HTML report: no JavaScript, no network, no dependencies.

Each function returns one ``<svg>`` element as a string, with an ``id`` and CSS classes a test (or
a stylesheet) can find, and a ``<title>`` on every mark so hovering shows the exact value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from cleanroom.observe.report import percentile

WIDTH = 720
FONT = 11


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values (1, 2, 5 x 10^k steps) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(count, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    ticks, value = [], first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < hi:
        ticks.append(round(value, 12))
    return ticks


def fmt_seconds(seconds: float) -> str:
    """A duration for a label: ``850 µs``, ``12.5 ms``, ``3.2 s``, ``95 s``."""
    if seconds == 0:
        return "0"
    if seconds < 0.001:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 100:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s"


def fmt_number(value: float) -> str:
    return f"{value:.4g}"


def _svg(chart_id: str, cls: str, height: float, body: list[str], label: str) -> str:
    return (
        f'<svg id="{escape(chart_id)}" class="chart {cls}" width="{WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {WIDTH} {height:.0f}" role="img" aria-label="{escape(label)}">'
        + "".join(body)
        + "</svg>"
    )


def _text(x: float, y: float, text: str, anchor: str = "start", cls: str = "label") -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" class="{cls}" '
        f'font-size="{FONT}">{escape(text)}</text>'
    )


def _rect(x: float, y: float, w: float, h: float, cls: str, fill: str, title: str) -> str:
    return (
        f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.0):.2f}" height="{h:.2f}" '
        f'class="{cls}" fill="{fill}"><title>{escape(title)}</title></rect>'
    )


def _axis(x0: float, x1: float, y: float, lo: float, hi: float, fmt: str) -> list[str]:
    """A horizontal axis at ``y`` with ticks mapping [lo, hi] onto [x0, x1]."""
    out = [f'<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" class="axis" stroke="#888"/>']
    span = (hi - lo) or 1.0
    for tick in nice_ticks(lo, hi):
        if tick < lo - span * 1e-9 or tick > hi + span * 1e-9:
            continue
        x = x0 + (tick - lo) / span * (x1 - x0)
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#888"/>')
        label = fmt_seconds(tick) if fmt == "s" else fmt_number(tick)
        out.append(_text(x, y + 15, label, "middle", "tick"))
    return out


def bar_chart(chart_id: str, items: Sequence[tuple[str, float, str]], unit: str = "") -> str:
    """Horizontal bars: (label, value, colour) per row; zero rows are drawn dimmed."""
    row, left, right = 24, 130, 60
    height = row * len(items) + 10
    top = max((v for _, v, _ in items), default=0) or 1
    body = []
    for i, (label, value, colour) in enumerate(items):
        y = 5 + i * row
        w = (WIDTH - left - right) * value / top
        cls = "bar" + (" zero" if not value else "")
        body.append(_text(left - 8, y + 15, label, "end", "label" + (" dim" if not value else "")))
        body.append(_rect(left, y + 3, w, row - 8, cls, colour, f"{label}: {value:g}{unit}"))
        body.append(_text(left + w + 6, y + 15, f"{value:g}{unit}", "start", "value"))
    return _svg(chart_id, "bars", height, body, "bar chart")


def histogram(
    chart_id: str,
    values: Sequence[float],
    *,
    colour: str,
    unit: str = "s",
    marks: Sequence[tuple[str, float]] = (),
    bins: int | None = None,
) -> str:
    """A histogram of ``values`` (linear bins over their range) with labelled vertical marks."""
    height, left, right, top, bottom = 150, 40, 20, 22, 26
    body: list[str] = []
    if not values:
        body.append(_text(WIDTH / 2, height / 2, "no data", "middle", "dim"))
        return _svg(chart_id, "histogram", height, body, "histogram (no data)")
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        pad = abs(lo) * 0.1 or 0.001
        lo, hi = max(lo - pad, 0.0), hi + pad
    n = bins or max(5, min(30, math.ceil(math.sqrt(len(values)) * 2)))
    width = (hi - lo) / n
    counts = [0] * n
    for v in values:
        counts[min(int((v - lo) / width), n - 1)] += 1
    peak = max(counts)
    plot_w, plot_h = WIDTH - left - right, height - top - bottom
    for i, c in enumerate(counts):
        x = left + i * plot_w / n
        h = plot_h * c / peak
        a, b = lo + i * width, lo + (i + 1) * width
        span = f"{fmt_seconds(a)} to {fmt_seconds(b)}" if unit == "s" else f"{a:.4g} to {b:.4g}"
        title = f"{span}: {c} episode{'s' if c != 1 else ''}"
        body.append(_rect(x + 0.5, top + plot_h - h, plot_w / n - 1, h, "hist-bar", colour, title))
    body.append(_text(left - 6, top + 8, str(peak), "end", "tick"))
    body.append(_text(left - 6, top + plot_h, "0", "end", "tick"))
    body.extend(_axis(left, WIDTH - right, top + plot_h, lo, hi, unit))
    for k, (name, value) in enumerate(marks):
        x = left + (value - lo) / (hi - lo) * plot_w
        shown = fmt_seconds(value) if unit == "s" else fmt_number(value)
        body.append(
            f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{top + plot_h}" '
            f'class="mark" stroke="#333" stroke-dasharray="3,3"/>'
        )
        near_end = x > WIDTH - right - 70
        body.append(
            _text(
                x - 3 if near_end else x + 3,
                top - 8 + 10 * (k % 2),
                f"{name} {shown}",
                "end" if near_end else "start",
                "mark-label",
            )
        )
    return _svg(chart_id, "histogram", height, body, f"histogram of {len(values)} values")


def strip_plot(
    chart_id: str, groups: Sequence[tuple[str, Sequence[float], str]], *, value_name: str
) -> str:
    """One row per group: every value as a dot, the inter-quartile box and the median."""
    row, left, right, bottom = 46, 130, 30, 28
    height = row * len(groups) + bottom + 6
    every = [v for _, vs, _ in groups for v in vs]
    body: list[str] = []
    if not every:
        body.append(_text(WIDTH / 2, 30, "no rewards recorded", "middle", "dim"))
        return _svg(chart_id, "strip", 60, body, "no data")
    lo, hi = min(every), max(every)
    if hi - lo < 1e-9:
        lo, hi = lo - 1, hi + 1
    plot_w = WIDTH - left - right

    def x_of(v: float) -> float:
        return left + (v - lo) / (hi - lo) * plot_w

    for i, (name, vs, colour) in enumerate(groups):
        mid = 6 + i * row + row / 2
        body.append(_text(left - 8, mid + 4, name, "end"))
        ordered = sorted(vs)
        if ordered:
            q1, med, q3 = (percentile(ordered, q) for q in (25, 50, 75))
            body.append(
                _rect(
                    x_of(q1),
                    mid - 12,
                    x_of(q3) - x_of(q1),
                    24,
                    "box",
                    colour + "33",
                    f"{name}: quartiles {q1:.4g} to {q3:.4g}",
                )
            )
            body.append(
                f'<line x1="{x_of(med):.1f}" y1="{mid - 14}" x2="{x_of(med):.1f}" '
                f'y2="{mid + 14}" class="median" stroke="{colour}" stroke-width="2">'
                f"<title>{escape(f'{name}: median {med:.4g}')}</title></line>"
            )
        for j, v in enumerate(vs):
            jitter = ((j * 7919) % 17 - 8) * 1.1  # deterministic spread, no RNG
            body.append(
                f'<circle cx="{x_of(v):.1f}" cy="{mid + jitter:.1f}" r="3.5" class="reward-dot" '
                f'fill="{colour}" fill-opacity="0.75">'
                f"<title>{escape(f'{name}: {value_name} {v:.6g}')}</title></circle>"
            )
    body.extend(_axis(left, WIDTH - right, 6 + row * len(groups), lo, hi, "n"))
    return _svg(chart_id, "strip", height, body, f"{value_name} per group")


@dataclass(frozen=True)
class Span:
    """One coloured piece of a timeline bar: [start, end) in seconds from the run's start."""

    start: float
    end: float
    phase: str
    colour: str


@dataclass(frozen=True)
class Lane:
    """One timeline row (one env): its label, its pieces, a tooltip, extra CSS classes."""

    key: str
    label: str
    spans: tuple[Span, ...]
    title: str
    cls: str = ""


def timeline(chart_id: str, lanes: Sequence[Lane], total_s: float) -> str:
    """One horizontal bar per lane (env), made of its phase spans, on a shared time axis."""
    left, right, top, bottom = 150, 20, 8, 30
    row = 18.0 if len(lanes) <= 40 else max(4.0, 720 / len(lanes))
    height = top + row * len(lanes) + bottom
    total = total_s if total_s > 0 else 1.0
    plot_w = WIDTH - left - right
    body: list[str] = []
    for i, lane in enumerate(lanes):
        y = top + i * row
        if row >= 10:
            body.append(_text(left - 8, y + row * 0.7, lane.label, "end", "label lane-label"))
        body.append(
            f'<g class="env-bar {escape(lane.cls)}" data-env-id="{escape(lane.key)}">'
            f"<title>{escape(lane.title)}</title>"
        )
        for span in lane.spans:
            x0 = left + span.start / total * plot_w
            w = max((span.end - span.start) / total * plot_w, 1.0)
            body.append(
                f'<rect x="{x0:.2f}" y="{y + row * 0.12:.2f}" width="{w:.2f}" '
                f'height="{row * 0.76:.2f}" class="span span-{escape(span.phase)}" '
                f'fill="{span.colour}"/>'
            )
        body.append("</g>")
    body.extend(_axis(left, WIDTH - right, top + row * len(lanes) + 2, 0.0, total, "s"))
    return _svg(chart_id, "timeline", height, body, f"timeline of {len(lanes)} envs")
