"""The multi-step actions the crash suite kills the operator in, one class per action.

Each scenario starts a server, starts its action (`trigger`), and after the operator was killed
at a fault point and restarted, says when the cluster has settled (`converged`) and checks the
invariants (`check`), returning the outcome in a few words for the docs' table. What a seed
varies is in each class's docstring.
"""

from __future__ import annotations

import copy
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import PodWatch, get_server, history, is_pod_ready, server_pods
from harness.processes import exporter
from harness.prometheus import Prometheus, pod_scrape
from pagekeeper_operator.controllers.scaledown import DELETION_COST_ANNOTATION
from pagekeeper_operator.faultpoints import FaultPoint
from pagekeeper_operator.rollout.canary import template_identity
from tests.crash.harness import (
    AlertSender,
    Operator,
    assert_serving,
    deleted_pods,
    evicted_pods,
    firing_alert,
    minutes_ago,
    status_of,
)

NAME = "crash"
POD_SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b", "servedModelName": "qwen3"},
    "resources": {"gpus": 1, "requests": {"cpu": "100m", "memory": "1Gi"}},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9, "maxModelLen": 4096},
}
MAX_UNAVAILABLE = 1  # spec.remediation's and spec.rollout's default


@dataclass
class Run:
    """One case: where things are, and what the scenario noted on the way."""

    cluster: Cluster
    namespace: str
    operator: Operator
    watch: PodWatch
    stack: ExitStack
    seed: int
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.cluster.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.cluster.api)

    def operator_died(self) -> bool:
        return self.operator.current.proc.poll() is not None

    def serving_pods(self) -> list[str]:
        pods = server_pods(self.cluster, self.namespace, NAME)
        return [p.metadata.name for p in pods if is_pod_ready(p)]

    def deployment(self, name: str = NAME) -> Any:
        try:
            return self.apps.read_namespaced_deployment(name, self.namespace)
        except client.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise


def settled(run: Run, replicas: int) -> bool:
    """Status says what the Deployment has: the generation reconciled, every replica ready and
    updated, and exactly that many pods serving, none going away."""
    obj = get_server(run.cluster, run.namespace, NAME)
    status = obj.get("status") or {}
    pods = server_pods(run.cluster, run.namespace, NAME)
    deployment = run.deployment()
    if (
        deployment is None
        or deployment.status.observed_generation != deployment.metadata.generation
    ):
        return False
    return (
        deployment.status.updated_replicas == replicas
        and status.get("observedGeneration") == obj["metadata"]["generation"]
        and status.get("readyReplicas") == replicas
        and status.get("updatedReplicas") == replicas
        and len(pods) == replicas
        and all(is_pod_ready(p) for p in pods)
    )


def oom_status(pod: client.V1Pod, terminated: dict[str, Any]) -> dict[str, Any]:
    """A pod status patch with each container's last termination, as the kubelet writes it
    when the container restarted."""
    serialize = client.ApiClient().sanitize_for_serialization
    statuses = []
    for container in pod.status.container_statuses:
        entry = {k: v for k, v in serialize(container).items() if v is not None}
        entry["lastState"] = {"terminated": terminated}
        entry["restartCount"] = int(entry.get("restartCount") or 0) + 1
        statuses.append(entry)
    return {"status": {"containerStatuses": statuses}}


def termination(reason: str, message: str, minute: int) -> dict[str, Any]:
    return {
        "reason": reason,
        "message": message,
        "exitCode": 137 if reason == "OOMKilled" else 1,
        "startedAt": f"2026-11-23T10:{minute:02d}:00Z",
        "finishedAt": f"2026-11-23T10:{minute:02d}:30Z",
    }


