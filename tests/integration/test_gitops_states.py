"""An LLMServer in each state a GitOps pipeline meets, captured from the real control plane with
the operator running, and judged by Argo CD's Lua health code and by kstatus (Flux).

The captures are compared with the committed objects under tests/gitops/argocd/.../testdata
through the same verdicts: the committed `health_test.yaml` must hold for the fresh captures,
and kstatus must give the same status. `PAGEKEEPER_WRITE_TESTDATA=1` writes the fresh captures
over the committed ones (review the diff).

The rollout that never finishes comes from pods no node can take (a nodeSelector no node has);
past the progress deadline the Deployment reports ProgressDeadlineExceeded exactly as it does
for crash-looping pods. The deadline the operator renders is over ten minutes, so the test
lowers it on the Deployment with a field manager of its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from harness.cluster import Cluster, wait_for
from harness.loop import llmserver
from harness.operator_process import OperatorProcess
from tests.integration import operator_fixture
from tests.integration.operator_fixture import (
    GROUP,
    PLURAL,
    VERSION,
    apply_server,
    get_or_none,
    get_server,
    wait_ready,
)
from tests.support.gitops import CASES, STATES, kstatus, lua_health

llmserver_crd = operator_fixture.llmserver_crd
operator = operator_fixture.operator

SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b", "servedModelName": "qwen3"},
    "replicas": 2,
    "resources": {"gpus": 1, "requests": {"cpu": "100m", "memory": "1Gi"}},
    "memoryPolicy": {"gpuMemoryUtilization": 0.9, "maxModelLen": 4096},
}
NOWHERE = {"nodeSelector": {"pagekeeper.test/no-such-node": "true"}}
HOLD = "pagekeeper.test/hold"


# A ReplicaSet's name ends in the pod template's hash, which any change to the rendered template
# moves; the committed captures name it by this placeholder so that they hold across such changes.
_REPLICASET = re.compile(r'(ReplicaSet "[a-z0-9-]+)-[bcdfghjklmnpqrstvwxz2-9]{5,10}"')
TEMPLATE_HASH = "<pod-template-hash>"


def _without_template_hash(value: Any) -> Any:
    if isinstance(value, str):
        return _REPLICASET.sub(rf'\1-{TEMPLATE_HASH}"', value)
    if isinstance(value, dict):
        return {k: _without_template_hash(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_template_hash(v) for v in value]
    return value


def normalized(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as committed: no identity, versions, managed fields or kopf annotations, and
    the pod template's hash in a ReplicaSet's name replaced by a placeholder."""
    meta = obj["metadata"]
    kept = ("name", "generation", "deletionTimestamp")
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {"namespace": "ml", **{k: meta[k] for k in kept if k in meta}},
        "spec": obj["spec"],
        **({"status": _without_template_hash(obj["status"])} if "status" in obj else {}),
    }


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    conditions = obj.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == type_), {})


def wait_condition(
    cluster: Cluster,
    namespace: str,
    name: str,
    type_: str,
    reason: str,
    timeout: float = 120,
    at_rest: bool = False,
    message: str | None = None,
) -> dict[str, Any]:
    """Until the current generation's `type_` condition is True with `reason` (and `message`,
    where given; and, `at_rest`, Reconciling is False: nothing else under way); the object."""
    seen: list[Any] = []

    def reached() -> dict[str, Any] | None:
        obj = get_server(cluster, namespace, name)
        seen[:] = [obj.get("status", {}).get("conditions")]
        condition = _condition(obj, type_)
        is_current = (
            obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
        )
        is_there = condition.get("status") == "True" and condition.get("reason") == reason
        is_there = is_there and message in {None, condition.get("message")}
        is_quiet = not at_rest or _condition(obj, "Reconciling").get("status") == "False"
        return obj if is_current and is_there and is_quiet else None

    try:
        obj: dict[str, Any] = wait_for(reached, timeout=timeout, what=f"{name}: {type_} {reason}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; conditions: {seen}") from None
    return obj


