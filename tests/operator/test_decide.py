"""The pure remediation decision: each check, its boundary, and how a batch's decisions interact."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pagekeeper_operator.api.remediation import RemediationSpec
from pagekeeper_operator.api.runtime import Runtime
from pagekeeper_operator.remediation.decide import (
    Decision,
    Memory,
    PodState,
    ServerState,
    SkipReason,
    Snapshot,
    Verdict,
    decide,
    num_unavailable,
)
from pagekeeper_operator.remediation.payload import WebhookAlert

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
NS = "prod"
KV = "PagekeeperKVCacheSaturated"


def alert(
    pod: str = "chat-a",
    name: str = KV,
    *,
    status: str = "firing",
    fingerprint: str | None = None,
    age: timedelta = timedelta(minutes=5),
    labels: dict[str, str] | None = None,
) -> WebhookAlert:
    return WebhookAlert.model_validate(
        {
            "status": status,
            "labels": labels
            if labels is not None
            else {"alertname": name, "namespace": NS, "pod": pod, "llmserver": "chat"},
            "startsAt": (NOW - age).isoformat(),
            "endsAt": "0001-01-01T00:00:00Z",
            "fingerprint": fingerprint or f"fp-{pod}-{name}",
        }
    )


def pod(name: str, *, is_ready: bool = True, is_terminating: bool = False) -> PodState:
    return PodState(name, NS, "chat", is_ready=is_ready, is_terminating=is_terminating)


def snapshot(
    pods: list[PodState] | None = None,
    *,
    num_desired: int | None = None,
    memory: Memory | None = None,
    extra_pods: list[PodState] | None = None,
    runtime: Runtime = "pagekeeper",
    has_plugin: bool = True,
    **spec: Any,
) -> Snapshot:
    pods = pods if pods is not None else [pod("chat-a"), pod("chat-b"), pod("chat-c")]
    server = ServerState(
        NS,
        "chat",
        RemediationSpec.model_validate(spec),
        len(pods) if num_desired is None else num_desired,
        tuple(pods),
        runtime,
        has_plugin,
    )
    everything = pods + (extra_pods or [])
    return Snapshot(
        pods={(p.namespace, p.name): p for p in everything},
        servers={(NS, "chat"): server},
        memory=memory or Memory(),
    )


def verdicts(decisions: list[Decision]) -> list[tuple[str, Verdict, SkipReason | None]]:
    return [(d.pod, d.verdict, d.reason) for d in decisions]


def test_evicts_the_alerted_pod() -> None:
    [decision] = decide([alert("chat-b")], snapshot(), NOW)
    assert decision == Decision(
        verdict=Verdict.EVICT,
        alert=KV,
        key=("fp-chat-b-" + KV, NOW - timedelta(minutes=5)),
        namespace=NS,
        pod="chat-b",
        server="chat",
        reason=None,
        message=f"evicting prod/chat-b for {KV}",
    )
    assert not decision.is_retryable


def test_hysteresis_defers_until_the_alert_has_fired_long_enough() -> None:
    young = decide([alert(age=timedelta(seconds=59))], snapshot(hysteresisSeconds=60), NOW)
    assert verdicts(young) == [("chat-a", Verdict.SKIP, SkipReason.HYSTERESIS)]
    assert young[0].is_retryable
    exactly = decide([alert(age=timedelta(seconds=60))], snapshot(hysteresisSeconds=60), NOW)
    assert verdicts(exactly) == [("chat-a", Verdict.EVICT, None)]


def test_cooldown_after_an_action_on_the_same_server() -> None:
    def at(seconds_ago: int) -> list[Decision]:
        memory = Memory(last_action_at={(NS, "chat"): NOW - timedelta(seconds=seconds_ago)})
        return decide([alert()], snapshot(memory=memory, cooldownSeconds=600), NOW)

    assert verdicts(at(599)) == [("chat-a", Verdict.SKIP, SkipReason.COOLDOWN)]
    assert at(599)[0].is_retryable
    assert verdicts(at(600)) == [("chat-a", Verdict.EVICT, None)]


def test_cooldown_is_per_server() -> None:
    memory = Memory(last_action_at={(NS, "other"): NOW})
    assert verdicts(decide([alert()], snapshot(memory=memory), NOW)) == [
        ("chat-a", Verdict.EVICT, None)
    ]


def test_one_eviction_per_batch_then_cooldown() -> None:
    alerts = [alert("chat-c", age=timedelta(minutes=1)), alert("chat-a", age=timedelta(minutes=9))]
    # The longest-firing alert acts first, whatever the delivery order.
    assert verdicts(decide(alerts, snapshot(), NOW)) == [
        ("chat-a", Verdict.EVICT, None),
        ("chat-c", Verdict.SKIP, SkipReason.COOLDOWN),
    ]


def test_max_unavailable_counts_evictions_of_this_batch() -> None:
    alerts = [alert("chat-a"), alert("chat-b", age=timedelta(minutes=4))]
    one = decide(alerts, snapshot(cooldownSeconds=0, maxUnavailable=1), NOW)
    assert verdicts(one) == [
        ("chat-a", Verdict.EVICT, None),
        ("chat-b", Verdict.SKIP, SkipReason.MAX_UNAVAILABLE),
    ]
    assert one[1].message == "1 of 3 pods unavailable; maxUnavailable is 1"
    two = decide(alerts, snapshot(cooldownSeconds=0, maxUnavailable=2), NOW)
    assert verdicts(two) == [("chat-a", Verdict.EVICT, None), ("chat-b", Verdict.EVICT, None)]


def test_max_unavailable_counts_unready_missing_and_evicting_pods() -> None:
    unready = snapshot([pod("chat-a"), pod("chat-b", is_ready=False), pod("chat-c")])
    assert verdicts(decide([alert("chat-a")], unready, NOW)) == [
        ("chat-a", Verdict.SKIP, SkipReason.MAX_UNAVAILABLE)
    ]
    # Evicting the pod that is already down costs no availability.
    assert verdicts(decide([alert("chat-b")], unready, NOW)) == [("chat-b", Verdict.EVICT, None)]
    # Three desired, two exist: the replacement of an evicted pod is not there yet.
    missing = snapshot([pod("chat-a"), pod("chat-b")], num_desired=3)
    assert verdicts(decide([alert("chat-a")], missing, NOW)) == [
        ("chat-a", Verdict.SKIP, SkipReason.MAX_UNAVAILABLE)
    ]
    evicting = snapshot(memory=Memory(evicting={(NS, "chat"): frozenset({"chat-c"})}))
    assert verdicts(decide([alert("chat-a")], evicting, NOW)) == [
        ("chat-a", Verdict.SKIP, SkipReason.MAX_UNAVAILABLE)
    ]


def test_num_unavailable() -> None:
    server = ServerState(
        NS,
        "chat",
        RemediationSpec(),
        4,
        (pod("a"), pod("b", is_ready=False), pod("c", is_terminating=True)),
        "pagekeeper",
    )
    # b (not ready), c (terminating) and the fourth that does not exist; then a, evicting.
    assert num_unavailable(server, frozenset()) == 3
    assert num_unavailable(server, frozenset({"a"})) == 4


def test_pod_already_going_away() -> None:
    terminating = snapshot([pod("chat-a", is_terminating=True), pod("chat-b")])
    evicting = snapshot(memory=Memory(evicting={(NS, "chat"): frozenset({"chat-a"})}))
    for snap in (terminating, evicting):
        [decision] = decide([alert("chat-a")], snap, NOW)
        assert (decision.verdict, decision.reason) == (Verdict.SKIP, SkipReason.POD_GOING_AWAY)
        assert not decision.is_retryable


def test_alert_for_an_unknown_pod() -> None:
    [decision] = decide([alert("chat-gone")], snapshot(), NOW)
    assert (decision.verdict, decision.reason, decision.server) == (
        Verdict.SKIP,
        SkipReason.UNKNOWN_POD,
        None,
    )
    assert decision.message == "no pod prod/chat-gone"
    assert not decision.is_retryable


def test_pod_not_owned_by_an_llmserver() -> None:
    stray = PodState("stray", NS, None, is_ready=True, is_terminating=False)
    orphan = PodState("orphan", NS, "deleted-server", is_ready=True, is_terminating=False)
    decisions = decide([alert("stray"), alert("orphan")], snapshot(extra_pods=[stray, orphan]), NOW)
    assert verdicts(decisions) == [
        ("orphan", Verdict.SKIP, SkipReason.NOT_OWNED),
        ("stray", Verdict.SKIP, SkipReason.NOT_OWNED),
    ]


def test_duplicate_delivery_is_ignored() -> None:
    first = alert()
    acted = Memory(acted_keys=frozenset({first.key}))
    assert verdicts(decide([first], snapshot(memory=acted), NOW)) == [
        ("chat-a", Verdict.SKIP, SkipReason.DUPLICATE)
    ]
    # The same alert twice in one notification acts once.
    assert verdicts(decide([first, first], snapshot(cooldownSeconds=0), NOW)) == [
        ("chat-a", Verdict.EVICT, None),
        ("chat-a", Verdict.SKIP, SkipReason.DUPLICATE),
    ]
    # A new firing of the same alert (new startsAt) is not a duplicate.
    again = alert(age=timedelta(minutes=2))
    assert verdicts(decide([again], snapshot(memory=acted), NOW)) == [
        ("chat-a", Verdict.EVICT, None)
    ]


def test_resolved_delivery_does_nothing() -> None:
    [decision] = decide([alert(status="resolved")], snapshot(), NOW)
    assert (decision.verdict, decision.reason) == (Verdict.SKIP, SkipReason.RESOLVED)
    assert not decision.is_retryable


def test_remediation_or_trigger_disabled() -> None:
    assert verdicts(decide([alert()], snapshot(enabled=False), NOW)) == [
        ("chat-a", Verdict.SKIP, SkipReason.DISABLED)
    ]
    off: dict[str, Any] = {"triggers": {"kvCacheSaturation": {"enabled": False}}}
    assert verdicts(decide([alert()], snapshot(**off), NOW)) == [
        ("chat-a", Verdict.SKIP, SkipReason.TRIGGER_DISABLED)
    ]
    # Another trigger of the same server still acts.
    assert verdicts(decide([alert(name="PagekeeperEngineStalled")], snapshot(**off), NOW)) == [
        ("chat-a", Verdict.EVICT, None)
    ]


def test_an_alert_the_runtime_cannot_feed_is_not_acted_on() -> None:
    # Under vllm with VLLM_PLUGINS leaving pagekeeper's plugin out no fragmentation alert is
    # rendered; a stray one (an old rule) is skipped.
    stray = alert(name="PagekeeperFragmentationHigh")
    unplugged = snapshot(runtime="vllm", has_plugin=False)
    assert verdicts(decide([stray], unplugged, NOW)) == [
        ("chat-a", Verdict.SKIP, SkipReason.TRIGGER_DISABLED)
    ]
    assert verdicts(decide([alert()], unplugged, NOW)) == [("chat-a", Verdict.EVICT, None)]
    # With the plugin (the default) the same alert evicts that pod, as under the paged engine.
    assert verdicts(decide([stray], snapshot(runtime="vllm"), NOW)) == [
        ("chat-a", Verdict.EVICT, None)
    ]
    assert verdicts(decide([stray], snapshot(), NOW)) == [("chat-a", Verdict.EVICT, None)]


def test_alerts_that_are_not_ours() -> None:
    foreign = alert(name="KubePodCrashLooping")
    no_pod = alert(labels={"alertname": KV, "namespace": NS})
    assert verdicts(decide([foreign, no_pod], snapshot(), NOW)) == [
        ("chat-a", Verdict.SKIP, SkipReason.UNKNOWN_ALERT),
        ("", Verdict.SKIP, SkipReason.UNKNOWN_ALERT),
    ]


def test_dry_run_records_what_it_would_do_and_still_cools_down() -> None:
    alerts = [alert("chat-a"), alert("chat-b", age=timedelta(minutes=1))]
    decisions = decide(alerts, snapshot(dryRun=True), NOW)
    assert verdicts(decisions) == [
        ("chat-a", Verdict.DRY_RUN, None),
        ("chat-b", Verdict.SKIP, SkipReason.COOLDOWN),
    ]
    assert decisions[0].message == f"dry run: would evict prod/chat-a for {KV}"