class Scenario:
    """One multi-step action under test."""

    points: ClassVar[tuple[FaultPoint, ...]]
    replicas: ClassVar[int] = 3

    def spec(self, seed: int) -> dict[str, Any]:
        return {**copy.deepcopy(POD_SPEC), "replicas": self.replicas}

    def nth(self, point: FaultPoint, seed: int) -> int:
        return 1

    def env(self, stack: ExitStack, workdir: Any) -> dict[str, str]:
        return {}

    def trigger(self, run: Run) -> None:
        raise NotImplementedError

    def converged(self, run: Run) -> bool:
        raise NotImplementedError

    def check(self, run: Run) -> str:
        raise NotImplementedError


class Remediation(Scenario):
    """Two alerts on two pods of a 3-replica server with a 600 s cooldown: one pod is evicted
    and the other alert deferred. The seed picks the two pods and the alerts' order: one after
    the other (0), both in one notification (1), the newer one alone first (2)."""

    points = (
        FaultPoint.REMEDIATION_DECIDED,
        FaultPoint.REMEDIATION_INTENT_RECORDED,
        FaultPoint.REMEDIATION_EVICTED,
        FaultPoint.REMEDIATION_RECORDED,
        FaultPoint.REMEDIATION_EVENT_POSTED,
        FaultPoint.REMEDIATION_DEFERRAL_RECORDED,
    )

    def spec(self, seed: int) -> dict[str, Any]:
        remediation = {"hysteresisSeconds": 0, "cooldownSeconds": 600, "maxUnavailable": 1}
        return {**super().spec(seed), "remediation": remediation}

    def trigger(self, run: Run) -> None:
        pods = sorted(run.serving_pods())
        first, second = pods[run.seed % 3], pods[(run.seed + 1) % 3]
        alerts = {
            first: firing_alert(run.namespace, first, NAME, uuid.uuid4().hex[:16], minutes_ago(5)),
            second: firing_alert(
                run.namespace, second, NAME, uuid.uuid4().hex[:16], minutes_ago(4)
            ),
        }
        run.notes.update(alerts=alerts, pods=set(pods))
        sender = AlertSender(run.operator).start()
        run.stack.callback(sender.stop)
        if run.seed == 1:
            sender.fire(alerts[first], alerts[second])
            return
        order = [first, second] if run.seed == 0 else [second, first]
        sender.fire(alerts[order[0]])
        wait_for(
            lambda: run.watch.was_deleted(order[0]) or run.operator_died(),
            timeout=120,
            what=f"{order[0]} evicted",
        )
        sender.fire(alerts[order[1]])

    def converged(self, run: Run) -> bool:
        entries = history(run.cluster, run.namespace, NAME)
        return (
            settled(run, 3)
            and any(e["action"] == "evict" and e["outcome"] == "evicted" for e in entries)
            and any(e["action"] == "skip" for e in entries)
        )

    def check(self, run: Run) -> str:
        alerts: dict[str, dict[str, Any]] = run.notes["alerts"]
        # the history is the API server's; the watch may still be catching up with it
        run.watch.wait_seen(
            lambda w: any(w.was_deleted(p) for p in evicted_pods(w)), "the evicted pod deleted"
        )
        evicted = evicted_pods(run.watch)
        assert len(evicted) == 1 and evicted[0] in alerts, f"evicted: {evicted}"
        [other] = set(alerts) - set(evicted)
        assert deleted_pods(run.watch, run.notes["pods"]) == set(evicted)
        entries = history(run.cluster, run.namespace, NAME)
        evicts = [e for e in entries if e["action"] == "evict"]
        assert [(e["pod"], e["outcome"], e["fingerprint"]) for e in evicts] == [
            (evicted[0], "evicted", alerts[evicted[0]]["fingerprint"])
        ], entries
        skips = [e for e in entries if e["action"] == "skip"]
        assert [(e["pod"], e["fingerprint"]) for e in skips] == [
            (other, alerts[other]["fingerprint"])
        ], entries
        assert "cooldown" in skips[0]["message"]
        assert_serving(run.watch, NAME, 3, 3 - MAX_UNAVAILABLE)
        return "one pod evicted once; history: 1 eviction, 1 deferral"


