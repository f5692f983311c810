"""The periodic driver of spec.lifecycle.maxPodAge: each round reads every known server, asks
`pod_age.decide_age`, evicts the pod it names through remediation's `KubeClusterPort` (the
Eviction API, so PodDisruptionBudgets hold) and says why in status.lifecycle, the remediation
history and Events.

It runs under the remediator's lock and shares its store: an alert's eviction and an age's
see each other's cooldown and evictions in flight, and an eviction's intent is written first
(`state.EVICT_INTENT`), so an operator killed before the outcome leaves a record the next one
settles (`Remediator.resume`). Not a kopf timer, for the reason `resync` gives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from pagekeeper_operator.api.lifecycle import LifecycleStatus
from pagekeeper_operator.api.llmserver import API_VERSION, KIND, LLMServer
from pagekeeper_operator.api.remediation import RemediationRecord
from pagekeeper_operator.metrics import count_remediation
from pagekeeper_operator.remediation.actions import KubeClusterPort, is_server_pod, pod_state
from pagekeeper_operator.remediation.port import EventType, EvictionOutcome
from pagekeeper_operator.remediation.remediator import Remediator
from pagekeeper_operator.remediation.state import EVICT_INTENT
from pagekeeper_operator.render.meta import SERVER_LABEL
from pagekeeper_operator.rollout.canary import CANARY_LABEL
from pagekeeper_operator.rollout.pod_age import (
    AGE_ALERT,
    AgeDecision,
    AgedPod,
    AgeVerdict,
    ServerAges,
    decide_age,
    is_rollout_complete,
)
from pagekeeper_operator.timestamps import parse_time, utc_now

logger = logging.getLogger(__name__)
AGE_INTERVAL_SECONDS = 10.0
"""How often every server's pods are looked at: a pod is replaced at most this late."""
EVENT_REASONS = {
    EvictionOutcome.EVICTED: "PodAgeReplaced",
    EvictionOutcome.POD_GONE: "PodGone",
    EvictionOutcome.PDB_BLOCKED: "PodAgeEvictionBlocked",
    EvictionOutcome.FAILED: "PodAgeEvictionFailed",
}
WAITING_REASON = "PodAgeReplacementWaiting"
ServerKey = tuple[str, str]


def aged_pod(pod: Mapping[str, Any], evicting: Iterable[str]) -> AgedPod:
    """A pod as `decide_age` needs it; one whose eviction is in flight counts as going away."""
    state = pod_state(pod)
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    return AgedPod(
        name=state.name,
        uid=str(metadata.get("uid") or ""),
        created_at=parse_time(str(metadata["creationTimestamp"])),
        is_ready=state.is_ready,
        is_terminating=state.is_terminating or state.name in set(evicting),
        is_canary=labels.get(CANARY_LABEL) == "true",
    )


def server_ages(
    server: LLMServer,
    pods: Iterable[Mapping[str, Any]],
    deployment: Mapping[str, Any] | None,
    last_action_at: datetime | None,
    evicting: Iterable[str] = (),
) -> ServerAges:
    """What `decide_age` reads for one server (pure)."""
    spec = server.spec
    aged = tuple(aged_pod(p, evicting) for p in pods if is_server_pod(p))
    num_desired = spec.replicas
    if deployment is not None and spec.is_autoscaled:
        num_desired = int((deployment.get("spec") or {}).get("replicas") or 0)
    canary = server.status.canary
    return ServerAges(
        max_age=spec.lifecycle.max_age,
        pods=aged,
        num_desired=num_desired,
        max_unavailable=spec.remediation.max_unavailable,
        cooldown=timedelta(seconds=spec.remediation.cooldown_seconds),
        last_action_at=last_action_at,
        is_canary_running=any(p.is_canary for p in aged)
        or (canary is not None and canary.phase == "Analyzing"),
        is_rollout_complete=is_rollout_complete(deployment),
    )


def lifecycle_status(
    previous: LifecycleStatus | None,
    decision: AgeDecision,
    replaced: tuple[str, datetime] | None = None,
    refused: tuple[str, str] | None = None,
) -> LifecycleStatus | None:
    """status.lifecycle after one round (pure): None when maxPodAge is off; `replaced` is the
    (pod, time) this round evicted, `refused` the (reason, message) of an eviction refused."""
    if decision.verdict is AgeVerdict.OFF:
        return None
    status = previous or LifecycleStatus()
    waiting = decision.pod.name if decision.verdict is AgeVerdict.WAIT and decision.pod else None
    reason = str(decision.reason) if decision.reason is not None else ""
    message = decision.message
    if refused is not None and decision.pod is not None:
        waiting, (reason, message) = decision.pod.name, refused
    update: dict[str, Any] = {
        "oldest_pod_created_at": decision.oldest_created_at,
        "next_due_at": decision.next_due_at,
        "waiting_pod": waiting,
        "reason": reason,
        "message": message[:1024],
    }
    if replaced is not None:
        update |= {"last_replaced_pod": replaced[0], "last_replaced_at": replaced[1]}
    return status.model_copy(update=update)


