"""The plots of docs/benchmarks.md, drawn as SVG from the recorded figures in docs/results/*.json.

    python -m benchmarks.results_plots            # write docs/results/<plot id>.svg
    python -m benchmarks.results_plots --check    # exit 1 if a committed SVG differs

Each JSON file holds one workload's recorded rows and, under "plots", what to draw from them:
`kind` "line" (numeric x, `x_log` / `y_log` for log axes) or "bar" (one group a row, named
by `category`), each series a row field (`y`) over the rows its `where` selects. `rows` names
where the rows are: a top-level key holding a list, or an object with a "rows" list; without
it, the file's own "rows". The drawing is plain SVG text with fixed formatting, so the same
JSON gives the same bytes: the committed SVGs are checked against it
(tests/benchmarks/test_results_plots.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
WIDTH, HEIGHT = 720, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 200, 40, 110
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")

Row = dict[str, Any]


def plot_rows(record: dict[str, Any], plot: dict[str, Any]) -> list[Row]:
    """The rows a plot draws from (see the module's docstring)."""
    held = record[plot.get("rows", "rows")]
    rows = held["rows"] if isinstance(held, dict) else held
    return [row for row in rows if isinstance(row, dict)]


def selected(rows: list[Row], series: dict[str, Any]) -> list[Row]:
    where = series.get("where", {})
    return [row for row in rows if all(row.get(k) == v for k, v in where.items())]


def number(text: float) -> str:
    """A coordinate or a tick label, fixed so the output does not depend on float repr."""
    return f"{text:.1f}"


def label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.2g}"


def ticks(low: float, high: float, log: bool) -> list[float]:
    """Round tick values over [low, high]: powers of ten on a log axis, 1-2-5 steps else."""
    if log:
        first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
        return [10.0**e for e in range(first, last + 1)]
    raw = (high - low) / 5 or 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    start = math.floor(low / step) * step
    return [start + i * step for i in range(math.ceil((high - start) / step) + 1)]


class Axis:
    """Maps values onto [start, end] pixels, linearly or by their logarithm."""

    def __init__(self, values: list[float], start: float, end: float, log: bool, zero: bool):
        low, high = min(values), max(values)
        if zero and not log:
            low = min(low, 0.0)
        self.ticks = ticks(low, high, log)
        self.low, self.high = self.ticks[0], self.ticks[-1]
        self.start, self.end, self.log = start, end, log

    def at(self, value: float) -> float:
        f = math.log10 if self.log else float
        span = f(self.high) - f(self.low) or 1.0
        return self.start + (f(value) - f(self.low)) / span * (self.end - self.start)


def text(x: float, y: float, body: str, anchor: str = "middle", extra: str = "") -> str:
    body = body.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return f'<text x="{number(x)}" y="{number(y)}" text-anchor="{anchor}"{extra}>{body}</text>'


def frame(plot: dict[str, Any], y_axis: Axis) -> list[str]:
    """The title, the y axis with its ticks and grid lines, and the y label."""
    parts = [text(WIDTH / 2, 22, plot["title"], extra=' font-weight="bold"')]
    for tick in y_axis.ticks:
        y = y_axis.at(tick)
        parts.append(
            f'<line x1="{LEFT}" y1="{number(y)}" x2="{WIDTH - RIGHT}" y2="{number(y)}" '
            'stroke="#ddd"/>'
        )
        parts.append(text(LEFT - 6, y + 4, label(tick), anchor="end"))
    mid = (TOP + HEIGHT - BOTTOM) / 2
    parts.append(text(16, mid, plot["y_label"], extra=f' transform="rotate(-90 16 {number(mid)})"'))
    parts.append(
        f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" '
        'stroke="#333"/>'
    )
    return parts


