"""The operator's only Prometheus I/O: instant queries over the HTTP API (`/api/v1/query`).

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
    endpoint = url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(endpoint, timeout=QUERY_TIMEOUT_SECONDS) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        # Prometheus answers a bad query with 400 and its JSON error body.
        try:
            answer = json.loads(exc.read())
        except ValueError:
            raise PrometheusError(f"{endpoint}: HTTP {exc.code}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PrometheusError(f"{endpoint}: {exc}") from exc
    return parse_vector(answer, label)
