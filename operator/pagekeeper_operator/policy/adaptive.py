"""Adaptive memory policy: classify out-of-memory terminations, step the effective policy down.

The engine reports a classified out-of-memory exit on its termination message
(`/dev/termination-log`, read by the kubelet into `state.terminated.message`), one line of the
form (`TERMINATION_MESSAGE_FORMAT`)::

    pagekeeper-oom kind=<gpu|host> phase=<startup|runtime> detail=<free text to end of line>

`kind` says which memory ran out; `phase` whether it happened while loading and profiling
(start-up) or while serving (run-time). Other lines may surround it; the last such line counts.
A container the kernel killed for its memory limit has reason `OOMKilled` and no message (it
got SIGKILL): that is a host OOM of unknown phase.

Each side steps down on its own, never the other's. A run-time GPU OOM lowers the GPU terms
(`step_down`): first gpuMemoryUtilization by `utilizationStep` toward its floor, then (at the
floor) maxNumBatchedTokens by the `maxNumBatchedTokensStep` factor toward its floor. Under a KV
byte budget (`kvCacheMemory`) there is no utilization to lower: maxNumBatchedTokens steps down at
once. A GPU start-up OOM means the model does not fit the budget at all; lowering the budget
will not help it, so it is only reported. A host OOM, the kubelet's OOMKilled above all, shrinks
the host KV tier (`step_down_host`): kvOffload.size by the `kvOffloadStep` factor, and off once
it would fall below `minKvOffloadSize`; without a tier there is no host term the operator owns
(swap and CPU weight offload change what the pod can serve), so it is reported only. The result
is written to status, never to spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pagekeeper_operator.api.remediation import AdaptiveSpec
from pagekeeper_operator.api.types import quantity_value

TERMINATION_MESSAGE_PREFIX = "pagekeeper-oom"
TERMINATION_MESSAGE_FORMAT = (
    "pagekeeper-oom kind=<gpu|host> phase=<startup|runtime> detail=<free text to end of line>"
)
_LINE_RE = re.compile(
    r"^pagekeeper-oom kind=(?P<kind>gpu|host) phase=(?P<phase>startup|runtime)"
    r"(?: detail=(?P<detail>.*))?$"
)
OOM_KILLED_REASON = "OOMKilled"
# Fractions are kept to this many decimals so repeated steps do not accumulate float noise.
UTILIZATION_DECIMALS = 4

Device = Literal["gpu", "host"]
Phase = Literal["startup", "runtime", "unknown"]


@dataclass(frozen=True)
class OOMClassification:
    """Which memory ran out, and when."""

    device: Device
    phase: Phase
    detail: str

    @property
    def label(self) -> str:
        """`gpu-runtime`, `gpu-startup`, `host-unknown`, ...: for status and history."""
        return f"{self.device}-{self.phase}"

    @property
    def condition_reason(self) -> str:
        """CamelCase reason for the MemoryHealthy condition."""
        where = {"startup": "AtStartup", "runtime": "AtRuntime", "unknown": ""}[self.phase]
        return f"{'GPU' if self.device == 'gpu' else 'Host'}OutOfMemory{where}"

    @property
    def can_step_down(self) -> bool:
        """Whether its side has a term to lower: the GPU's after a run-time OOM (a start-up one
        does not fit at all), the host tier after any host OOM (the tier is pinned at start)."""
        return self.device == "host" or self.phase == "runtime"

    @property
    def is_memory(self) -> bool:
        return True


# The engine's stuck line (`pagekeeper_engine/stuck.py`'s STUCK_LINE, pinned from both sides by
# tests/operator/test_adaptive.py): the paged engine's progress watchdog and the vLLM launcher's
# probe end a pod whose engine stopped making progress with it.
_STUCK_RE = re.compile(
    r"^pagekeeper-stuck last_step_age_s=(?P<age>\d+(?:\.\d+)?) running=(?P<running>\d+) "
    r"waiting=(?P<waiting>\d+) detail=(?P<detail>.*)$"
)


@dataclass(frozen=True)
class StuckClassification:
    """An engine ended for making no progress: counted like an OOM by the canary and the
    remediation history, never a reason to step memory down (memory was not the problem)."""

    last_step_age_s: float
    num_running: int
    num_waiting: int
    detail: str

    label = "stuck"
    condition_reason = "EngineStuck"
    can_step_down = False
    is_memory = False


Termination = OOMClassification | StuckClassification


def classify_failure(reason: str | None, message: str | None) -> Termination | None:
    """An out-of-memory termination (`classify_termination`), else a stuck one, else None. Both
    lines may stand in one message (a vLLM that printed an OOM before its probe found it
    stuck): the OOM wins, so memory still steps down."""
    oom = classify_termination(reason, message)
    if oom is not None:
        return oom
    for line in reversed((message or "").splitlines()):
        match = _STUCK_RE.match(line.strip())
        if match is not None:
            return StuckClassification(
                float(match["age"]), int(match["running"]), int(match["waiting"]),
                match["detail"].strip(),
            )  # fmt: skip
    return None


def classify_termination(reason: str | None, message: str | None) -> OOMClassification | None:
    """Classify a container's termination; None when it was not out of memory."""
    for line in reversed((message or "").splitlines()):
        match = _LINE_RE.match(line.strip())
        if match is not None:
            kind: Device = "gpu" if match["kind"] == "gpu" else "host"
            phase: Phase = "startup" if match["phase"] == "startup" else "runtime"
            return OOMClassification(kind, phase, (match["detail"] or "").strip())
    if reason == OOM_KILLED_REASON:
        return OOMClassification("host", "unknown", "the container exceeded its memory limit")
    return None


