"""The resync writes status at the resourceVersion it read, on the real API server.

Another writer changes the LLMServer between the resync's read and its status write (as the
kopf handlers, remediation or `kubectl annotate` do). The API server answers that write 409, and
the resync reconciles the server again from a fresh read instead of writing fields an older read
computed. A writer that keeps winning costs a bounded number of attempts, no exception, and the
next round writes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kubernetes import client

from harness.cluster import Cluster
from harness.loop import llmserver
from pagekeeper_operator.adapters.kube import Kube
from pagekeeper_operator.api.llmserver import KIND
from pagekeeper_operator.controllers.resync import STATUS_WRITE_ATTEMPTS, server_reconciler
from pagekeeper_operator.settings import load_settings
from tests.integration import operator_fixture
from tests.integration.operator_fixture import apply_server, get_server

llmserver_crd = operator_fixture.llmserver_crd

GROUP, VERSION, PLURAL = "pagekeeper.dev", "v1alpha1", "llmservers"
SPEC: dict[str, Any] = {
    "model": {"source": "/models/qwen3-0.6b", "servedModelName": "qwen3"},
    "replicas": 1,
    "resources": {"gpus": 1},
}


class InterleavedKube(Kube):
    """The operator's real client, with another writer annotating the server right after each
    of the first `num_interleaved` reads of it; every status write's version and answer kept."""

    def __init__(self, cluster: Cluster, num_interleaved: int) -> None:
        super().__init__(cluster.api)
        self._objects = client.CustomObjectsApi(cluster.api)
        self.num_interleaved = num_interleaved
        self.status_writes: list[tuple[str | None, bool]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        body = super().get(api_version, kind, namespace, name)
        if kind == KIND and self.num_interleaved > 0:
            self.num_interleaved -= 1
            annotation = {"test.pagekeeper.dev/writer": str(self.num_interleaved)}
            self._objects.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, {"metadata": {"annotations": annotation}}
            )
        return body

    def patch_status(
        self,
        namespace: str,
        name: str,
        patch: Any,
        resource_version: str | None = None,
    ) -> bool:
        written = super().patch_status(namespace, name, patch, resource_version)
        self.status_writes.append((resource_version, written))
        return written


def test_a_status_write_another_writer_made_stale_is_redone_from_a_fresh_read(
    cluster: Cluster, namespace: str, llmserver_crd: object
) -> None:
    apply_server(cluster, namespace, llmserver("chat", SPEC))
    kube = InterleavedKube(cluster, num_interleaved=1)
    asyncio.run(server_reconciler(kube, load_settings({}))(namespace, "chat"))

    (first_version, first_written), (second_version, second_written) = kube.status_writes
    assert (first_written, second_written) == (False, True)  # a real 409, then a write
    assert first_version is not None and second_version is not None
    assert int(second_version) > int(first_version)
    status = get_server(cluster, namespace, "chat")["status"]
    assert status["observedGeneration"] == 1
    assert {c["type"] for c in status["conditions"]} >= {"Ready", "Progressing", "PolicyFits"}


def test_a_writer_that_keeps_winning_costs_bounded_attempts_and_the_next_round_writes(
    cluster: Cluster, namespace: str, llmserver_crd: object
) -> None:
    apply_server(cluster, namespace, llmserver("chat", SPEC))
    kube = InterleavedKube(cluster, num_interleaved=STATUS_WRITE_ATTEMPTS)
    reconcile_server = server_reconciler(kube, load_settings({}))
    asyncio.run(reconcile_server(namespace, "chat"))
    assert [written for _, written in kube.status_writes] == [False] * STATUS_WRITE_ATTEMPTS
    assert get_server(cluster, namespace, "chat").get("status", {}).get("observedGeneration") in (
        None,
        0,
    )
    asyncio.run(reconcile_server(namespace, "chat"))  # the writer has stopped: the next round
    assert kube.status_writes[-1][1] is True
    assert get_server(cluster, namespace, "chat")["status"]["observedGeneration"] == 1
