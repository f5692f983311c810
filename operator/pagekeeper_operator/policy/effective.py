"""The memory policy pods actually run with: the spec and the layers over it, and its hash.

`spec.memoryPolicy` is what a person (or Git) declared; the operator never writes it. `compose`
is the one function that builds what pods run (docs/memory-policy.md, "The layers"):

1. the spec;
2. the tuning layer (`status.tuning.changes`): recommendations accepted by annotation or
   promoted by a canary. A change holds while spec's value of its field is still the one it was
   made over (`specValue`) and its value is inside `spec.tuning.bounds`; it lapses once spec's
   value changes, for instance when it is carried into Git; enablePrefixCaching is not tuned
   while spec.gateway.kvEvents is enabled (a KV-aware router reads the cache's blocks);
3. the adaptive step-down layer (`status.tuning.stepDown`): caps on gpuMemoryUtilization and
   maxNumBatchedTokens after run-time GPU OOMs, and on kvOffload.size (0: off) after host OOM
   kills, made under one spec (its hash) and dropped when the spec changes.

Remediation steps down by writing `status.effectiveMemoryPolicy` (the composed policy, lowered)
without `status.policyHash`; a stored policy whose hash differs from `policyHash` is therefore a
step-down not yet folded into the caps, and its lower values become caps. Without a tuning
layer, any stored value below the spec's is a step-down. The renderer, the
canary, the tuner and status all read `compose`'s result, never re-derive it: a reconcile
composes once and hands the `EffectivePolicy` down (render, the memory plan, status); while a
tuning trial runs it also carries the trial's candidate (`EffectivePolicy.rendered`).
Callers reach `compose` as this module's attribute (`effective.compose`), never a name imported
from it, so that a test can count the compositions of one reconcile.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import AllocatorPolicy, MemoryPolicy
from pagekeeper_operator.api.tuning import StepDownCaps, TunedChange, TuningTrial
from pagekeeper_operator.api.types import quantity_value
from pagekeeper_operator.policy.fields import (
    fields_fixed_by,
    read_field,
    with_change,
    within_bounds,
)

HASH_LENGTH = 16


# Fields added after servers existed: left out of the hash while unset, so those servers keep
# their hash (and their pods) across an operator upgrade.
_HASHED_WHEN_SET = ("kvCacheMemory", "weights")


def memory_policy_hash(policy: MemoryPolicy) -> str:
    """A short, stable hash of a policy's values (key order and defaults do not matter; an
    unset gpuMemoryUtilization hashes as the 0.9 it means)."""
    values = policy.with_budget_resolved().model_dump(by_alias=True, mode="json")
    for name in _HASHED_WHEN_SET:
        if values.get(name) is None:
            values.pop(name, None)
    text = json.dumps(values, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LENGTH]


@dataclass(frozen=True)
class EffectivePolicy:
    """The composed policy and the layers that made it, each as it still holds."""

    policy: MemoryPolicy  # what status records
    changes: tuple[TunedChange, ...]  # the tuning layer's changes in force
    step_down: StepDownCaps | None  # the step-down layer's caps in force
    # While a tuning trial runs: the layers with the trial's change in the tuning layer.
    trial_policy: MemoryPolicy | None = None

    @property
    def rendered(self) -> MemoryPolicy:
        """What the rendered pods run: the trial's candidate while a trial runs, else `policy`
        (the canary then runs the candidate beside the stable pods, `canary`)."""
        return self.policy if self.trial_policy is None else self.trial_policy


def changes_with_trial(server: LLMServer, trial: TuningTrial) -> list[TunedChange]:
    """The tuning layer with `trial`'s change in place of its field's change (in memory only;
    status records the trial, not this layer): made over the spec value of the field's change
    in force, if any, else over spec's value."""
    tuning = server.status.tuning
    changes = tuning.changes if tuning is not None else []
    from_spec = next((c.spec_value for c in changes if c.field == trial.field), None)
    change = TunedChange(
        field=trial.field,
        value=trial.proposed,
        spec_value=read_field(server.spec.memory_policy, trial.field)
        if from_spec is None
        else from_spec,
        source="Promoted",
        rule=trial.rule,
        time=trial.started_at,
    )
    return [c for c in changes if c.field != trial.field] + [change]


def _tuning_layer(
    server: LLMServer, changes: Sequence[TunedChange]
) -> tuple[MemoryPolicy, tuple[TunedChange, ...]]:
    spec = server.spec
    policy = spec.memory_policy.with_budget_resolved()
    kept: list[TunedChange] = []
    fixed = fields_fixed_by(spec.gateway)
    for change in changes:
        if read_field(spec.memory_policy, change.field) != change.spec_value:
            continue  # spec moved on: the spec's new value wins
        if not within_bounds(change.field, change.value, spec.tuning.bounds, spec.runtime):
            continue
        if change.field in fixed:
            continue
        try:
            policy = with_change(policy, change.field, change.value)
        except ValueError:
            continue
        kept.append(change)
    return policy, tuple(kept)


