"""The table of docs/crash-consistency.md from a run's results, which `make test-crash` writes:
`python -m tests.crash.report build/crash-results.jsonl`."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from pagekeeper_operator.faultpoints import FaultPoint


def table(lines: list[str]) -> str:
    """One row per fault point, in the registry's order: its seeds, outcome, time to converge
    after the restart (fastest and slowest seed)."""
    by_point: dict[str, list[dict[str, object]]] = defaultdict(list)
    for line in lines:
        if line.strip():
            result = json.loads(line)
            by_point[str(result["point"])].append(result)
    rows = [
        "| kill point | seeds passed | outcome after the restart | converged in (s) |",
        "|---|---|---|---|",
    ]
    for point in FaultPoint:
        results = sorted(by_point.get(str(point), []), key=lambda r: int(str(r["seed"])))
        if not results:
            rows.append(f"| `{point}` | none | - | - |")
            continue
        seeds = ", ".join(str(r["seed"]) for r in results)
        outcomes = "; ".join(sorted({str(r["outcome"]) for r in results}))
        times = [float(str(r["seconds"])) for r in results]
        fastest, slowest = f"{min(times):.0f}", f"{max(times):.0f}"
        spread = fastest if fastest == slowest else f"{fastest}-{slowest}"
        rows.append(f"| `{point}` | {seeds} | {outcomes} | {spread} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(Path(sys.argv[1]).read_text(encoding="utf-8").splitlines()))
