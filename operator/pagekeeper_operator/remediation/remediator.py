"""Alerts in, evictions out: reads the cluster, asks `decide`, acts, and remembers.

Kubernetes is reached only through `port.ClusterPort` (implemented in `actions`), so this loop is
tested against an in-memory cluster. Batches run one at a time: each decides on the state the
previous one left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from pagekeeper_operator.api.remediation import RemediationAction, RemediationRecord
from pagekeeper_operator.failures import describe, is_permanent
from pagekeeper_operator.faultpoints import FaultPoint, reached
from pagekeeper_operator.metrics import count_remediation
from pagekeeper_operator.remediation.decide import (
    Decision,
    PodKey,
    PodState,
    ServerKey,
    SkipReason,
    Snapshot,
    Verdict,
    decide,
)
from pagekeeper_operator.remediation.payload import WebhookAlert, WebhookMessage
from pagekeeper_operator.remediation.port import (
    ClusterPort,
    EventType,
    EvictionOutcome,
    ServerInfo,
)
from pagekeeper_operator.remediation.state import (
    EVICT_INTENT,
    RemediationStore,
    UnwrittenRecord,
    is_intent,
)
from pagekeeper_operator.timestamps import utc_now

logger = logging.getLogger(__name__)
MAX_MESSAGE_LENGTH = 1024
# Deferred skips worth a line in status and an Event (once per alert firing).
RECORDED_SKIPS = frozenset({SkipReason.COOLDOWN, SkipReason.MAX_UNAVAILABLE})


class Remediator:
    """Turns Alertmanager notifications (and retries of deferred alerts) into actions."""

    def __init__(
        self,
        port: ClusterPort,
        store: RemediationStore | None = None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.port = port
        self.store = store if store is not None else RemediationStore()
        self.clock = clock
        self._lock = asyncio.Lock()
        # Servers whose history this process has read, so intents left open before it settled.
        self._resumed: set[ServerKey] = set()

    @property
    def lock(self) -> asyncio.Lock:
        """Held by each batch; another loop that evicts the same servers' pods (`pod_age_loop`)
        holds it too, so their decisions see each other's evictions."""
        return self._lock

    async def handle(self, message: WebhookMessage) -> dict[str, Any]:
        """Act on one notification; the summary is the webhook's response body."""
        async with self._lock:
            decisions = await self._process(message.alerts, is_delivery=True)
        return {
            "decisions": [
                {
                    "alert": d.alert,
                    "namespace": d.namespace,
                    "pod": d.pod,
                    "verdict": str(d.verdict),
                    "reason": None if d.reason is None else str(d.reason),
                }
                for d in decisions
            ]
        }

    async def retry_due(self) -> list[Decision]:
        """Write history that could not be written, and decide again on deferred alerts that
        are still firing."""
        async with self._lock:
            await self._write_unwritten()
            alerts = self.store.due(self.clock())
            return await self._process(alerts, is_delivery=False) if alerts else []

    async def resume(self, servers: Iterable[ServerKey]) -> None:
        """Settle what an earlier operator process left open in each server's history (once a
        server and process): an eviction it decided and may not have made."""
        async with self._lock:
            for key in servers:
                if key in self._resumed:
                    continue
                info = await self.port.read_server(*key)
                if info is not None:
                    info = await self._settle_intents(info)
                    self.store.rebuild(key, info.history)
                self._resumed.add(key)

    async def _settle_intents(self, info: ServerInfo) -> ServerInfo:
        """An open intent is settled from its pod: gone or going away, the eviction happened
        (`evicted`, at the intent's time, so the cooldown counts from it); still serving, it
        was never made, and the intent is dropped (nothing happened; a re-delivered alert is
        decided again)."""
        state = info.state
        pods = {pod.name: pod for pod in state.pods}
        history = list(info.history)
        # an outcome this process holds unwritten (`_append`) settles its intent when written
        queued = {(e.record.fingerprint, e.record.pod) for e in self.store.unwritten}
        for record in [r for r in history if is_intent(r)]:
            if (record.fingerprint, record.pod) in queued:
                continue
            pod = pods.get(record.pod)
            if pod is None or pod.is_terminating:
                message = f"{record.alert}: {record.pod} went away after its eviction was decided"
                settled = record.model_copy(update={"outcome": "evicted", "message": message})
                limit = state.remediation.history_limit
                await self.port.append_history(state.namespace, state.name, settled, limit)
                history[history.index(record)] = settled
            else:
                message = f"{record.alert}: the operator stopped before evicting {record.pod}"
                await self.port.drop_intent(state.namespace, state.name, record)
                history.remove(record)
            logger.warning("%s/%s: %s", state.namespace, state.name, message)
        return ServerInfo(state=state, history=tuple(history))

    async def _process(self, alerts: Sequence[WebhookAlert], is_delivery: bool) -> list[Decision]:
        await self._write_unwritten()
        now = self.clock()
        snapshot, servers = await self._snapshot(alerts, now)
        decisions = decide(alerts, snapshot, now)
        by_key = {alert.key: alert for alert in alerts}
        for decision in decisions:
            info = None
            if decision.server is not None:
                info = servers.get((decision.namespace, decision.server))
            await self._act(decision, by_key[decision.key], info, now, is_delivery)
        return decisions

    async def _snapshot(
        self, alerts: Sequence[WebhookAlert], now: datetime
    ) -> tuple[Snapshot, dict[ServerKey, ServerInfo]]:
        """Read each alerted pod and its server once; take their history into the store."""
        pods: dict[PodKey, PodState] = {}
        servers: dict[ServerKey, ServerInfo] = {}
        for alert in alerts:
            pod_key = (alert.labels.get("namespace", ""), alert.labels.get("pod", ""))
            if alert.status != "firing" or not all(pod_key) or pod_key in pods:
                continue
            pod = await self.port.read_pod(*pod_key)
            if pod is None:
                continue
            pods[pod_key] = pod
            server_key = (pod.namespace, pod.server or "")
            if pod.server is None or server_key in servers:
                continue
            info = await self.port.read_server(*server_key)
            if info is None:
                continue
            info = await self._settle_intents(info)
            servers[server_key] = info
            self._resumed.add(server_key)
            self.store.rebuild(server_key, info.history)
            drain = timedelta(seconds=info.state.remediation.drain_timeout_seconds)
            pod_names = [p.name for p in info.state.pods]
            for stuck in self.store.forget_gone(server_key, pod_names, now, drain):
                message = f"pod {stuck} still exists {drain} after its eviction"
                await self._event(server_key, "Warning", "EvictionStuck", message)
        snapshot = Snapshot(
            pods=pods,
            servers={key: info.state for key, info in servers.items()},
            memory=self.store.memory(),
        )
        return snapshot, servers

    async def _act(
        self,
        decision: Decision,
        alert: WebhookAlert,
        info: ServerInfo | None,
        now: datetime,
        is_delivery: bool,
    ) -> None:
        server_key = (decision.namespace, decision.server or "")
        if decision.verdict is Verdict.SKIP:
            await self._skipped(decision, alert, info, now, is_delivery)
        elif decision.verdict is Verdict.DRY_RUN:
            self.store.acted(server_key, decision.key, now)
            self.store.settle(alert)
            await self._record(decision, info, now, "dry-run", "would-evict", decision.message)
            await self._event(server_key, "Normal", "RemediationDryRun", decision.message)
        else:
            reached(FaultPoint.REMEDIATION_DECIDED)
            # The intent first: an operator killed before the outcome is written leaves it, and
            # the next one knows this firing was acted on (no second eviction, the cooldown
            # holds) and settles it from the pod (`_settle_intents`).
            intent = self._make_record(decision, now, "evict", EVICT_INTENT, decision.message)
            if info is not None:  # a failed write raises: no eviction without its intent
                state = info.state
                limit = state.remediation.history_limit
                await self.port.append_history(state.namespace, state.name, intent, limit)
            reached(FaultPoint.REMEDIATION_INTENT_RECORDED)
            outcome, detail = await self.port.evict(decision.namespace, decision.pod)
            reached(FaultPoint.REMEDIATION_EVICTED)
            message = f"{decision.alert}: {detail}"
            if outcome is EvictionOutcome.EVICTED:
                self.store.evicted(server_key, decision.pod, decision.key, now)
                self.store.settle(alert)
            elif outcome is EvictionOutcome.POD_GONE:
                self.store.settle(alert)
            else:
                # A PodDisruptionBudget said no (429) or the API failed: retry, never force.
                self.store.defer(alert, now, is_delivery)
                if not self.store.note_once(decision.key, str(outcome)):
                    if info is not None:  # its refusal is recorded already
                        state = info.state
                        await self.port.drop_intent(state.namespace, state.name, intent)
                    return
            await self._record(decision, info, now, "evict", str(outcome), message)
            reached(FaultPoint.REMEDIATION_RECORDED)
            is_ok = outcome in (EvictionOutcome.EVICTED, EvictionOutcome.POD_GONE)
            reason = {
                EvictionOutcome.EVICTED: "PodEvicted",
                EvictionOutcome.POD_GONE: "PodGone",
                EvictionOutcome.PDB_BLOCKED: "EvictionBlocked",
                EvictionOutcome.FAILED: "EvictionFailed",
            }[outcome]
            await self._event(server_key, "Normal" if is_ok else "Warning", reason, message)
            reached(FaultPoint.REMEDIATION_EVENT_POSTED)

    async def _skipped(
        self,
        decision: Decision,
        alert: WebhookAlert,
        info: ServerInfo | None,
        now: datetime,
        is_delivery: bool,
    ) -> None:
        if not decision.is_retryable:
            self.store.settle(alert)
            if alert.status == "resolved":
                self.store.resolved(alert.key, now)
            if decision.reason in (SkipReason.UNKNOWN_POD, SkipReason.NOT_OWNED):
                logger.warning("ignoring %s: %s", decision.alert, decision.message)
            else:
                logger.info("not acting on %s: %s", decision.alert, decision.message)
            return
        self.store.defer(alert, now, is_delivery)
        reason = decision.reason
        message = f"{decision.alert}: {reason}: {decision.message}"
        # Once per firing and reason (its retries' details may change, e.g. the pods down),
        # and not again for a new firing of the series deferred exactly as before.
        is_new = reason in RECORDED_SKIPS and self.store.note_once(decision.key, str(reason))
        if is_new and self.store.note_deferral(decision.key[0], message):
            await self._record(decision, info, now, "skip", "skipped", message)
            reached(FaultPoint.REMEDIATION_DEFERRAL_RECORDED)
            server_key = (decision.namespace, decision.server or "")
            await self._event(server_key, "Normal", "RemediationDeferred", message)

    async def _record(
        self,
        decision: Decision,
        info: ServerInfo | None,
        now: datetime,
        action: RemediationAction,
        outcome: str,
        message: str,
    ) -> None:
        if info is None:
            return
        record = self._make_record(decision, now, action, outcome, message)
        count_remediation(info.state.namespace, info.state.name, record)
        server = (info.state.namespace, info.state.name)
        await self._append(UnwrittenRecord(server, record, info.state.remediation.history_limit))

    @staticmethod
    def _make_record(
        decision: Decision,
        now: datetime,
        action: RemediationAction,
        outcome: str,
        message: str,
    ) -> RemediationRecord:
        return RemediationRecord(
            time=now,
            pod=decision.pod,
            alert=decision.alert,
            action=action,
            outcome=outcome,
            message=message[:MAX_MESSAGE_LENGTH],
            fingerprint=decision.key[0],
            alertStartsAt=decision.key[1],
        )

    async def _append(self, entry: UnwrittenRecord) -> bool:
        """Append one record to status; one the API could not take now waits in the store for
        the next batch or retry (its action is done and must stay on record). Whether written."""
        (namespace, name), record = entry.server, entry.record
        try:
            await self.port.append_history(namespace, name, record, entry.limit)
        except Exception as error:
            if is_permanent(error):
                raise
            logger.warning(
                "%s/%s: history record of %s on %s not written yet: %s",
                namespace, name, record.alert, record.pod, describe(error),
            )  # fmt: skip
            self.store.unwritten.append(entry)
            return False
        return True

    async def _write_unwritten(self) -> None:
        """Write the records a failed status write left, oldest first; stop at a failure."""
        pending, self.store.unwritten = self.store.unwritten, []
        for index, entry in enumerate(pending):
            try:
                is_written = await self._append(entry)
            except Exception as error:  # permanent (`_append` keeps the others): never passes
                logger.error("history record of %s dropped: %s", entry.record.pod, describe(error))
                continue
            if not is_written:
                self.store.unwritten.extend(pending[index + 1 :])
                return

    async def _event(self, server: ServerKey, type_: EventType, reason: str, message: str) -> None:
        namespace, name = server
        if name:
            await self.port.emit_event(namespace, name, type_, reason, message[:MAX_MESSAGE_LENGTH])