def _caps(
    server: LLMServer, base: MemoryPolicy, spec_hash: str, has_layer: bool
) -> StepDownCaps | None:
    status = server.status
    recorded = status.tuning.step_down if status.tuning is not None else None
    if recorded is not None and recorded.spec_memory_policy_hash != spec_hash:
        recorded = None
    stored = status.effective_memory_policy
    if stored is None or status.spec_memory_policy_hash != spec_hash:
        return recorded
    # Without a tuning layer the base is the spec, so a stored value below it can only be a
    # step-down (also one recorded before the layers existed); with one, only a stored policy
    # remediation wrote since status last recorded the composition (no policyHash) is new.
    is_new_step = not has_layer or memory_policy_hash(stored) != status.policy_hash
    if not is_new_step:
        return recorded
    capped = _apply_caps(base, recorded)
    utilization = recorded.gpu_memory_utilization if recorded else None
    tokens = recorded.max_num_batched_tokens if recorded else None
    tier = recorded.kv_offload_size if recorded else None
    stored_utilization = stored.with_budget_resolved().gpu_memory_utilization
    if (
        stored_utilization is not None
        and capped.gpu_memory_utilization is not None
        and stored_utilization < capped.gpu_memory_utilization
    ):
        utilization = stored_utilization
    if stored.max_num_batched_tokens < capped.max_num_batched_tokens:
        tokens = stored.max_num_batched_tokens
    if capped.kv_offload is not None and _tier_bytes(stored) < capped.kv_offload.size_bytes:
        tier = stored.kv_offload.size if stored.kv_offload is not None else "0"
    if utilization is None and tokens is None and tier is None:
        return None
    return StepDownCaps(
        gpu_memory_utilization=utilization,
        max_num_batched_tokens=tokens,
        kv_offload_size=tier,
        spec_memory_policy_hash=spec_hash,
    )


def _tier_bytes(policy: MemoryPolicy) -> int:
    return policy.kv_offload.size_bytes if policy.kv_offload is not None else 0


def _apply_caps(policy: MemoryPolicy, caps: StepDownCaps | None) -> MemoryPolicy:
    if caps is None:
        return policy
    update: dict[str, Any] = {}
    # Under kvCacheMemory there is no utilization to cap (the step-down lowers tokens then).
    if caps.gpu_memory_utilization is not None and policy.gpu_memory_utilization is not None:
        update["gpu_memory_utilization"] = min(
            policy.gpu_memory_utilization, caps.gpu_memory_utilization
        )
    if caps.max_num_batched_tokens is not None:
        tokens = min(policy.max_num_batched_tokens, caps.max_num_batched_tokens)
        update["max_num_batched_tokens"] = tokens
        # maxNumSeqs <= maxNumBatchedTokens (the CRD's rule): the cap wins over a tuned count.
        update["max_num_seqs"] = min(policy.max_num_seqs, tokens)
    tier = policy.kv_offload
    if caps.kv_offload_size is not None and tier is not None:
        cap = quantity_value(caps.kv_offload_size)
        if cap <= 0:
            update["kv_offload"] = None
        elif cap < tier.size_bytes:
            update["kv_offload"] = tier.model_copy(update={"size": caps.kv_offload_size})
    return policy.model_copy(update=update)


def _layers(
    server: LLMServer, changes: Sequence[TunedChange], spec_hash: str
) -> tuple[MemoryPolicy, tuple[TunedChange, ...], StepDownCaps | None]:
    base, kept = _tuning_layer(server, changes)
    caps = _caps(server, base, spec_hash, has_layer=bool(changes))
    return _apply_caps(base, caps), kept, caps


def compose(server: LLMServer) -> EffectivePolicy:
    """spec -> tuning layer -> step-down caps (see the module docstring), and under a tuning
    trial the same with the trial's change in the tuning layer."""
    spec_hash = memory_policy_hash(server.spec.memory_policy)
    tuning = server.status.tuning
    changes = tuning.changes if tuning is not None else []
    policy, kept, caps = _layers(server, changes, spec_hash)
    trial_policy = None
    if tuning is not None and tuning.trial is not None:
        trying = changes_with_trial(server, tuning.trial)
        trial_policy, _, _ = _layers(server, trying, spec_hash)
    return EffectivePolicy(policy, kept, caps, trial_policy)


def effective_memory_policy(server: LLMServer) -> MemoryPolicy:
    """`compose(server).policy`, for tools and tests; a reconcile hands its composition down."""
    return compose(server).policy


def allocator_conf(allocator: AllocatorPolicy) -> str:
    """PYTORCH_CUDA_ALLOC_CONF text, e.g. `expandable_segments:True,max_split_size_mb:512`."""
    options = [f"expandable_segments:{allocator.expandable_segments}"]
    if allocator.garbage_collection_threshold is not None:
        options.append(f"garbage_collection_threshold:{allocator.garbage_collection_threshold}")
    if allocator.max_split_size_mb is not None:
        options.append(f"max_split_size_mb:{allocator.max_split_size_mb}")
    return ",".join(options)