def _oom_on_canary(cluster: Cluster, namespace: str, name: str) -> None:
    """An out-of-memory termination on the canary pod, as the kubelet would report it."""
    core = client.CoreV1Api(cluster.api)
    selector = f"pagekeeper.dev/llmserver={name},pagekeeper.dev/canary=true"
    (pod,) = core.list_namespaced_pod(namespace, label_selector=selector).items
    terminated = {
        "reason": "OOMKilled",
        "exitCode": 137,
        "startedAt": "2026-11-23T10:00:00Z",
        "finishedAt": "2026-11-23T10:05:00Z",
    }
    statuses = [
        {
            "name": s.name,
            "ready": s.ready,
            "restartCount": 1,
            "image": s.image,
            "imageID": s.image_id or "",
            "lastState": {"terminated": terminated},
            "state": {"running": {"startedAt": "2026-11-23T10:05:01Z"}},
        }
        for s in pod.status.container_statuses
    ]
    body = {"status": {"containerStatuses": statuses}}
    core.patch_namespaced_pod_status(pod.metadata.name, namespace, body)


def drive_states(
    cluster: Cluster, namespace: str, operator: OperatorProcess, new: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each state's LLMServer as the API server returns it."""
    apps = client.AppsV1Api(cluster.api)
    custom = client.CustomObjectsApi(cluster.api)
    changed = {**SPEC, "memoryPolicy": {**SPEC["memoryPolicy"], "gpuMemoryUtilization": 0.85}}
    canary = {**SPEC, "rollout": {"canary": {"enabled": True, "analysisSeconds": 3600}}}
    # A mount of a volume the pod does not have: the CRD cannot see it, the Deployment refuses.
    refused_pod = {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    start: dict[str, Callable[[], None]] = {
        "ready": lambda: apply_server(cluster, namespace, llmserver("ready", SPEC)),
        "rolling-out": lambda: apply_server(cluster, namespace, llmserver("rolling-out", SPEC)),
        "canary-analyzing": lambda: apply_server(cluster, namespace, llmserver("canary", canary)),
        "apply-refused": lambda: apply_server(
            cluster, namespace, llmserver("apply-refused", {**SPEC, "podTemplate": refused_pod})
        ),
        "progress-deadline-exceeded": lambda: apply_server(
            cluster,
            namespace,
            llmserver("progress-deadline-exceeded", {**SPEC, "podTemplate": NOWHERE}),
        ),
        "scaled-to-zero": lambda: apply_server(
            cluster, namespace, llmserver("scaled-to-zero", {**SPEC, "replicas": 0})
        ),
        "deleting": lambda: apply_server(
            cluster, namespace, llmserver("deleting", {**SPEC, "replicas": 1})
        ),
    }
    for begin in start.values():
        begin()
    captured = {"new": new}
    wait_ready(cluster, namespace, "ready", 2)
    captured["ready"] = wait_condition(
        cluster, namespace, "ready", "Ready", "AllReplicasReady", at_rest=True
    )
    captured["scaled-to-zero"] = wait_condition(
        cluster, namespace, "scaled-to-zero", "Ready", "ScaledToZero", at_rest=True
    )
    captured["apply-refused"] = wait_condition(
        cluster, namespace, "apply-refused", "Stalled", "ApplyFailed"
    )

    wait_ready(cluster, namespace, "rolling-out", 2)
    apply_server(cluster, namespace, llmserver("rolling-out", {**SPEC, "podTemplate": NOWHERE}))
    # The committed state: the new template's surge pod exists (and cannot schedule), which a
    # busy controller-manager may not have made yet when RollingOut first shows.
    captured["rolling-out"] = wait_condition(
        cluster, namespace, "rolling-out", "Reconciling", "RollingOut",
        message="1/2 replicas run the current pod template",
    )  # fmt: skip

    wait_condition(cluster, namespace, "progress-deadline-exceeded", "Reconciling", "RollingOut")
    apps.patch_namespaced_deployment(
        "progress-deadline-exceeded",
        namespace,
        {"spec": {"progressDeadlineSeconds": 1}},
        field_manager="pagekeeper-test",
    )
    captured["progress-deadline-exceeded"] = wait_condition(
        cluster, namespace, "progress-deadline-exceeded", "Stalled", "ProgressDeadlineExceeded"
    )

    wait_ready(cluster, namespace, "canary", 2)
    apply_server(cluster, namespace, llmserver("canary", {**changed, "rollout": canary["rollout"]}))
    captured["canary-analyzing"] = wait_condition(
        cluster, namespace, "canary", "Reconciling", "CanaryAnalyzing"
    )

    def canary_ready() -> bool:
        canary = get_or_none(apps.read_namespaced_deployment, "canary-canary", namespace)
        return canary is not None and canary.status.ready_replicas == 1

    wait_for(canary_ready, timeout=120, what="the canary pod ready")
    _oom_on_canary(cluster, namespace, "canary")
    captured["canary-rolled-back"] = wait_condition(
        cluster, namespace, "canary", "Stalled", "CanaryRolledBack"
    )

    wait_ready(cluster, namespace, "deleting", 1)
    # The operator sets no finalizer (no deletion handler): the test's own holds the deletion.
    hold = f'{{"metadata": {{"finalizers": ["{HOLD}"]}}}}'
    cluster.kubectl("patch", "-n", namespace, "llmserver/deleting", "--type=merge", "-p", hold)
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "deleting")
    captured["deleting"] = wait_for(
        lambda: (
            (obj := get_server(cluster, namespace, "deleting"))["metadata"].get("deletionTimestamp")
            and obj
        ),
        what="deleting: deletionTimestamp set",
    )
    return captured


def test_each_state_reads_the_same_to_argo_cd_and_kstatus_as_committed(
    cluster: Cluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    # "new": created where no operator watches, so status is as the API server first stores it.
    unwatched = f"{namespace}-new"
    cluster.kubectl("create", "namespace", unwatched)
    try:
        apply_server(cluster, unwatched, llmserver("new", SPEC))
        new = get_server(cluster, unwatched, "new")
    finally:
        cluster.kubectl("delete", "namespace", unwatched, "--wait=false", check=False)

    captured = drive_states(cluster, namespace, operator, new)

    # kubectl wait on both conditions, as a pipeline step would.
    for name, condition in (("ready", "Ready"), ("apply-refused", "Stalled")):
        cluster.kubectl(
            "wait", "-n", namespace, f"--for=condition={condition}", f"llmserver/{name}",
            "--timeout=60s",
        )  # fmt: skip

    release = '{"metadata": {"finalizers": null}}'
    cluster.kubectl("patch", "-n", namespace, "llmserver/deleting", "--type=merge", "-p", release)

    testdata = tmp_path / "testdata"
    testdata.mkdir()
    committed = CASES / "testdata"
    for state, obj in captured.items():
        text = yaml.safe_dump(normalized(obj), sort_keys=False)
        (testdata / f"{state}.yaml").write_text(text)
        if os.environ.get("PAGEKEEPER_WRITE_TESTDATA") == "1":
            (committed / f"{state}.yaml").write_text(text)

    verdicts = kstatus(sorted(testdata.glob("*.yaml")))
    assert {name.removesuffix(".yaml"): v[0] for name, v in verdicts.items()} == {
        state: kstatus_status for state, (_, kstatus_status) in STATES.items()
    }
    committed_verdicts = kstatus(sorted(committed.glob("*.yaml")))
    assert {n: v[0] for n, v in committed_verdicts.items()} == {
        n: v[0] for n, v in verdicts.items()
    }

    run = lua_health(CASES / "health_test.yaml", testdata, tmp_path / "argocd")
    assert run.results == {f"testdata/{state}.yaml": "PASS" for state in STATES}, run.output
    assert run.returncode == 0, run.output
