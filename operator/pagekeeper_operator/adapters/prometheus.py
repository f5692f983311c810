"""The operator's only Prometheus I/O: instant queries over the HTTP API (`/api/v1/query`),
answered by a vector (`query_by`) or, for a subquery, a range vector (`query_samples`).

Blocking (urllib); async callers run it in a worker thread.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

QUERY_TIMEOUT_SECONDS = 10.0


class PrometheusError(RuntimeError):
    """Prometheus could not be reached or refused the query; the message says which."""


def parse_vector(answer: Any, label: str) -> dict[str, float]:
    """`label` value -> sample value of an instant-vector answer; NaN samples are left out."""
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise PrometheusError(f"query failed: {error}")
    data = answer.get("data") or {}
    if data.get("resultType") != "vector":
        raise PrometheusError(f"expected a vector, got {data.get('resultType')!r}")
    values = {}
    for sample in data.get("result") or []:
        key = (sample.get("metric") or {}).get(label)
        try:
            value = float(sample["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if key is not None and not math.isnan(value):
            values[str(key)] = value
    return values


def query_by(url: str, promql: str, label: str) -> dict[str, float]:
    """Run an instant query at `url` (the server's base URL); `label` value -> value."""
    return parse_vector(_answer(url, promql), label)


def parse_matrix(answer: Any, label: str) -> dict[str, list[float]]:
    """`label` value -> the sample values of a range-vector answer (a subquery), oldest first;
    NaN samples are left out."""
    if not isinstance(answer, dict) or answer.get("status") != "success":
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise PrometheusError(f"query failed: {error}")
    data = answer.get("data") or {}
    if data.get("resultType") != "matrix":
        raise PrometheusError(f"expected a matrix, got {data.get('resultType')!r}")
    series: dict[str, list[float]] = {}
    for sample in data.get("result") or []:
        key = (sample.get("metric") or {}).get(label)
        if key is None:
            continue
        values = []
        for point in sample.get("values") or []:
            try:
                value = float(point[1])
            except (IndexError, TypeError, ValueError):
                continue
            if not math.isnan(value):
                values.append(value)
        series[str(key)] = values
    return series


def _answer(url: str, promql: str) -> Any:
    endpoint = url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(endpoint, timeout=QUERY_TIMEOUT_SECONDS) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        # Prometheus answers a bad query with 400 and its JSON error body.
        try:
            return json.loads(exc.read())
        except ValueError:
            raise PrometheusError(f"{endpoint}: HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PrometheusError(f"{endpoint}: {exc}") from exc


def query_samples(url: str, promql: str, label: str) -> dict[str, list[float]]:
    """Run an instant query whose answer is a range vector (`expr[10m:1m]`); `label` value ->
    its samples."""
    return parse_matrix(_answer(url, promql), label)
