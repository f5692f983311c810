"""W-tune's spread between engine starts: some of a class's grid points served `--repeats`
times each, pass after pass, every other pass in reverse, so no point always comes after
another. One policy's throughput varies from one engine start to the next; when two points'
ranges overlap, the grid's "best" between them is a draw of that spread, and a tuner that
picked either one is not behind the grid.

Reports each serving (pass, point, output tok/s, TTFT p99) in the order served and, per point,
the mean, lowest and highest output tok/s and the spread (highest - lowest) / mean; then each
point's mean against the best mean, and whether their ranges overlap. The server, clients and
windows are W-tune's (`tune_serve.py`); the options are `tune.py`'s, plus the two below.

    PYTHONPATH=operator:engine:memplan:. python benchmarks/tune_spread.py --quick \\
        --classes chat --points 1 2 --repeats 5 --sample-interval 0.25 --json spread.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import tune
from benchmarks import tune_workload as tw
from benchmarks.tune_serve import Serve
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.tuning import TuningSpec


def serving_order(points: list[int], repeats: int) -> list[tuple[int, int]]:
    """(pass, point) in the order served: the points as given, then reversed, and so on."""
    assert repeats >= 1 and points, "at least one point and one pass"
    return [
        (p, point)
        for p in range(repeats)
        for point in (points if p % 2 == 0 else list(reversed(points)))
    ]


def summarize(
    servings: list[dict[str, Any]], grid: list[MemoryPolicy], spec: TuningSpec
) -> list[dict[str, Any]]:
    """Per point served: its policy, each serving's score under the class's objective in the
    order served, their mean, range and spread, the share of the best point's mean, and whether
    its range overlaps the best point's."""
    by_point: dict[int, list[float]] = {}
    for s in servings:
        by_point.setdefault(s["point"], []).append(tune.score(s["trial"], spec))
    stats: dict[int, dict[str, Any]] = {
        k: {"point": k, "policy": grid[k].to_api(), "scores": v, "mean": mean(v),
            "lowest": min(v), "highest": max(v)}
        for k, v in sorted(by_point.items())
    }  # fmt: skip
    best = max(stats.values(), key=lambda s: s["mean"])
    keys = {k for s in stats.values() for k in s["policy"]}
    varying = sorted(
        k for k in keys if len({json.dumps(s["policy"].get(k)) for s in stats.values()}) > 1
    )
    for s in stats.values():
        s["spread"] = (s["highest"] - s["lowest"]) / s["mean"] if s["mean"] else None
        s["share_of_best_mean"] = s["mean"] / best["mean"] if best["mean"] else None
        s["overlaps_best"] = s["highest"] >= best["lowest"] and s["lowest"] <= best["highest"]
        s["differs"] = {k: s["policy"].get(k) for k in varying}  # from the other points
    return list(stats.values())


def run_class(cls: tw.WorkloadClass, args: argparse.Namespace, serve: Serve) -> dict[str, Any]:
    spec = cls.tuning if args.objective is None else tune.objective_spec(args)
    points = args.points if args.points else list(range(len(cls.grid)))
    bad = [k for k in points if not 0 <= k < len(cls.grid)]
    if bad:
        raise SystemExit(f"--points {bad}: {cls.name}'s grid has points 0 to {len(cls.grid) - 1}")
    servings = []
    for p, k in serving_order(points, args.repeats):
        trial, _ = serve(cls.grid[k], f"{cls.name}_pass{p}_point{k}")
        servings.append({"pass": p, "point": k, "trial": trial})
        print(tune.format_row(f"{cls.name} pass {p} point {k}", {"trial": trial}, spec))
    return {"class": cls.name, "objective": spec.to_api(), "servings": servings,
            "points": summarize(servings, cls.grid, spec)}  # fmt: skip


def format_point(s: dict[str, Any]) -> str:
    scores = " / ".join(f"{v:,.0f}" for v in s["scores"])
    spread = "-" if s["spread"] is None else f"{s['spread']:.1%}"
    share = "-" if s["share_of_best_mean"] is None else f"{s['share_of_best_mean']:.1%}"
    return (
        f"  point {s['point']} {json.dumps(s['differs'])}: {scores}; mean {s['mean']:,.0f}, "
        f"spread {spread}, {share} of the best mean, "
        f"{'overlaps' if s['overlaps_best'] else 'does not overlap'} the best's range"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="W-tune's spread: grid points served repeatedly, alternating order",
        epilog="every other option is tune.py's",
    )
    parser.add_argument("--points", type=int, nargs="+", default=None,
                        help="grid point indices (default: every point)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="passes over the points")
    own, rest = parser.parse_known_args(argv)
    if own.repeats < 1:
        parser.error("--repeats must be at least 1")
    args = tune.parse_args(rest)
    args.points, args.repeats = own.points, own.repeats
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    def run(cls: tw.WorkloadClass, serve: Serve) -> dict[str, Any]:
        result = run_class(cls, args, serve)
        print(f"# {cls.name}, output tok/s under {json.dumps(result['objective'])}:")
        for s in result["points"]:
            print(format_point(s))
        return result

    return tune.serve_classes(args, run)


if __name__ == "__main__":
    main()
