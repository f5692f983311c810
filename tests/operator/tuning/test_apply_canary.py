"""Apply mode through the canary, reconcile by reconcile (without a cluster): a trial runs the
candidate on the canary only, a win rolls it to every replica, a tie takes the canary back and
the field is not tried again within the hold-off; under spec.autoscaling the canary comes
beside the autoscaler's pods and their count stays the autoscaler's."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pagekeeper_operator.adapters.plan import ObjectKey, key_of
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.controllers.reconcile import reconcile as reconcile_server
from pagekeeper_operator.policy.effective import compose
from pagekeeper_operator.render import ClusterFeatures, render_all
from pagekeeper_operator.rollout.canary import CanaryPlan, decide_canary, template_identity
from pagekeeper_operator.tuning.compare import compare
from pagekeeper_operator.tuning.decide import TrialEvidence
from pagekeeper_operator.tuning.step import promote_canary, trial_canary_spec
from pagekeeper_operator.tuning.tuner import Observation, tune
from tests.operator.servers import DEFAULT_IMAGES, make_server, merge, server_body
from tests.operator.test_reconcile_fit import MemoryKube
from tests.operator.tuning.test_rules import window

T0 = datetime(2026, 11, 29, 1, 0, tzinfo=UTC)
BASELINE = [1000.0, 1010.0, 990.0, 1005.0, 995.0, 1002.0, 998.0, 1001.0]
SPEC: dict[str, Any] = {
    "replicas": 3,
    "rollout": {"canary": {"enabled": True, "analysisSeconds": 60}},
    "tuning": {"mode": "Apply", "windowSeconds": 600, "holdOffSeconds": 3600},
}


def identity(server: LLMServer) -> str:
    objects = render_all(server, DEFAULT_IMAGES, ClusterFeatures())
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    return template_identity(deployment["spec"]["template"])


def reconcile(
    server: LLMServer, observation: Observation, now: datetime, stable: str
) -> tuple[LLMServer, CanaryPlan]:
    """What `reconcile` does with the tuner and the canary, status kept in memory."""
    result = tune(server, observation, now)
    canary = server.status.canary
    if result.promoted is not None:
        canary = promote_canary(canary, now)
    status = server.status.model_copy(
        update={"recommendations": result.recommendations, "tuning": result.tuning,
                "canary": canary}
    )  # fmt: skip
    server = server.model_copy(update={"status": status})
    plan = decide_canary(
        trial_canary_spec(server), replicas=3, max_surge=0,
        candidate=identity(server), stable=stable, previous=server.status.canary,
        pods=[], history=[], server_name="qwen", now=now,
    )  # fmt: skip
    status = server.status.model_copy(update={"canary": plan.status})
    return server.model_copy(update={"status": status}), plan


def start_trial() -> tuple[LLMServer, str]:
    server = make_server(SPEC)
    stable = identity(server)
    server, plan = reconcile(server, Observation(window("no_prefix_reuse")), T0, stable)
    assert server.status.tuning is not None and server.status.tuning.trial is not None
    assert (plan.main_runs_candidate, plan.main_replicas, plan.canary_replicas) == (False, 2, 1)
    assert server.status.canary is not None and server.status.canary.phase == "Analyzing"
    return server, stable


def test_the_canary_clock_never_promotes_a_trial() -> None:
    server, stable = start_trial()
    later = T0 + timedelta(seconds=120)  # past analysisSeconds, before the tuning window
    server, plan = reconcile(server, Observation(window("chat_steady"), TrialEvidence(None)),
                             later, stable)  # fmt: skip
    assert server.status.canary is not None and server.status.canary.phase == "Analyzing"
    assert (plan.main_runs_candidate, plan.canary_replicas) == (False, 1)
    assert compose(server).policy.enable_prefix_caching is True


def test_a_win_rolls_the_candidate_to_every_replica() -> None:
    server, stable = start_trial()
    won = TrialEvidence(compare([v * 1.1 for v in BASELINE], BASELINE))
    now = T0 + timedelta(seconds=600)
    server, plan = reconcile(server, Observation(window("chat_steady"), won), now, stable)
    assert (plan.main_runs_candidate, plan.canary_replicas) == (True, 0)
    assert server.status.canary is not None and server.status.canary.phase == "Promoted"
    assert compose(server).policy.enable_prefix_caching is False
    assert server.spec.memory_policy.enable_prefix_caching is True


def test_a_tie_takes_the_canary_back_and_holds_the_field() -> None:
    server, stable = start_trial()
    tie = TrialEvidence(compare(BASELINE, BASELINE))
    now = T0 + timedelta(seconds=600)
    server, plan = reconcile(server, Observation(window("no_prefix_reuse"), tie), now, stable)
    assert (plan.main_runs_candidate, plan.canary_replicas, plan.status) == (True, 0, None)
    assert identity(server) == stable  # the pods keep what they ran
    tuning = server.status.tuning
    assert tuning is not None and tuning.trial is None
    assert tuning.history[-1].outcome == "RolledBack"
    # The same window within the hold-off: no recommendation for the field, no new trial.
    later = now + timedelta(seconds=1800)
    server, plan = reconcile(server, Observation(window("no_prefix_reuse")), later, stable)
    assert server.status.recommendations == []
    assert server.status.tuning is not None and server.status.tuning.trial is None
    assert plan.canary_replicas == 0
    # After it, the recommendation may come back and start a new trial (under the daily cap).
    after = now + timedelta(seconds=3600)
    server, plan = reconcile(server, Observation(window("no_prefix_reuse")), after, stable)
    assert [r.field for r in server.status.recommendations] == ["enablePrefixCaching"]
    assert plan.canary_replicas == 1


AUTOSCALED: dict[str, Any] = {
    **SPEC,
    "autoscaling": {"minReplicas": 2, "maxReplicas": 6, "targets": {"runningRequests": 12}},
}
MAIN: ObjectKey = ("apps/v1", "Deployment", "qwen")
CANARY: ObjectKey = ("apps/v1", "Deployment", "qwen-canary")
HPA: ObjectKey = ("autoscaling/v2", "HorizontalPodAutoscaler", "qwen")


class AppliedKube(MemoryKube):
    """The in-memory cluster, with every manifest the reconcile applied, as it applied it."""

    def __init__(self) -> None:
        super().__init__([])
        self.applied: list[dict[str, Any]] = []
        self.num_autoscaled = 5  # the HorizontalPodAutoscaler's count of the stable Deployment

    def apply(self, manifest: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        self.applied.append(copy.deepcopy(manifest))
        stored = super().apply(manifest, **kwargs)
        if key_of(manifest) == MAIN and "replicas" not in manifest["spec"]:
            # server-side apply without the field leaves the autoscaler's count
            self.objects[MAIN]["spec"]["replicas"] = self.num_autoscaled
        return stored

    def applied_to(self, key: ObjectKey) -> list[dict[str, Any]]:
        return [m for m in self.applied if key_of(m) == key]


def engine_command(deployment: dict[str, Any]) -> list[str]:
    command: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    return command


def reconcile_at(kube: AppliedKube, status: dict[str, Any], now: str) -> dict[str, Any]:
    """One reconcile of the autoscaled server with `status`; the status it leaves."""
    kube.applied.clear()
    server = LLMServer.from_body(server_body(AUTOSCALED, status=status))
    result = reconcile_server(kube, server, DEFAULT_IMAGES, now)  # type: ignore[arg-type]
    assert result.error is None
    return merge(status, result.status_patch)


def test_an_autoscaled_servers_trial_runs_its_canary_beside_the_autoscalers_pods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The autoscaler keeps its count on the stable Deployment throughout (the operator never
    applies `replicas` there), the canary Deployment has canary.replicas of its own, and the
    HorizontalPodAutoscaler still scales the stable Deployment; a win rolls the candidate to
    the autoscaler's pods, not to a count of the operator's."""
    kube = AppliedKube()
    status = reconcile_at(kube, {}, "2026-11-29T00:59:00Z")
    stable = kube.objects[MAIN]["spec"]["template"]
    hpa = kube.objects[HPA]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    # A window of the server's pods made a recommendation: Apply mode tries it.
    server = LLMServer.from_body(server_body(AUTOSCALED))
    made = tune(server, Observation(window("no_prefix_reuse")), T0)
    status["recommendations"] = [r.to_api() for r in made.recommendations]
    status = reconcile_at(kube, status, "2026-11-29T01:00:00Z")
    assert status["tuning"]["trial"]["field"] == "enablePrefixCaching"
    assert status["canary"]["phase"] == "Analyzing"
    # Nothing of the stable Deployment moves: its template, and the autoscaler's 5 pods.
    assert all("replicas" not in m["spec"] for m in kube.applied_to(MAIN))
    assert kube.objects[MAIN]["spec"]["template"] == stable
    assert kube.objects[MAIN]["spec"]["replicas"] == 5
    [canary] = kube.applied_to(CANARY)
    assert canary["spec"]["replicas"] == 1
    assert "--no-enable-prefix-caching" in engine_command(canary)
    assert "--enable-prefix-caching" in engine_command(kube.objects[MAIN])
    assert kube.applied_to(HPA) == []  # unchanged: it still scales the stable Deployment

    # The autoscaler moves the count mid-trial: the canary keeps its one pod.
    kube.num_autoscaled = kube.objects[MAIN]["spec"]["replicas"] = 6
    status = reconcile_at(kube, status, "2026-11-29T01:05:00Z")
    assert status["tuning"]["trial"]["field"] == "enablePrefixCaching"
    assert kube.objects[CANARY]["spec"]["replicas"] == 1
    assert all("replicas" not in m["spec"] for m in kube.applied_to(MAIN))
    assert kube.objects[MAIN]["spec"]["replicas"] == 6

    # The trial wins: the stable Deployment takes the candidate at the autoscaler's count.
    won = TrialEvidence(compare([v * 1.1 for v in BASELINE], BASELINE))
    monkeypatch.setattr(
        "pagekeeper_operator.controllers.reconcile.observe",
        lambda *_: Observation(window("chat_steady"), won),
    )
    status = reconcile_at(kube, status, "2026-11-29T01:10:00Z")
    assert status["tuning"]["history"][-1]["outcome"] == "Promoted"
    [main] = kube.applied_to(MAIN)
    assert "replicas" not in main["spec"]
    assert "--no-enable-prefix-caching" in engine_command(main)
    assert kube.objects[MAIN]["spec"]["replicas"] == 6
    assert CANARY not in kube.objects