def legend(names: list[str]) -> list[str]:
    parts = []
    for i, name in enumerate(names):
        y = TOP + 10 + 20 * i
        colour = COLOURS[i % len(COLOURS)]
        parts.append(
            f'<rect x="{WIDTH - RIGHT + 14}" y="{y - 9}" width="12" height="12" fill="{colour}"/>'
        )
        parts.append(text(WIDTH - RIGHT + 32, y + 1, name, anchor="start"))
    return parts


def line_chart(plot: dict[str, Any], rows: list[Row]) -> list[str]:
    series = [
        [(float(r[plot["x"]]), float(r[s["y"]])) for r in selected(rows, s) if r.get(s["y"])]
        for s in plot["series"]
    ]
    xs = [x for points in series for x, _ in points]
    ys = [y for points in series for _, y in points]
    x_axis = Axis(xs, LEFT + 10, WIDTH - RIGHT - 10, plot.get("x_log", False), zero=False)
    y_axis = Axis(ys, HEIGHT - BOTTOM, TOP, plot.get("y_log", False), zero=True)
    parts = frame(plot, y_axis)
    for x in sorted(set(xs)):
        parts.append(text(x_axis.at(x), HEIGHT - BOTTOM + 18, label(x)))
    parts.append(text((LEFT + WIDTH - RIGHT) / 2, HEIGHT - BOTTOM + 42, plot["x_label"]))
    for i, points in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{number(x_axis.at(x))},{number(y_axis.at(y))}" for x, y in sorted(points))
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in points:
            parts.append(
                f'<circle cx="{number(x_axis.at(x))}" cy="{number(y_axis.at(y))}" r="3.5" '
                f'fill="{colour}"/>'
            )
    return parts + legend([s["name"] for s in plot["series"]])


def bar_chart(plot: dict[str, Any], rows: list[Row]) -> list[str]:
    groups = [str(r[plot["category"]]) for r in rows]
    values = [[r.get(s["y"]) for s in plot["series"]] for r in rows]
    present = [float(v) for vs in values for v in vs if v is not None]
    y_axis = Axis(present, HEIGHT - BOTTOM, TOP, plot.get("y_log", False), zero=True)
    parts = frame(plot, y_axis)
    group_width = (WIDTH - LEFT - RIGHT) / len(groups)
    bar_width = group_width * 0.8 / len(plot["series"])
    base = HEIGHT - BOTTOM
    for g, (group, vs) in enumerate(zip(groups, values, strict=True)):
        x0 = LEFT + g * group_width + group_width * 0.1
        for s, value in enumerate(vs):
            if value is None:
                continue
            top = y_axis.at(float(value)) if float(value) > 0 else base
            parts.append(
                f'<rect x="{number(x0 + s * bar_width)}" y="{number(top)}" '
                f'width="{number(bar_width)}" height="{number(base - top)}" '
                f'fill="{COLOURS[s % len(COLOURS)]}"/>'
            )
        cx, cy = x0 + group_width * 0.4, base + 12
        parts.append(
            text(cx, cy, group, anchor="end", extra=f' transform="rotate(-30 {number(cx)} {cy})"')
        )
    return parts + legend([s["name"] for s in plot["series"]])


def render(record: dict[str, Any], plot: dict[str, Any]) -> str:
    """One plot of one workload's record as an SVG document."""
    rows = plot_rows(record, plot)
    body = line_chart(plot, rows) if plot["kind"] == "line" else bar_chart(plot, rows)
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">'
    )
    background = f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>'
    return "\n".join([head, background, *body, "</svg>"]) + "\n"


def all_plots(results: Path) -> dict[Path, str]:
    """Every plot of every record under `results`, by the SVG path it is committed at."""
    out = {}
    for source in sorted(results.glob("*.json")):
        record = json.loads(source.read_text())
        for plot in record.get("plots", []):
            out[results / f"{plot['id']}.svg"] = render(record, plot)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for path, svg in all_plots(args.results).items():
        if args.check:
            if not path.exists() or path.read_text() != svg:
                stale.append(path)
        else:
            path.write_text(svg)
            print(path)
    for path in stale:
        print(f"{path} differs from its JSON: run `make results`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