class CanaryPromotion(Scenario):
    """A policy change under a canary that runs clean and is promoted. The seed sets
    rollout.maxSurge (0: the Deployment gives up a replica to the canary; 1: it keeps them)
    and the analysis time (4, 6, 8 s)."""

    points = (
        FaultPoint.CANARY_START_DECIDED,
        FaultPoint.CANARY_DEPLOYMENT_APPLIED,
        FaultPoint.CANARY_PROMOTION_DECIDED,
        FaultPoint.CANARY_PROMOTION_APPLIED,
        FaultPoint.CANARY_PROMOTION_PRUNED,
    )
    analysis_seconds: ClassVar[int | None] = None

    def spec(self, seed: int) -> dict[str, Any]:
        analysis = self.analysis_seconds or 4 + 2 * seed
        canary = {"enabled": True, "replicas": self.canary_replicas(seed)}
        rollout = {
            "maxSurge": seed % 2,
            "maxUnavailable": self.max_unavailable(seed),
            "canary": {**canary, "analysisSeconds": analysis},
        }
        return {**super().spec(seed), "rollout": rollout}

    def canary_replicas(self, seed: int) -> int:
        return 1

    def max_unavailable(self, seed: int) -> int:
        """rollout.maxUnavailable: with maxSurge 0 the stable Deployment gives up as many pods
        as the canary has, all at once, so it must allow that many."""
        return max(MAX_UNAVAILABLE, self.canary_replicas(seed))

    def trigger(self, run: Run) -> None:
        run.notes["stable"] = self.template_hash(run)
        spec = self.spec(run.seed)
        spec["memoryPolicy"]["gpuMemoryUtilization"] = 0.85
        run.cluster.apply_yaml(
            {"apiVersion": "pagekeeper.dev/v1alpha1", "kind": "LLMServer",
             "metadata": {"name": NAME, "namespace": run.namespace}, "spec": spec},
            "--force-conflicts",
        )  # fmt: skip

    def template_hash(self, run: Run, name: str = NAME) -> str:
        """The running template's identity, as status.canary names templates."""
        template = client.ApiClient().sanitize_for_serialization(run.deployment(name).spec.template)
        return template_identity(template)

    def canary_pods(self, run: Run) -> list[client.V1Pod]:
        selector = "pagekeeper.dev/canary=true"
        return list(run.core.list_namespaced_pod(run.namespace, label_selector=selector).items)

    def expected_phase(self) -> str:
        return "Promoted"

    def expected_template(self) -> str:
        return "templateHash"

    def converged(self, run: Run) -> bool:
        canary = status_of(run.cluster, run.namespace, NAME).get("canary") or {}
        return (
            canary.get("phase") == self.expected_phase()
            and self.template_hash(run) == canary.get(self.expected_template())
            and run.deployment(f"{NAME}-canary") is None
            and not self.canary_pods(run)
            and settled(run, 3)
        )

    def check(self, run: Run) -> str:
        canary = status_of(run.cluster, run.namespace, NAME)["canary"]
        running = self.template_hash(run)
        assert running == canary["templateHash"] != run.notes["stable"], canary
        assert canary["stableTemplateHash"] == run.notes["stable"], canary
        assert_serving(run.watch, NAME, 3, 3 - self.max_unavailable(run.seed))
        return "promoted; canary Deployment gone; 3 replicas on the new template"


