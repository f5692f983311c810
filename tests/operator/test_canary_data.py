"""A canary without Prometheus's data (pure): it holds, never promotes, and past the bound is
taken back on noData; data after a gap restarts the clean clock."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagekeeper_operator.api.rollout import CanarySpec, CanaryStatus
from pagekeeper_operator.rollout.canary import CanaryEvent, CanaryPlan, CanaryPod, decide_canary
from pagekeeper_operator.rollout.canary_data import (
    CanaryData,
    canary_up_query,
    observe_canary_data,
    track_data,
)
from pagekeeper_operator.timestamps import parse_time

T0 = datetime(2026, 11, 23, 10, 0, 0, tzinfo=UTC)
POD = "qwen-canary-7d9f-abcde"
SPEC = CanarySpec(enabled=True, replicas=1, analysis_seconds=600)
READY = CanaryPod(POD, is_ready=True, restarts=0, oom_terminations=0)
ANALYZING = CanaryStatus(
    phase="Analyzing",
    template_hash="new",
    stable_template_hash="old",
    started_at="2026-11-23T10:00:00Z",
    message="1 canary pod(s) run the new template for 600s",
)
SCRAPED = CanaryData(scraped_pods=frozenset({POD}))
DOWN = CanaryData(error="http://prometheus:9090/api/v1/query?...: Connection refused")


def decide(
    previous: CanaryStatus,
    data: CanaryData | None,
    seconds: float,
    pods: tuple[CanaryPod, ...] = (READY,),
) -> CanaryPlan:
    return decide_canary(
        SPEC,
        replicas=4,
        max_surge=0,
        candidate="new",
        stable="old",
        previous=previous,
        pods=pods,
        history=(),
        server_name="qwen",
        now=T0 + timedelta(seconds=seconds),
        data=data,
        no_data_seconds=300,
    )


def test_with_data_the_analysis_counts_from_the_first_data_and_promotes() -> None:
    first = decide(ANALYZING, SCRAPED, 30)
    watched = ANALYZING.model_copy(update={"data_since": "2026-11-23T10:00:30Z"})
    assert first == CanaryPlan(False, 3, 1, watched, None)
    # 600 s after the start, but not yet 600 s of data
    assert decide(watched, SCRAPED, 600) == CanaryPlan(False, 3, 1, watched, None)
    promoted = decide(watched, SCRAPED, 630)
    assert promoted.main_runs_candidate and promoted.status is not None
    assert promoted.status.phase == "Promoted"


def test_without_prometheus_the_canary_holds_saying_why_and_never_promotes() -> None:
    plan = decide(ANALYZING, DOWN, 700)
    message = (
        "holding: Prometheus did not answer: http://prometheus:9090/api/v1/query?...: "
        "Connection refused; the canary is not promoted without data, and is taken back at "
        "2026-11-23T10:16:40Z if none comes"
    )
    held = ANALYZING.model_copy(
        update={"data_missing_since": "2026-11-23T10:11:40Z", "message": message}
    )
    assert plan == CanaryPlan(False, 3, 1, held, CanaryEvent("Warning", "CanaryNoData", message))
    # the gap goes on: the same record (nothing to write) and no second Event
    assert decide(held, DOWN, 999) == CanaryPlan(False, 3, 1, held, None)


def test_a_gap_past_the_bound_takes_the_canary_back_on_no_data() -> None:
    held = decide(ANALYZING, DOWN, 700).status
    assert held is not None
    plan = decide(held, DOWN, 1000)
    assert plan.main_runs_candidate is False and plan.canary_replicas == 0
    assert plan.main_replicas == 4  # the stable template on every replica again
    assert plan.status is not None
    assert (plan.status.phase, plan.status.failed_signal) == ("Failed", "noData")
    assert plan.status.finished_at == parse_time("2026-11-23T10:16:40Z")
    assert plan.status.message == (
        "noData: no data for the canary pods since 2026-11-23T10:11:40Z (Prometheus did not "
        "answer: http://prometheus:9090/api/v1/query?...: Connection refused); taken back "
        "after 300s rather than promoted unwatched"
    )
    assert plan.event == CanaryEvent("Warning", "CanaryFailed", plan.status.message)
    # a failed template is never retried
    assert decide(plan.status, SCRAPED, 2000).status == plan.status


def test_data_after_a_gap_restarts_the_clean_clock() -> None:
    watched = decide(ANALYZING, SCRAPED, 10).status
    assert watched is not None
    held = decide(watched, DOWN, 500).status
    assert held is not None and held.data_since is None
    resumed = decide(held, SCRAPED, 700)
    assert resumed.status is not None
    assert resumed.status.data_since == parse_time("2026-11-23T10:11:40Z")
    assert resumed.status.data_missing_since is None
    assert resumed.status.message == (
        "1 canary pod(s) run the new template for 600s, counted from 2026-11-23T10:11:40Z: "
        "data resumed"
    )
    assert decide(resumed.status, SCRAPED, 1299).status == resumed.status
    promoted = decide(resumed.status, SCRAPED, 1300).status
    assert promoted is not None and promoted.phase == "Promoted"


def test_a_ready_canary_pod_prometheus_does_not_scrape_has_no_data() -> None:
    other = CanaryData(scraped_pods=frozenset({"qwen-canary-7d9f-zzzzz"}))
    plan = decide(ANALYZING, other, 60)
    assert plan.status is not None and plan.status.data_missing_since == parse_time(
        "2026-11-23T10:01:00Z"
    )
    assert plan.status.message.startswith(
        f"holding: Prometheus has no successful scrape of canary pod(s) {POD};"
    )


def test_no_clock_runs_before_the_canary_pods_are_ready() -> None:
    starting = CanaryPod(POD, is_ready=False, restarts=0, oom_terminations=0)
    assert decide(ANALYZING, DOWN, 5000, pods=(starting,)).status == ANALYZING


def test_without_a_prometheus_url_the_analysis_is_as_before() -> None:
    promoted = decide(ANALYZING, None, 600).status
    assert promoted is not None and promoted.phase == "Promoted"


def test_track_data_writes_only_on_a_change() -> None:
    watched, missing = track_data(ANALYZING, SCRAPED, [POD], T0)
    assert missing is None and watched.data_since == T0
    assert track_data(watched, SCRAPED, [POD], T0 + timedelta(seconds=9)) == (watched, None)


def test_the_query_selects_the_canary_pods_of_one_server() -> None:
    assert canary_up_query("team", "qwen", "qwen-canary-") == (
        'max by (pod) (up{namespace="team",llmserver="qwen",pod=~"qwen-canary-.+"})'
    )


@pytest.fixture
def prometheus_answer() -> Iterator[tuple[str, list[object]]]:
    """A stand-in for Prometheus's query API over HTTP; the test sets its vector."""
    result: list[object] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(
                {"status": "success", "data": {"resultType": "vector", "result": result}}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", result
    finally:
        server.shutdown()
        server.server_close()


def test_observe_reads_successful_scrapes_and_turns_errors_into_data(
    prometheus_answer: tuple[str, list[object]],
) -> None:
    url, result = prometheus_answer
    result.extend(
        [
            {"metric": {"pod": POD}, "value": [0, "1"]},
            {"metric": {"pod": "qwen-canary-7d9f-down0"}, "value": [0, "0"]},
        ]
    )
    assert observe_canary_data(url, "team", "qwen", "qwen-canary-") == SCRAPED
    gone = observe_canary_data("http://127.0.0.1:9", "team", "qwen", "qwen-canary-")
    assert gone.scraped_pods == frozenset() and gone.error is not None
    assert gone.missing([POD]) is not None


def test_two_reconciles_of_one_gap_name_its_event_alike_and_a_later_gap_anew() -> None:
    """A resync and a handler racing over the same stored record start the gap at their own
    times, so their messages differ; the transition they post is the same one."""
    first = decide(ANALYZING, DOWN, 700).event
    racing = decide(ANALYZING, DOWN, 703).event
    assert first is not None and racing is not None and first.message != racing.message
    assert first.key == racing.key == "?|new|2026-11-23T10:00:00Z|Analyzing"  # no data yet
    # Data comes back, then a second gap: a new transition, named by the stretch that ended.
    watched = decide(ANALYZING, SCRAPED, 10).status
    assert watched is not None
    held = decide(watched, DOWN, 500).status
    assert held is not None
    resumed = decide(held, SCRAPED, 700).status
    assert resumed is not None
    again = decide(resumed, DOWN, 800).event
    assert (
        again is not None and again.key == "2026-11-23T10:11:40Z|new|2026-11-23T10:00:00Z|Analyzing"
    )
