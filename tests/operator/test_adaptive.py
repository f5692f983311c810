"""Classifying OOM terminations and stepping the effective policy down, exactly."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from pagekeeper_engine.stuck import StuckReport
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.remediation import AdaptiveSpec
from pagekeeper_operator.policy.adaptive import (
    TERMINATION_MESSAGE_FORMAT,
    OOMClassification,
    StuckClassification,
    Termination,
    classify_failure,
    classify_termination,
    quantity_text,
    step_down,
    step_down_host,
)
from pagekeeper_operator.policy.effective import compose
from pagekeeper_operator.remediation.oom import (
    NO_HOST_TIER,
    oom_terminations,
    respond_to_oom,
    termination_key,
)

ADAPTIVE = AdaptiveSpec()


@pytest.mark.parametrize(
    ("reason", "message", "expected"),
    [
        (
            "Error",
            "pagekeeper-oom kind=gpu phase=runtime detail=step of 8192 tokens failed 3 times",
            OOMClassification("gpu", "runtime", "step of 8192 tokens failed 3 times"),
        ),
        (
            "Error",
            "loading weights\npagekeeper-oom kind=gpu phase=startup detail=KV cache < 1 request",
            OOMClassification("gpu", "startup", "KV cache < 1 request"),
        ),
        (
            "Error",
            "pagekeeper-oom kind=host phase=runtime",
            OOMClassification("host", "runtime", ""),
        ),
        (
            "OOMKilled",
            None,
            OOMClassification("host", "unknown", "the container exceeded its memory limit"),
        ),
        # The engine's own classification wins over the kubelet's reason.
        (
            "OOMKilled",
            "pagekeeper-oom kind=gpu phase=runtime detail=x",
            OOMClassification("gpu", "runtime", "x"),
        ),
        ("Error", "Traceback ...\nRuntimeError: CUDA error", None),
        ("Completed", "", None),
        ("Error", "pagekeeper-oom kind=tpu phase=runtime detail=x", None),
        ("Error", "not pagekeeper-oom kind=gpu phase=runtime", None),
        (None, None, None),
    ],
)
def test_classify_termination(
    reason: str | None, message: str | None, expected: OOMClassification | None
) -> None:
    assert classify_termination(reason, message) == expected


def test_format_constant_matches_the_parser() -> None:
    example = TERMINATION_MESSAGE_FORMAT.replace("<gpu|host>", "gpu")
    example = example.replace("<startup|runtime>", "runtime").replace(
        "<free text to end of line>", "d"
    )
    assert classify_termination("Error", example) == OOMClassification("gpu", "runtime", "d")


def test_classification_names() -> None:
    runtime = OOMClassification("gpu", "runtime", "")
    assert (runtime.label, runtime.condition_reason, runtime.can_step_down) == (
        "gpu-runtime",
        "GPUOutOfMemoryAtRuntime",
        True,
    )
    startup = OOMClassification("gpu", "startup", "")
    assert (startup.condition_reason, startup.can_step_down) == ("GPUOutOfMemoryAtStartup", False)
    host = OOMClassification("host", "unknown", "")
    assert (host.label, host.condition_reason, host.can_step_down) == (
        "host-unknown",
        "HostOutOfMemory",
        True,
    )
    # The host tier is pinned at start-up: a host OOM there shrinks it too.
    assert OOMClassification("host", "startup", "").can_step_down is True


def policy(**overrides: Any) -> dict[str, Any]:
    return {
        "gpuMemoryUtilization": 0.9,
        "maxNumBatchedTokens": 8192,
        "maxNumSeqs": 256,
        "enableChunkedPrefill": True,
        **overrides,
    }


def test_steps_utilization_then_tokens_down_to_the_floors() -> None:
    current = policy()
    steps = []
    while (step := step_down(current, ADAPTIVE)) is not None:
        current, _ = step
        steps.append((current["gpuMemoryUtilization"], current["maxNumBatchedTokens"]))
    assert steps == [
        (0.85, 8192),
        (0.8, 8192),
        (0.75, 8192),
        (0.7, 8192),
        (0.7, 4096),
        (0.7, 2048),
    ]
    assert current["maxNumSeqs"] == 256


def test_step_reasons() -> None:
    first = step_down(policy(), ADAPTIVE)
    assert first is not None
    assert first[1] == (
        "gpuMemoryUtilization 0.9 -> 0.85 after a run-time GPU out-of-memory crash (floor 0.7)"
    )
    at_floor = step_down(policy(gpuMemoryUtilization=0.7), ADAPTIVE)
    assert at_floor is not None
    assert at_floor[1] == (
        "maxNumBatchedTokens 8192 -> 4096 after a run-time GPU out-of-memory crash "
        "(gpuMemoryUtilization at its floor 0.7; token floor 2048)"
    )


def test_never_below_the_floors() -> None:
    # A step larger than the distance to the floor lands on the floor.
    step = step_down(policy(gpuMemoryUtilization=0.72), ADAPTIVE)
    assert step is not None and step[0]["gpuMemoryUtilization"] == 0.7
    step = step_down(policy(gpuMemoryUtilization=0.7, maxNumBatchedTokens=3000), ADAPTIVE)
    assert step is not None and step[0]["maxNumBatchedTokens"] == 2048
    # Below the floor already (the spec asked for less): utilization is left alone.
    step = step_down(policy(gpuMemoryUtilization=0.5), ADAPTIVE)
    assert step is not None and step[0]["gpuMemoryUtilization"] == 0.5
    assert step[0]["maxNumBatchedTokens"] == 4096
    assert step_down(policy(gpuMemoryUtilization=0.7, maxNumBatchedTokens=2048), ADAPTIVE) is None


def test_token_floor_respects_the_policy_rules() -> None:
    # maxNumSeqs <= maxNumBatchedTokens, and without chunked prefill maxModelLen must fit.
    seqs = step_down(policy(gpuMemoryUtilization=0.7, maxNumSeqs=6000), ADAPTIVE)
    assert seqs is not None and seqs[0]["maxNumBatchedTokens"] == 6000
    unchunked = policy(gpuMemoryUtilization=0.7, enableChunkedPrefill=False, maxModelLen=8192)
    assert step_down(unchunked, ADAPTIVE) is None
    chunked = step_down({**unchunked, "enableChunkedPrefill": True}, ADAPTIVE)
    assert chunked is not None and chunked[0]["maxNumBatchedTokens"] == 4096


def test_a_kv_byte_budget_steps_the_tokens_at_once() -> None:
    budget = {k: v for k, v in policy().items() if k != "gpuMemoryUtilization"}
    step = step_down({**budget, "kvCacheMemory": "20Gi"}, ADAPTIVE)
    assert step is not None
    assert "gpuMemoryUtilization" not in step[0] and step[0]["maxNumBatchedTokens"] == 4096
    assert step[1] == (
        "maxNumBatchedTokens 8192 -> 4096 after a run-time GPU out-of-memory crash "
        "(a kvCacheMemory budget; token floor 2048)"
    )


def test_disabled_adaptive_never_steps() -> None:
    assert step_down(policy(), AdaptiveSpec(enabled=False)) is None


def server_body(status: dict[str, Any] | None = None, **remediation: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagekeeper.dev/v1alpha1",
        "kind": "LLMServer",
        "metadata": {"name": "chat", "namespace": "prod", "generation": 3, "uid": "u-1"},
        "spec": {
            "model": {"source": "/models/qwen3-0.6b"},
            "memoryPolicy": {"gpuMemoryUtilization": 0.9, "maxNumBatchedTokens": 8192},
            "remediation": remediation,
        },
        "status": status or {},
    }


NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
GPU_RUNTIME = OOMClassification("gpu", "runtime", "step failed")


def test_oom_response_steps_down_in_status_and_records_it() -> None:
    response = respond_to_oom(
        server_body(), "chat-a", GPU_RUNTIME, "k1", "2026-03-01T11:59:00Z", NOW
    )
    assert response is not None
    status = response.status
    assert status["effectiveMemoryPolicy"]["gpuMemoryUtilization"] == 0.85
    assert status["effectiveMemoryPolicy"]["maxNumBatchedTokens"] == 8192
    assert len(status["specMemoryPolicyHash"]) == 16
    assert status["lastRemediation"] == "2026-03-01T12:00:00Z"
    assert status["lastOutOfMemory"] == "2026-03-01T12:00:00Z"
    assert status["remediationHistory"] == [
        {
            "time": "2026-03-01T12:00:00Z",
            "pod": "chat-a",
            "alert": "gpu-runtime",
            "action": "step-down",
            "outcome": "applied",
            "message": "GPUOutOfMemoryAtRuntime: step failed; gpuMemoryUtilization 0.9 -> 0.85 "
            "after a run-time GPU out-of-memory crash (floor 0.7)",
            "fingerprint": "k1",
            "alertStartsAt": "2026-03-01T11:59:00Z",
        }
    ]
    assert status["conditions"] == [
        {
            "type": "MemoryHealthy",
            "status": "False",
            "reason": "GPUOutOfMemoryAtRuntime",
            "message": "pod chat-a: step failed",
            "lastTransitionTime": "2026-03-01T12:00:00Z",
            "observedGeneration": 3,
        }
    ]
    assert (response.event_type, response.event_reason) == ("Normal", "PolicySteppedDown")
    # Recorded once: the same termination seen again (or after a restart) writes nothing.
    again = server_body({"remediationHistory": status["remediationHistory"]})
    assert respond_to_oom(again, "chat-a", GPU_RUNTIME, "k1", "x", NOW) is None


def test_oom_response_without_step_down() -> None:
    startup = OOMClassification("gpu", "startup", "")
    response = respond_to_oom(server_body(), "chat-a", startup, "k2", "t", NOW)
    assert response is not None
    assert "effectiveMemoryPolicy" not in response.status
    # Every OOM counts for MemoryHealthy, whether or not it steps the policy down.
    assert response.status["lastOutOfMemory"] == "2026-03-01T12:00:00Z"
    assert response.record.outcome == "not-applicable"
    assert (response.event_type, response.event_reason) == ("Warning", "GPUOutOfMemoryAtStartup")

    dry = respond_to_oom(server_body(dryRun=True), "chat-a", GPU_RUNTIME, "k3", "t", NOW)
    assert dry is not None and "effectiveMemoryPolicy" not in dry.status
    assert dry.record.outcome == "would-apply"

    off = respond_to_oom(
        server_body(adaptive={"enabled": False}), "chat-a", GPU_RUNTIME, "k4", "t", NOW
    )
    assert off is not None and off.record.outcome == "disabled"


def test_a_tuning_trials_canary_pod_running_out_of_memory_steps_nothing_down() -> None:
    trial = {"field": "gpuMemoryUtilization", "current": "0.9", "proposed": "0.95",
             "rule": "utilization-up", "startedAt": "2026-03-01T11:00:00Z"}  # fmt: skip
    body = server_body({"tuning": {"trial": trial}})
    response = respond_to_oom(body, "chat-canary-5d9f-x2", GPU_RUNTIME, "k5", "t", NOW)
    assert response is not None and "effectiveMemoryPolicy" not in response.status
    assert response.record.outcome == "not-applicable"
    assert response.record.message == (
        "GPUOutOfMemoryAtRuntime: step failed; a canary pod of the tuning trial "
        "gpuMemoryUtilization 0.9 -> 0.95 ran out of memory: the trial is rolled back, the "
        "policy the other pods run is not stepped down"
    )
    assert response.status["lastOutOfMemory"] == "2026-03-01T12:00:00Z"  # still an OOM
    # A baseline pod of the same trial, or a canary pod with no trial (a person's change
    # rolling out, whose template is the policy in force): stepped down as ever.
    stable = respond_to_oom(body, "chat-5d9f-x2", GPU_RUNTIME, "k6", "t", NOW)
    assert stable is not None and stable.record.outcome == "applied"
    plain = respond_to_oom(server_body(), "chat-canary-5d9f-x2", GPU_RUNTIME, "k7", "t", NOW)
    assert plain is not None and plain.record.outcome == "applied"


def test_oom_terminations_of_a_pod() -> None:
    oom = {"reason": "OOMKilled", "finishedAt": "2026-03-01T11:00:00Z", "exitCode": 137}
    pod = {
        "status": {
            "containerStatuses": [
                {"name": "engine", "state": {"running": {}}, "lastState": {"terminated": oom}},
                {"name": "sidecar", "state": {"terminated": {"reason": "Completed"}}},
                {"name": "down", "state": {"terminated": oom}, "lastState": {"terminated": oom}},
            ]
        }
    }
    host = OOMClassification("host", "unknown", "the container exceeded its memory limit")
    assert oom_terminations(pod) == [
        ("engine", host, "2026-03-01T11:00:00Z"),
        ("down", host, "2026-03-01T11:00:00Z"),
    ]
    assert termination_key("u", "engine", "t") != termination_key("u", "engine", "t2")
    assert len(termination_key("u", "engine", "t")) == 16


STUCK_LINE = (
    "pagekeeper-stuck last_step_age_s=61.5 running=3 waiting=12 detail=no step completed while "
    "requests waited"
)
STUCK = StuckClassification(61.5, 3, 12, "no step completed while requests waited")


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (STUCK_LINE, STUCK),
        (f"Traceback ...\n{STUCK_LINE}\n", STUCK),
        # vLLM printed an OOM before its probe found it stuck: memory still steps down.
        (
            f"pagekeeper-oom kind=gpu phase=runtime detail=x\n{STUCK_LINE}",
            OOMClassification("gpu", "runtime", "x"),
        ),
        ("pagekeeper-stuck last_step_age_s=soon running=1 waiting=0 detail=x", None),
        ("Error: engine ended", None),
    ],
)
def test_a_stuck_line_classifies_as_stuck_and_an_oom_line_wins(
    message: str, expected: Termination | None
) -> None:
    assert classify_failure("Error", message) == expected


def test_the_stuck_line_the_engine_writes_is_the_one_the_operator_reads() -> None:
    report = StuckReport(61.5, 3, 12, "no step completed while requests waited")
    assert classify_failure("Error", report.message()) == STUCK


def test_a_stuck_termination_is_recorded_but_never_steps_memory_down() -> None:
    response = respond_to_oom(server_body(), "chat-a", STUCK, "k5", "2026-03-01T11:59:00Z", NOW)
    assert response is not None
    assert set(response.status) == {"remediationHistory"}  # no policy, no MemoryHealthy
    record = response.record
    assert (record.alert, record.action, record.outcome) == ("stuck", "step-down", "not-applicable")
    assert record.message.startswith("EngineStuck: no step completed while requests waited;")
    assert (response.event_type, response.event_reason) == ("Warning", "EngineStuck")
    again = server_body({"remediationHistory": response.status["remediationHistory"]})
    assert respond_to_oom(again, "chat-a", STUCK, "k5", "x", NOW) is None


def tiered(size: str = "48Gi") -> dict[str, Any]:
    return policy(enablePrefixCaching=True, kvOffload={"size": size, "backend": "native"})


def test_a_host_oom_halves_the_tier_to_its_floor_then_switches_it_off() -> None:
    sizes: list[str | None] = []
    current = tiered()
    while (step := step_down_host(current, ADAPTIVE)) is not None and current.get("kvOffload"):
        current = step[0]
        sizes.append(current["kvOffload"]["size"] if current["kvOffload"] else None)
        # Never a GPU term.
        assert {k: v for k, v in current.items() if k != "kvOffload"} == policy(
            enablePrefixCaching=True
        )
    assert sizes == ["24Gi", "12Gi", "6Gi", "3Gi", "1536Mi", None]
    assert step_down_host(current, ADAPTIVE) is None  # no tier: nothing of the host's to lower


def test_host_step_reasons_and_settings() -> None:
    assert step_down_host(tiered("10Gi"), ADAPTIVE) == (
        tiered("5Gi"),
        "kvOffload.size 10Gi -> 5Gi after a host out-of-memory kill (floor 1Gi, then off)",
    )
    off = step_down_host(tiered("1536Mi"), ADAPTIVE)
    assert off == (
        {**tiered(), "kvOffload": None},
        "kvOffload.size 1536Mi -> off after a host out-of-memory kill (the next step, 768Mi, "
        "is below minKvOffloadSize 1Gi)",
    )
    gentle = AdaptiveSpec.model_validate({"kvOffloadStep": 0.75, "minKvOffloadSize": "4Gi"})
    step = step_down_host(tiered("10Gi"), gentle)
    assert step is not None and step[0]["kvOffload"]["size"] == "7680Mi"
    assert step_down_host(tiered("5Gi"), gentle) == (
        {**tiered(), "kvOffload": None},
        "kvOffload.size 5Gi -> off after a host out-of-memory kill (the next step, 3840Mi, "
        "is below minKvOffloadSize 4Gi)",
    )
    assert step_down_host(tiered(), AdaptiveSpec(enabled=False)) is None
    assert [quantity_text(n) for n in (3 << 30, 768 << 20, 1000)] == ["3Gi", "768Mi", "1000"]


OOM_KILLED = OOMClassification("host", "unknown", "the container exceeded its memory limit")


def tiered_body(status: dict[str, Any] | None = None) -> dict[str, Any]:
    body = server_body(status)
    body["spec"]["memoryPolicy"]["kvOffload"] = {"size": "32Gi"}
    return body


def test_an_oom_kill_shrinks_the_host_tier_and_never_a_gpu_term() -> None:
    response = respond_to_oom(tiered_body(), "chat-a", OOM_KILLED, "h1", "2026-03-01T11:59Z", NOW)
    assert response is not None
    effective = response.status["effectiveMemoryPolicy"]
    assert effective["kvOffload"] == {"size": "16Gi", "backend": "native"}
    assert (effective["gpuMemoryUtilization"], effective["maxNumBatchedTokens"]) == (0.9, 8192)
    assert response.record.model_dump(by_alias=True, mode="json", exclude={"time"}) == {
        "pod": "chat-a",
        "alert": "host-unknown",
        "action": "step-down",
        "outcome": "applied",
        "message": "HostOutOfMemory: the container exceeded its memory limit; kvOffload.size "
        "32Gi -> 16Gi after a host out-of-memory kill (floor 1Gi, then off)",
        "fingerprint": "h1",
        "alertStartsAt": "2026-03-01T11:59:00Z",
    }
    assert response.status["conditions"][0]["reason"] == "HostOutOfMemory"
    assert (response.event_type, response.event_reason) == ("Normal", "PolicySteppedDown")
    # The stored step becomes an explicit cap of the effective policy, beside no GPU cap.
    body = tiered_body(response.status)
    layers = compose(LLMServer.from_body(body))
    assert layers.step_down is not None
    assert (
        layers.step_down.kv_offload_size,
        layers.step_down.gpu_memory_utilization,
        layers.step_down.max_num_batched_tokens,
    ) == ("16Gi", None, None)
    assert layers.policy.kv_offload is not None and layers.policy.kv_offload.size == "16Gi"
    # Recorded once.
    assert respond_to_oom(body, "chat-a", OOM_KILLED, "h1", "x", NOW) is None


def test_an_oom_kill_without_a_tier_is_recorded_and_steps_nothing() -> None:
    response = respond_to_oom(server_body(), "chat-a", OOM_KILLED, "h2", "t", NOW)
    assert response is not None
    assert "effectiveMemoryPolicy" not in response.status
    assert response.record.outcome == "not-applicable"
    assert response.record.message == (
        f"HostOutOfMemory: the container exceeded its memory limit; {NO_HOST_TIER}"
    )
    assert response.status["lastOutOfMemory"] == "2026-03-01T12:00:00Z"
    assert (response.event_type, response.event_reason) == ("Warning", "HostOutOfMemory")


def test_a_gpu_oom_never_touches_the_host_tier() -> None:
    response = respond_to_oom(tiered_body(), "chat-a", GPU_RUNTIME, "g1", "t", NOW)
    assert response is not None
    effective = response.status["effectiveMemoryPolicy"]
    assert effective["gpuMemoryUtilization"] == 0.85
    assert effective["kvOffload"] == {"size": "32Gi", "backend": "native"}
