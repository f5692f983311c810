"""Pod-deletion costs: the plan from pods and their requests in flight, and the Prometheus
answers it reads, without a cluster; one round against a real Prometheus HTTP API shape."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlparse

import pytest

from pagekeeper_operator.adapters.prometheus import PrometheusError, parse_vector, query_by
from pagekeeper_operator.controllers.scaledown import (
    DELETION_COST_ANNOTATION,
    in_flight_query,
    plan_deletion_costs,
)


def _pod(name: str, *, ready: bool = True, cost: str | None = None, going: bool = False) -> Any:
    metadata: dict[str, Any] = {"name": name}
    if cost is not None:
        metadata["annotations"] = {DELETION_COST_ANNOTATION: cost}
    if going:
        metadata["deletionTimestamp"] = "2025-01-02T03:04:05Z"
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"metadata": metadata, "status": status}


def test_each_ready_pod_costs_its_requests_in_flight() -> None:
    pods = [
        _pod("busy"),
        _pod("idle", cost="3"),
        _pod("unscraped", cost="0"),
        _pod("starting", ready=False),
        _pod("draining", cost="9", going=True),
        _pod("steady", cost="2"),
    ]
    in_flight = {"busy": 7.0, "idle": 0.0, "steady": 2.0, "starting": 4.0, "draining": 1.0}
    # Only costs that changed are written; pods not ready or already going are left alone
    # (the ReplicaSet removes those first anyway).
    assert plan_deletion_costs(pods, in_flight) == {"busy": "7", "idle": "0"}


def test_a_pod_without_series_keeps_its_last_cost() -> None:
    """Prometheus restarted empty, or lost the pod's target: no data is not an idle pod."""
    pods = [_pod("busy", cost="6"), _pod("new"), _pod("scraped", cost="1")]
    assert plan_deletion_costs(pods, {}) == {}
    assert plan_deletion_costs(pods, {"scraped": 0.0}) == {"scraped": "0"}


def test_the_query_sums_the_most_running_and_waiting_by_pod() -> None:
    assert in_flight_query("ml", "qwen") == (
        'sum by (pod) (max_over_time(vllm:num_requests_running{namespace="ml",llmserver="qwen"}'
        "[30s])) + "
        'sum by (pod) (max_over_time(vllm:num_requests_waiting{namespace="ml",llmserver="qwen"}'
        "[30s]))"
    )


def _vector(*samples: tuple[str, str]) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": {"pod": pod}, "value": [1.0, value]} for pod, value in samples],
        },
    }


def test_vectors_are_read_by_label() -> None:
    answer = _vector(("a", "3"), ("b", "NaN"), ("c", "0.5"))
    assert parse_vector(answer, "pod") == {"a": 3.0, "c": 0.5}
    with pytest.raises(PrometheusError, match="parse error"):
        parse_vector({"status": "error", "error": "parse error"}, "pod")
    with pytest.raises(PrometheusError, match="expected a vector"):
        parse_vector({"status": "success", "data": {"resultType": "matrix"}}, "pod")


class _Prometheus(BaseHTTPRequestHandler):
    """Answers /api/v1/query like Prometheus: a vector, or 400 with its error body."""

    queries: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        query = parse_qs(urlparse(self.path).query)["query"][0]
        self.queries.append(query)
        if "(" not in query:
            body, code = {"status": "error", "errorType": "bad_data", "error": "bad"}, 400
        else:
            body, code = _vector(("p-1", "2")), 200
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Prometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_queries_over_http(prometheus: str) -> None:
    assert query_by(prometheus, in_flight_query("ml", "qwen"), "pod") == {"p-1": 2.0}
    assert _Prometheus.queries[-1] == in_flight_query("ml", "qwen")
    with pytest.raises(PrometheusError, match="bad"):
        query_by(prometheus, "up", "pod")
    with pytest.raises(PrometheusError, match=r"127\.0\.0\.1:1/"):
        query_by("http://127.0.0.1:1", "up", "pod")
