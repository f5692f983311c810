"""One-sided rank tests for a trial (pure): is one side's figure larger than the other's,
beyond a relative margin?

Mann-Whitney U (normal approximation with continuity and tie corrections) assumes nothing of
the samples' distribution: a throughput or a p99 over stretches of a window is skewed, and a
stretch that caught a burst's edge is an outlier a mean would follow. A margin is tested by
scaling the other side: "xs exceed ys by more than 3%" is "xs tend to exceed 1.03 ys", the
one-sided test of a shift on the ratio scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def mann_whitney_greater(xs: Sequence[float], ys: Sequence[float]) -> float:
    """One-sided p-value that values of `xs` tend to exceed those of `ys`."""
    n_x, n_y = len(xs), len(ys)
    pooled = sorted([(v, 0) for v in xs] + [(v, 1) for v in ys])
    ranks = [0.0] * len(pooled)
    tie_term = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1  # the average rank of a tie group
        size = j - i + 1
        tie_term += size**3 - size
        i = j + 1
    rank_sum_x = sum(r for r, (_, side) in zip(ranks, pooled, strict=True) if side == 0)
    u = rank_sum_x - n_x * (n_x + 1) / 2
    n = n_x + n_y
    var = n_x * n_y / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0:
        return 0.5  # every value equal: no evidence either way
    z = (u - n_x * n_y / 2 - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


def scaled(values: Sequence[float], factor: float) -> list[float]:
    return [v * factor for v in values]


def p_higher(xs: Sequence[float], ys: Sequence[float], margin: float) -> float:
    """p for "xs are higher than ys by more than `margin`" (relative; a negative margin asks
    "not lower by more than -margin", a non-inferiority test)."""
    return mann_whitney_greater(xs, scaled(ys, 1 + margin))


def p_lower(xs: Sequence[float], ys: Sequence[float], margin: float) -> float:
    """p for "xs are lower than ys by more than `margin`" (relative)."""
    return mann_whitney_greater(scaled(ys, 1 - margin), xs)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