def _floor_of_batched_tokens(policy: dict[str, Any], adaptive: AdaptiveSpec) -> int:
    # The CRD's own rules bound it too: maxNumSeqs <= maxNumBatchedTokens, and without chunked
    # prefill a whole max-model-len prompt must fit one step.
    floor = max(adaptive.min_max_num_batched_tokens, int(policy.get("maxNumSeqs", 1)))
    max_model_len = policy.get("maxModelLen")
    if max_model_len is not None and not policy.get("enableChunkedPrefill", True):
        floor = max(floor, int(max_model_len))
    return floor


def step_down(
    effective_policy: dict[str, Any], adaptive: AdaptiveSpec
) -> tuple[dict[str, Any], str] | None:
    """The next, smaller effective policy (camelCase, as in status) and why; None at the floors.

    Call after a run-time GPU OOM (`OOMClassification.can_step_down`).
    """
    if not adaptive.enabled:
        return None
    floor = adaptive.min_gpu_memory_utilization
    utilization = effective_policy.get("gpuMemoryUtilization")
    if utilization is not None and float(utilization) > floor:
        utilization = float(utilization)
        lowered = max(floor, round(utilization - adaptive.utilization_step, UTILIZATION_DECIMALS))
        reason = (
            f"gpuMemoryUtilization {utilization:g} -> {lowered:g} after a run-time GPU "
            f"out-of-memory crash (floor {floor:g})"
        )
        return {**effective_policy, "gpuMemoryUtilization": lowered}, reason
    tokens = int(effective_policy["maxNumBatchedTokens"])
    tokens_floor = _floor_of_batched_tokens(effective_policy, adaptive)
    lowered_tokens = max(tokens_floor, int(tokens * adaptive.max_num_batched_tokens_step))
    if lowered_tokens >= tokens:
        return None
    budget = (
        f"gpuMemoryUtilization at its floor {floor:g}"
        if utilization is not None
        else "a kvCacheMemory budget"
    )
    reason = (
        f"maxNumBatchedTokens {tokens} -> {lowered_tokens} after a run-time GPU out-of-memory "
        f"crash ({budget}; token floor {tokens_floor})"
    )
    return {**effective_policy, "maxNumBatchedTokens": lowered_tokens}, reason


_GIB = 1 << 30
_MIB = 1 << 20


def quantity_text(num_bytes: int) -> str:
    """Bytes as a Kubernetes quantity, in whole GiB or MiB where exact (`12Gi`, `768Mi`)."""
    if num_bytes % _GIB == 0:
        return f"{num_bytes // _GIB}Gi"
    if num_bytes % _MIB == 0:
        return f"{num_bytes // _MIB}Mi"
    return str(num_bytes)


def step_down_host(
    effective_policy: dict[str, Any], adaptive: AdaptiveSpec
) -> tuple[dict[str, Any], str] | None:
    """The policy (camelCase, as in status) with a smaller host KV tier, or none, and why; None
    where there is no tier to shrink. Call after a host OOM; GPU terms are never touched."""
    if not adaptive.enabled:
        return None
    tier = effective_policy.get("kvOffload")
    if tier is None:
        return None
    size = int(quantity_value(tier["size"]))
    floor = int(quantity_value(adaptive.min_kv_offload_size))
    # Whole MiB, so the flag's GiB stay short and a step never rounds up.
    shrunk = int(size * adaptive.kv_offload_step) // _MIB * _MIB
    if shrunk < floor or shrunk <= 0:
        reason = (
            f"kvOffload.size {tier['size']} -> off after a host out-of-memory kill "
            f"(the next step, {quantity_text(shrunk)}, is below minKvOffloadSize "
            f"{adaptive.min_kv_offload_size})"
        )
        return {**effective_policy, "kvOffload": None}, reason
    reason = (
        f"kvOffload.size {tier['size']} -> {quantity_text(shrunk)} after a host out-of-memory "
        f"kill (floor {adaptive.min_kv_offload_size}, then off)"
    )
    return {**effective_policy, "kvOffload": {**tier, "size": quantity_text(shrunk)}}, reason
