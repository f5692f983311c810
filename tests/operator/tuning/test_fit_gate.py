"""Apply mode meets the memory plan's gate, through `reconcile` over an in-memory Kubernetes:
a trial whose candidate does not fit the GPUs starts no canary and ends at once, with its
reason in status and an Event, and the field held off; the running policy still fits."""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.controllers.reconcile import reconcile
from tests.operator.servers import DEFAULT_IMAGES, merge, server_body
from tests.operator.test_reconcile_fit import H100, MemoryKube

# Fits four H100s at 0.6 of each; a 12Gi fragmentation buffer leaves the KV cache too small
# for one maxModelLen sequence.
SPEC: dict[str, Any] = {
    "model": {"source": "/models/Llama-3.1-70B-Instruct"},
    "replicas": 2,
    "parallelism": {"tensor": 4},
    "memoryPolicy": {"maxModelLen": 32768, "gpuMemoryUtilization": 0.6},
    "rollout": {"canary": {"enabled": True, "replicas": 1}},
    "tuning": {"mode": "Apply", "windowSeconds": 600, "holdOffSeconds": 3600},
}
BIG_BUFFER = {
    "field": "fragmentationBuffer", "current": "auto", "proposed": "12Gi",
    "rule": "fragmentation-buffer", "expectedEffect": "fewer OOMs", "confidence": 0.8,
    "since": "2026-11-29T00:59:00Z",
}  # fmt: skip
NO_CANARY = ("apps/v1", "Deployment", "qwen-canary")


def running(kube: MemoryKube) -> tuple[dict[str, Any], dict[str, Any]]:
    """The server reconciled once (a Deployment runs), and the status it then has."""
    result = reconcile(kube, _server({}), DEFAULT_IMAGES, now="2026-11-29T01:00:00Z")  # type: ignore[arg-type]
    assert result.status_patch["memoryPlan"]["state"] == "Fits"
    return kube.objects[("apps/v1", "Deployment", "qwen")], result.status_patch


def _server(status: dict[str, Any]) -> LLMServer:
    return LLMServer.from_body(server_body(SPEC, status=status))


def _fits(patch: dict[str, Any], kube: MemoryKube) -> None:
    """The running policy still fits: no PolicyDoesNotFit, no plan of the candidate."""
    if "conditions" in patch:
        fits = next(c for c in patch["conditions"] if c["type"] == "PolicyFits")
        assert fits["status"] == "True", fits
    assert patch.get("memoryPlan", {}).get("state", "Fits") == "Fits"
    assert "PolicyDoesNotFit" not in [e["reason"] for e in kube.events]


def test_a_recommendation_that_does_not_fit_is_skipped_not_tried_on_a_canary() -> None:
    kube = MemoryKube([H100])
    deployment, status = running(kube)
    kube.events.clear()
    with_rec = _server({**status, "recommendations": [BIG_BUFFER]})
    result = reconcile(kube, with_rec, DEFAULT_IMAGES, now="2026-11-29T01:01:00Z")  # type: ignore[arg-type]
    tuning = result.status_patch["tuning"]
    assert tuning.get("trial") is None and tuning.get("changesToday", 0) == 0
    [record] = tuning["history"]
    assert (record["field"], record["outcome"]) == ("fragmentationBuffer", "Skipped")
    assert record["message"].startswith(
        "fragmentationBuffer auto -> 12Gi (fragmentation-buffer) skipped: the candidate does not "
        "fit (the KV cache gets"
    )
    assert tuning["holdOffs"] == [
        {"field": "fragmentationBuffer", "value": "auto", "until": "2026-11-29T02:01:00Z"}
    ]
    assert [(e["type"], e["reason"]) for e in kube.events] == [("Warning", "TuningTrialSkipped")]
    assert NO_CANARY not in kube.objects
    assert kube.objects[("apps/v1", "Deployment", "qwen")]["spec"] == deployment["spec"]
    _fits(result.status_patch, kube)


def test_a_trial_under_way_whose_candidate_does_not_fit_ends_at_once() -> None:
    kube = MemoryKube([H100])
    deployment, status = running(kube)
    kube.events.clear()
    trial = {key: BIG_BUFFER[key] for key in ("field", "current", "proposed", "rule")}
    trying = {**trial, "startedAt": "2026-11-29T01:00:30Z"}
    server = _server({**status, "tuning": {"trial": trying, "day": "2026-11-29",
                                           "changesToday": 1}})  # fmt: skip
    result = reconcile(kube, server, DEFAULT_IMAGES, now="2026-11-29T01:01:00Z")  # type: ignore[arg-type]
    tuning = result.status_patch["tuning"]
    assert tuning.get("trial") is None
    [record] = tuning["history"]
    assert record["outcome"] == "RolledBack"
    assert "rolled back: the candidate does not fit (the KV cache gets" in record["message"]
    assert [h["field"] for h in tuning["holdOffs"]] == ["fragmentationBuffer"]
    assert [(e["type"], e["reason"]) for e in kube.events] == [("Warning", "TuningRolledBack")]
    assert NO_CANARY not in kube.objects
    assert kube.objects[("apps/v1", "Deployment", "qwen")]["spec"] == deployment["spec"]
    _fits(result.status_patch, kube)


def test_recommend_mode_lists_only_what_fits_and_says_why_it_dropped_the_rest() -> None:
    """In Recommend mode nothing is tried, and a recommendation that would only hold the
    rollout if accepted is not listed: status.tuning.dropped gives the plan's reason."""
    kube = MemoryKube([H100])
    deployment, status = running(kube)
    kube.events.clear()
    caching_off = {
        **BIG_BUFFER, "field": "enablePrefixCaching", "current": "true", "proposed": "false",
        "rule": "prefix-caching-off",
    }  # fmt: skip
    recommend = {**SPEC, "tuning": {**SPEC["tuning"], "mode": "Recommend"}}
    server = LLMServer.from_body(
        server_body(recommend, status={**status, "recommendations": [BIG_BUFFER, caching_off]})
    )
    result = reconcile(kube, server, DEFAULT_IMAGES, now="2026-11-29T01:01:00Z")  # type: ignore[arg-type]
    [listed] = result.status_patch["recommendations"]
    assert listed["field"] == "enablePrefixCaching"
    [dropped] = result.status_patch["tuning"]["dropped"]
    assert (dropped["field"], dropped["proposed"], dropped["rule"]) == (
        "fragmentationBuffer", "12Gi", "fragmentation-buffer",
    )  # fmt: skip
    assert dropped["reason"].startswith("the KV cache gets"), dropped
    assert [(e["type"], e["reason"]) for e in kube.events] == [
        ("Warning", "TuningRecommendationDropped")
    ]
    assert "trial" not in result.status_patch["tuning"]
    assert NO_CANARY not in kube.objects
    assert kube.objects[("apps/v1", "Deployment", "qwen")]["spec"] == deployment["spec"]
    _fits(result.status_patch, kube)
    # the plan's verdict is recomputed each reconcile: the same status writes nothing more
    again = LLMServer.from_body(server_body(recommend, status=merge(status, result.status_patch)))
    later = reconcile(kube, again, DEFAULT_IMAGES, now="2026-11-29T01:02:00Z")  # type: ignore[arg-type]
    assert "recommendations" not in later.status_patch
    assert "tuning" not in later.status_patch