class CanaryRollback(CanaryPromotion):
    """A policy change whose canary pod is OOM-killed: the canary fails and is taken back.
    The seed sets rollout.maxSurge and the canary's replicas ((0, 1), (1, 1), (0, 2), the last
    with rollout.maxUnavailable 2) and which canary pod is killed."""

    points = (
        FaultPoint.CANARY_ROLLBACK_DECIDED,
        FaultPoint.CANARY_ROLLBACK_APPLIED,
        FaultPoint.CANARY_ROLLBACK_PRUNED,
    )
    analysis_seconds = 3600

    def canary_replicas(self, seed: int) -> int:
        return 2 if seed == 2 else 1

    def trigger(self, run: Run) -> None:
        super().trigger(run)
        num = self.canary_replicas(run.seed)

        def ready() -> list[client.V1Pod] | None:
            pods = [p for p in self.canary_pods(run) if is_pod_ready(p)]
            return sorted(pods, key=lambda p: p.metadata.name) if len(pods) == num else None

        pods = wait_for(ready, timeout=120, what=f"{num} canary pods ready")
        pod = pods[run.seed % num]
        killed = termination("OOMKilled", "", 5)
        body = oom_status(pod, killed)
        run.core.patch_namespaced_pod_status(pod.metadata.name, run.namespace, body)

    def expected_phase(self) -> str:
        return "Failed"

    def expected_template(self) -> str:
        return "stableTemplateHash"

    def check(self, run: Run) -> str:
        canary = status_of(run.cluster, run.namespace, NAME)["canary"]
        assert canary["failedSignal"] == "oomEvents", canary
        assert self.template_hash(run) == run.notes["stable"] == canary["stableTemplateHash"]
        assert_serving(run.watch, NAME, 3, 3 - self.max_unavailable(run.seed))
        return "rolled back; canary Deployment gone; 3 replicas on the stable template"


GPU_OOM = "pagekeeper-oom kind=gpu phase=runtime detail=CUDA out of memory in a decode step"


class StepDown(Scenario):
    """Run-time GPU OOM terminations step the effective policy down (0.05 a step) and roll
    it out. The seed picks the pod (0, 1) or makes two terminations one after the other, the
    kill at the second (2)."""

    points = (
        FaultPoint.STEPDOWN_CLASSIFIED,
        FaultPoint.STEPDOWN_RECORDED,
        FaultPoint.STEPDOWN_EVENT_POSTED,
        FaultPoint.STEPDOWN_ROLLED_OUT,
    )
    replicas = 2

    def nth(self, point: FaultPoint, seed: int) -> int:
        return 2 if seed == 2 else 1

    def num_terminations(self, seed: int) -> int:
        return 2 if seed == 2 else 1

    def _oom(self, run: Run, index: int, minute: int) -> None:
        pods = server_pods(run.cluster, run.namespace, NAME)
        pod = sorted(pods, key=lambda p: p.metadata.name)[index]
        body = oom_status(pod, termination("Error", GPU_OOM, minute))
        run.core.patch_namespaced_pod_status(pod.metadata.name, run.namespace, body)

    def trigger(self, run: Run) -> None:
        self._oom(run, run.seed % 2, 5)
        if run.seed != 2:
            return

        def stepped() -> bool:
            entries = history(run.cluster, run.namespace, NAME)
            return any(e["action"] == "step-down" for e in entries) and settled(run, 2)

        wait_for(stepped, timeout=120, what="the first step-down rolled out")
        self._oom(run, 0, 7)

    def utilization(self, seed: int) -> float:
        return round(0.9 - 0.05 * self.num_terminations(seed), 2)

    def converged(self, run: Run) -> bool:
        entries = [
            e for e in history(run.cluster, run.namespace, NAME) if e["action"] == "step-down"
        ]
        deployment = run.deployment()
        command = deployment.spec.template.spec.containers[0].command
        flag = command[command.index("--gpu-memory-utilization") + 1]
        return (
            len(entries) >= self.num_terminations(run.seed)
            and float(flag) == self.utilization(run.seed)
            and settled(run, 2)
        )

    def check(self, run: Run) -> str:
        entries = [
            e for e in history(run.cluster, run.namespace, NAME) if e["action"] == "step-down"
        ]
        num = self.num_terminations(run.seed)
        assert len(entries) == num, entries
        assert len({e["fingerprint"] for e in entries}) == num, entries
        assert all(e["outcome"] == "applied" for e in entries), entries
        status = status_of(run.cluster, run.namespace, NAME)
        effective = status["effectiveMemoryPolicy"]["gpuMemoryUtilization"]
        assert effective == self.utilization(run.seed), status["effectiveMemoryPolicy"]
        assert_serving(run.watch, NAME, 2, 2 - MAX_UNAVAILABLE)
        return f"stepped down {num}x, once per OOM; rolled out to 2 replicas"


