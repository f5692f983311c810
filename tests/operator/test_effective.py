"""The policy's layers: spec -> tuning layer -> step-down caps, composed by one function."""

from __future__ import annotations

from typing import Any

from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.policy.effective import compose, memory_policy_hash
from pagekeeper_operator.status.conditions import compute_status
from tests.operator.servers import make_server

NOW = "2026-11-29T01:00:00Z"


def promoted(field: str, value: str, spec_value: str) -> dict[str, Any]:
    return {"field": field, "value": value, "specValue": spec_value, "source": "Promoted",
            "rule": "r", "time": NOW}  # fmt: skip


def with_status(server: LLMServer, **status: Any) -> LLMServer:
    merged = {**server.status.to_api(), **status}
    return server.model_copy(update={"status": type(server.status).model_validate(merged)})


def reconciled(server: LLMServer) -> LLMServer:
    """The server after status is written from its composition (what a reconcile does)."""
    return server.model_copy(update={"status": compute_status(server, None, NOW)})


def test_the_spec_alone() -> None:
    server = make_server({"memoryPolicy": {"gpuMemoryUtilization": 0.85}})
    effective = compose(server)
    assert effective.policy == server.spec.memory_policy.with_budget_resolved()
    assert (effective.changes, effective.step_down) == ((), None)


def test_a_tuned_change_holds_while_spec_keeps_the_value_it_was_made_over() -> None:
    server = make_server()
    tuned = with_status(
        server, tuning={"changes": [promoted("enablePrefixCaching", "false", "true")]}
    )
    assert compose(tuned).policy.enable_prefix_caching is False
    assert [c.field for c in compose(tuned).changes] == ["enablePrefixCaching"]
    # Carried into Git (spec now false) or changed otherwise: the layer's change lapses.
    spec = tuned.spec.model_copy(
        update={"memory_policy": MemoryPolicy(enable_prefix_caching=False, max_num_seqs=128)}
    )
    moved = tuned.model_copy(update={"spec": spec})
    assert compose(moved).changes == ()
    assert compose(moved).policy == spec.memory_policy.with_budget_resolved()


def test_a_tuned_change_outside_the_bounds_is_not_run() -> None:
    server = make_server({"tuning": {"bounds": {"maxNumSeqs": {"min": 128, "max": 256}}}})
    tuned = with_status(server, tuning={"changes": [promoted("maxNumSeqs", "512", "256")]})
    assert compose(tuned).policy.max_num_seqs == 256
    assert compose(tuned).changes == ()
    fp8 = with_status(server, tuning={"changes": [promoted("kvCacheDtype", "fp8", "auto")]})
    assert compose(fp8).policy.kv_cache_dtype == "auto"  # allowFp8Kv is off


def test_a_step_down_written_by_remediation_becomes_caps_over_the_tuned_policy() -> None:
    server = make_server()
    tuned = reconciled(
        with_status(server, tuning={"changes": [promoted("gpuMemoryUtilization", "0.95", "0.9")]})
    )
    assert tuned.status.effective_memory_policy is not None
    assert tuned.status.effective_memory_policy.gpu_memory_utilization == 0.95
    # Remediation steps the composed policy down (status only, without policyHash).
    lowered = tuned.status.effective_memory_policy.model_copy(
        update={"gpu_memory_utilization": 0.9}
    )
    stepped = with_status(tuned, effectiveMemoryPolicy=lowered.to_api())
    effective = compose(stepped)
    assert effective.policy.gpu_memory_utilization == 0.9
    assert effective.step_down is not None
    assert effective.step_down.gpu_memory_utilization == 0.9
    assert effective.step_down.max_num_batched_tokens is None
    # Once status records the caps, they hold on every later composition.
    again = reconciled(stepped)
    assert again.status.tuning is not None and again.status.tuning.step_down is not None
    assert compose(again).policy.gpu_memory_utilization == 0.9
    assert compose(reconciled(again)).policy.gpu_memory_utilization == 0.9


def test_a_promoted_rise_is_not_mistaken_for_a_step_down() -> None:
    server = reconciled(make_server())
    raised = with_status(
        server,
        tuning={"changes": [promoted("gpuMemoryUtilization", "0.95", "0.9")]},
    )
    assert compose(raised).policy.gpu_memory_utilization == 0.95
    assert compose(raised).step_down is None


def test_a_step_down_from_before_the_layers_is_kept() -> None:
    server = make_server()
    legacy = with_status(
        server,
        effectiveMemoryPolicy=MemoryPolicy(gpu_memory_utilization=0.8).to_api(),
        specMemoryPolicyHash=memory_policy_hash(server.spec.memory_policy),
        policyHash=memory_policy_hash(MemoryPolicy(gpu_memory_utilization=0.8)),
    )
    assert compose(legacy).policy.gpu_memory_utilization == 0.8


def test_a_step_down_from_before_the_layers_survives_the_tuners_first_status() -> None:
    server = make_server()
    stepped = MemoryPolicy(gpu_memory_utilization=0.8)
    legacy = with_status(
        server,
        effectiveMemoryPolicy=stepped.to_api(),
        specMemoryPolicyHash=memory_policy_hash(server.spec.memory_policy),
        policyHash=memory_policy_hash(stepped),
        tuning={"day": "2026-11-29", "message": "the window supports no change"},
    )
    assert compose(legacy).policy.gpu_memory_utilization == 0.8
    assert compose(reconciled(reconciled(legacy))).policy.gpu_memory_utilization == 0.8


def test_a_spec_change_drops_the_caps() -> None:
    server = make_server()
    stepped = reconciled(
        with_status(
            server,
            effectiveMemoryPolicy=MemoryPolicy(max_num_batched_tokens=4096).to_api(),
            specMemoryPolicyHash=memory_policy_hash(server.spec.memory_policy),
        )
    )
    assert compose(stepped).policy.max_num_batched_tokens == 4096
    spec = stepped.spec.model_copy(update={"memory_policy": MemoryPolicy(block_size=32)})
    edited = stepped.model_copy(update={"spec": spec})
    assert compose(edited).policy == MemoryPolicy(block_size=32, gpu_memory_utilization=0.9)
    assert compose(edited).step_down is None