class PodAgeLoop:
    """Rounds of `decide_age` over the known servers, acting through remediation's port."""

    def __init__(
        self,
        port: KubeClusterPort,
        remediator: Remediator,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.port = port
        self.remediator = remediator
        self.clock = clock
        # Per server, (pod uid, reason) already told in an Event: a wait or a refusal is told
        # once a pod; the pods gone are dropped each round.
        self._told: dict[ServerKey, set[tuple[str, str]]] = {}

    async def run_forever(self, servers: Callable[[], list[ServerKey]], interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for namespace, name in servers():
                try:
                    await self.round(namespace, name)
                except Exception:
                    # One server's failure (the API briefly away) must not stop the others.
                    logger.exception("%s/%s: pod age round failed", namespace, name)

    async def round(self, namespace: str, name: str) -> AgeDecision | None:
        """One decision for one server, acted on; None when it is gone or unreadable."""
        kube = self.port.kube
        body = await asyncio.to_thread(kube.get, API_VERSION, KIND, namespace, name)
        if body is None:
            return None
        try:
            server = LLMServer.from_body(body)
        except ValidationError as exc:
            logger.warning("%s/%s: pod ages not checked, it does not validate: %s",
                           namespace, name, exc)  # fmt: skip
            return None
        key = (namespace, name)
        if server.spec.lifecycle.max_age is None:
            if server.status.lifecycle is not None:
                await self._write_status(key, None)
            return None
        selector = f"{SERVER_LABEL}={name}"
        pods = await asyncio.to_thread(kube.list, "v1", "Pod", namespace, selector)
        deployment = await asyncio.to_thread(kube.get, "apps/v1", "Deployment", namespace, name)
        uids = {str(p["metadata"].get("uid")) for p in pods}
        told = self._told.setdefault(key, set())
        told &= {entry for entry in told if entry[0] in uids}
        async with self.remediator.lock:
            now = self.clock()
            store = self.remediator.store
            store.rebuild(key, server.status.remediation_history)
            drain = timedelta(seconds=server.spec.remediation.drain_timeout_seconds)
            store.forget_gone(key, [str(p["metadata"]["name"]) for p in pods], now, drain)
            # The last eviction made (an alert's or an age's), as remediation counts it: from
            # the history's acted outcomes, or one this process made; a refusal starts none.
            last = store.last_action_at.get(key)
            evicting = store.evicting.get(key, {})
            decision = decide_age(server_ages(server, pods, deployment, last, evicting), now)
            replaced, refused = None, None
            if decision.verdict is AgeVerdict.REPLACE:
                replaced, refused = await self._replace(server, decision, now, told)
            elif decision.verdict is AgeVerdict.WAIT:
                await self._tell_wait(key, decision, told)
        status = lifecycle_status(server.status.lifecycle, decision, replaced, refused)
        await self._write_status(key, status)
        return decision

    async def _replace(
        self, server: LLMServer, decision: AgeDecision, now: datetime, told: set[tuple[str, str]]
    ) -> tuple[tuple[str, datetime] | None, tuple[str, str] | None]:
        """Evict the decision's pod: (pod, time) when it went, (reason, message) when refused."""
        pod, due = decision.pod, decision.due_at
        assert pod is not None and due is not None, "a replacement names its pod and due time"
        namespace, name = server.metadata.namespace, server.metadata.name
        limit = server.spec.remediation.history_limit
        intent = RemediationRecord(
            time=now, pod=pod.name, alert=AGE_ALERT, action="evict", outcome=EVICT_INTENT,
            message=decision.message[:1024], fingerprint=pod.uid[:64] or None, alertStartsAt=due,
        )  # fmt: skip
        # The intent first: a failed write raises, and no eviction is made without it.
        await self.port.append_history(namespace, name, intent, limit)
        outcome, detail = await self.port.evict(namespace, pod.name)
        message = f"{AGE_ALERT}: {detail}: {decision.message}"[:1024]
        key = (namespace, name)
        if outcome is EvictionOutcome.EVICTED:
            self.remediator.store.evicted(key, pod.name, (intent.fingerprint or "", due), now)
        is_repeat = outcome in (EvictionOutcome.PDB_BLOCKED, EvictionOutcome.FAILED) and (
            (pod.uid, str(outcome)) in told
        )
        if is_repeat:  # its refusal is on record already
            await self.port.drop_intent(namespace, name, intent)
        else:
            told.add((pod.uid, str(outcome)))
            record = intent.model_copy(update={"outcome": str(outcome), "message": message})
            await self.port.append_history(namespace, name, record, limit)
            count_remediation(namespace, name, record)
            is_ok = outcome in (EvictionOutcome.EVICTED, EvictionOutcome.POD_GONE)
            type_: EventType = "Normal" if is_ok else "Warning"
            await self.port.emit_event(namespace, name, type_, EVENT_REASONS[outcome], message)
        logger.info("%s/%s: %s", namespace, name, message)
        if outcome is EvictionOutcome.EVICTED:
            return (pod.name, now), None
        if outcome is EvictionOutcome.POD_GONE:
            return None, None
        return None, (str(outcome), message)

    async def _tell_wait(
        self, key: ServerKey, decision: AgeDecision, told: set[tuple[str, str]]
    ) -> None:
        """An Event once per pod and reason it waits for."""
        assert decision.pod is not None and decision.reason is not None, "a wait names both"
        entry = (decision.pod.uid, str(decision.reason))
        if entry in told:
            return
        told.add(entry)
        await self.port.emit_event(*key, "Normal", WAITING_REASON, decision.message)

    async def _write_status(self, key: ServerKey, status: LifecycleStatus | None) -> None:
        """status.lifecycle, written only when it changed (under optimistic concurrency)."""
        wanted = None if status is None else status.to_api()

        def change(body: dict[str, Any]) -> dict[str, Any] | None:
            current = (body.get("status") or {}).get("lifecycle")
            return None if current == wanted else {"lifecycle": wanted}

        await self.port.update_server_status(*key, change)