class Autoscaling(Scenario):
    """Autoscaling turned on for a running server: the count handed over to the autoscaler,
    the pods' deletion costs written. The seed sets the replicas (2, 2, 3) and which cost
    write is killed (the 1st, 2nd or 3rd)."""

    points = (
        FaultPoint.AUTOSCALING_HANDED_OVER,
        FaultPoint.AUTOSCALING_APPLIED,
        FaultPoint.DELETION_COSTS_PLANNED,
        FaultPoint.DELETION_COST_WRITTEN,
    )

    def num_replicas(self, seed: int) -> int:
        return 3 if seed == 2 else 2

    def spec(self, seed: int) -> dict[str, Any]:
        return {**copy.deepcopy(POD_SPEC), "replicas": self.num_replicas(seed)}

    def nth(self, point: FaultPoint, seed: int) -> int:
        return 1 + seed if point is FaultPoint.DELETION_COST_WRITTEN else 1

    def env(self, stack: ExitStack, workdir: Any) -> dict[str, str]:
        prometheus = Prometheus(workdir / "prometheus", [], None).start([])
        stack.callback(prometheus.stop)
        assert prometheus.service is not None
        # the pods' series: idle (a pod without series keeps the cost it has, here none)
        port, _ = stack.enter_context(
            exporter({"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0})
        )
        self._series = (prometheus, port)
        return {
            "PAGEKEEPER_PROMETHEUS_URL": prometheus.service.url,
            "PAGEKEEPER_DELETION_COST_SECONDS": "1",
        }

    def trigger(self, run: Run) -> None:
        run.notes["pods"] = set(run.serving_pods())
        prometheus, port = self._series
        pods = [(run.namespace, pod, NAME) for pod in sorted(run.notes["pods"])]
        prometheus.reload([pod_scrape(port, *pods, job="pods")])
        spec = {**self.spec(run.seed), "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}
        run.cluster.apply_yaml(
            {"apiVersion": "pagekeeper.dev/v1alpha1", "kind": "LLMServer",
             "metadata": {"name": NAME, "namespace": run.namespace}, "spec": spec},
            "--force-conflicts",
        )  # fmt: skip

    def converged(self, run: Run) -> bool:
        num = self.num_replicas(run.seed)
        deployment = run.deployment()
        owners = {
            entry.manager
            for entry in deployment.metadata.managed_fields or []
            if "f:replicas" in ((entry.fields_v1 or {}).get("f:spec") or {})
        }
        pods = server_pods(run.cluster, run.namespace, NAME)
        costs = [(p.metadata.annotations or {}).get(DELETION_COST_ANNOTATION) for p in pods]
        autoscaling = status_of(run.cluster, run.namespace, NAME).get("autoscaling") or {}
        return (
            deployment.spec.replicas == num
            and "pagekeeper-operator" not in owners
            and costs == ["0"] * num
            and autoscaling.get("name") == NAME
            and settled(run, num)
        )

    def check(self, run: Run) -> str:
        num = self.num_replicas(run.seed)
        assert set(run.serving_pods()) == run.notes["pods"], "a pod was replaced"
        assert not deleted_pods(run.watch, run.notes["pods"])
        assert_serving(run.watch, NAME, num, num)
        return f"count handed over at {num}, no pod lost; every pod's cost written"


SCENARIOS: tuple[Scenario, ...] = (
    Remediation(),
    CanaryPromotion(),
    CanaryRollback(),
    StepDown(),
    Autoscaling(),
)


def scenario_for(point: FaultPoint) -> Scenario:
    [scenario] = [s for s in SCENARIOS if point in s.points]
    return scenario
