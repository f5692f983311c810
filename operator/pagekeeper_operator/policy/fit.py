"""Whether a server's policy fits its GPUs before anything rolls out (pure).

The plan (`pagekeeper_memplan.plan`) needs two facts the spec may not state:

- the model's shape: the given config.json (the CLI's `--model-config`), else
  `spec.model.architecture`, else the catalogue entry the source's name matches;
- the GPU: the CLI's `--gpu` / `--gpu-memory`, else the smallest GPU among the candidate nodes
  (those whose labels match the pod's nodeSelector, `spec.resources.gpuType` included) that
  carry NVIDIA GPU feature discovery labels, else `spec.resources.gpuMemory`, else the product
  `spec.resources.gpuType` names.

Either missing, the plan is Unknown and never blocks: a false refusal would be worse than the
crash-loop it prevents. The pod's host memory (`host_memory`) needs neither: it does not fit
when the pod's memory limit is below it, or no candidate node's `status.allocatable.memory`
holds it (none reporting one: not checked), whatever the GPU plan says; it is judged only
where the policy pins host memory. A plan that does not fit holds the rollout
(`hold_rollout`): the running Deployment keeps its pod template, and a new server gets no
Deployment until its spec fits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagekeeper_memplan.gpus import (
    PRODUCT_LABEL,
    GpuModel,
    gpu_from_labels,
    parse_product,
    smallest,
)
from pagekeeper_memplan.plan import ESTIMATED_TERMS, MemoryPlan, PlanInputs, plan_memory
from pagekeeper_memplan.shape import ModelShape, ShapeError, catalogue_key, known_shape, parse_shape
from pagekeeper_operator.api.llmserver import LLMServer
from pagekeeper_operator.api.memory_plan import (
    HostPlanStatus,
    HostTerms,
    MemoryPlanStatus,
    PlanTerms,
)
from pagekeeper_operator.api.policy import MemoryPolicy
from pagekeeper_operator.api.status import ConditionStatus
from pagekeeper_operator.api.types import quantity_value
from pagekeeper_operator.policy.host_memory import judge_pod

POLICY_FITS = "PolicyFits"
GiB = 1 << 30
HELD = "the rollout is held (running pods keep their template)"


@dataclass(frozen=True)
class FitOutcome:
    """The plan's status, the PolicyFits condition, and whether the rollout is held."""

    status: MemoryPlanStatus
    condition: tuple[ConditionStatus, str, str]  # status, reason, message
    plan: MemoryPlan | None = None

    @property
    def holds_rollout(self) -> bool:
        return self.status.state == "DoesNotFit"


def node_selector(server: LLMServer) -> dict[str, str]:
    """The pod's nodeSelector, as `render.workload` writes it."""
    selector = dict(server.spec.pod_template.node_selector)
    if server.spec.resources.gpu_type is not None:
        selector[PRODUCT_LABEL] = server.spec.resources.gpu_type
    return selector


def _labels(node: Mapping[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = (node.get("metadata") or {}).get("labels") or {}
    return labels


def _matches(server: LLMServer, node: Mapping[str, Any]) -> bool:
    labels = _labels(node)
    return all(labels.get(key) == value for key, value in node_selector(server).items())


def host_candidates(
    server: LLMServer, nodes: Sequence[Mapping[str, Any]] | None
) -> list[Mapping[str, Any]]:
    """The nodes whose memory may hold the pod: those the nodeSelector admits, and of a GPU
    server, those with feature-discovery GPU labels where any has them."""
    admitted = [node for node in nodes or [] if _matches(server, node)]
    if server.spec.num_gpus == 0:
        return admitted
    with_gpus = [n for n in admitted if gpu_from_labels(_labels(n)) is not None]
    return with_gpus or admitted


def host_fit(
    server: LLMServer, policy: MemoryPolicy, nodes: Sequence[Mapping[str, Any]] | None
) -> tuple[HostPlanStatus, tuple[ConditionStatus, str, str] | None, str | None, int]:
    """status.memoryPlan.host, and where the pod's host memory does not fit: the PolicyFits
    condition, the term to shrink and the bytes missing."""
    plan, memory, allocatable, verdict = judge_pod(server, policy, host_candidates(server, nodes))
    terms = plan.terms
    status = HostPlanStatus(
        per_pod=HostTerms(
            kv_offload=terms["kvOffload"],
            swap_space=terms["swapSpace"],
            cpu_offload=terms["cpuOffload"],
            shared_memory=terms["sharedMemory"],
            processes=terms["processes"],
        ),
        total=plan.total,
        memory_request=memory.request,
        memory_limit=memory.limit,
        node_allocatable=None if allocatable is None else allocatable[0],
        node=None if allocatable is None else allocatable[1],
    )
    if verdict.fits:
        return status, None, None, 0
    condition: tuple[ConditionStatus, str, str] = (
        "False",
        verdict.reason,
        f"{verdict.message}; {HELD}",
    )
    return status, condition, verdict.term, verdict.shortfall


def candidate_gpu(
    server: LLMServer, nodes: Sequence[Mapping[str, Any]] | None
) -> tuple[GpuModel | None, str]:
    """The GPU the plan assumes, and where it came from (or why there is none)."""
    selector = node_selector(server)
    found: list[tuple[GpuModel, str]] = []
    for node in nodes or []:
        metadata = node.get("metadata") or {}
        labels: dict[str, str] = metadata.get("labels") or {}
        if any(labels.get(key) != value for key, value in selector.items()):
            continue
        gpu = gpu_from_labels(labels)
        if gpu is not None:
            found.append((gpu, str(metadata.get("name", ""))))
    least = smallest([gpu for gpu, _ in found])
    if least is not None:
        name = next(n for gpu, n in found if gpu == least)
        return least, (
            f"the smallest GPU of {len(found)} candidate node(s)' feature-discovery labels "
            f"(node {name})"
        )
    resources = server.spec.resources
    product = parse_product(resources.gpu_type) if resources.gpu_type else None
    if resources.gpu_memory is not None:
        memory = int(quantity_value(resources.gpu_memory))
        capability = None if product is None else product.capability
        name = resources.gpu_type or f"a GPU of {resources.gpu_memory}"
        return GpuModel(name, memory, capability), "spec.resources.gpuMemory"
    if product is not None:
        return product, "spec.resources.gpuType"
    return None, (
        "no candidate node carries nvidia.com/gpu.product or nvidia.com/gpu.memory, and "
        "spec.resources.gpuMemory is unset"
    )


def model_shape(
    server: LLMServer, config: Mapping[str, Any] | None = None
) -> tuple[ModelShape | None, str]:
    """The model's shape and where it came from (or why there is none). ShapeError for a
    config or an architecture the plan cannot read."""
    if config is not None:
        return parse_shape(dict(config)), "the given config.json"
    architecture = server.spec.model.architecture
    if architecture is not None:
        return (
            parse_shape(architecture.config_json(), source="spec.model.architecture"),
            "spec.model.architecture",
        )
    source = server.spec.model.source
    shape = known_shape(source)
    if shape is not None:
        return shape, f"the catalogue's {catalogue_key(source)}"
    return None, (
        f"the operator's catalogue does not know {source!r} and spec.model.architecture is unset"
    )


def plan_inputs(server: LLMServer, policy: MemoryPolicy) -> PlanInputs:
    """The plan's inputs from a server and its effective policy."""
    weights = policy.weight_policy
    buffer = policy.fragmentation_buffer
    return PlanInputs(
        tp=server.spec.parallelism.tensor,
        dtype=server.spec.model.dtype,
        quantization=weights.quantization,
        cpu_offload_bytes=int(weights.cpu_offload_gib * GiB),
        kv_cache_dtype=policy.kv_cache_dtype,
        block_size=policy.block_size,
        max_num_batched_tokens=policy.max_num_batched_tokens,
        max_num_seqs=policy.max_num_seqs,
        max_model_len=policy.max_model_len,
        enable_chunked_prefill=policy.enable_chunked_prefill,
        gpu_memory_utilization=policy.effective_utilization,
        kv_cache_memory=policy.kv_cache_memory_bytes,
        fragmentation_buffer=buffer if buffer == "auto" else int(quantity_value(buffer)),
        has_host_tier=policy.kv_offload is not None,
    )


def _unknown(reason: str, message: str) -> FitOutcome:
    return FitOutcome(
        MemoryPlanStatus(state="Unknown", message=message), ("Unknown", reason, message)
    )


def decide_fit(
    server: LLMServer,
    policy: MemoryPolicy,
    nodes: Sequence[Mapping[str, Any]] | None,
    *,
    config: Mapping[str, Any] | None = None,
    gpu: tuple[GpuModel, str] | None = None,
) -> FitOutcome:
    """The plan of `policy` for `server` on its candidate `nodes` (or the given `gpu` and
    `config`), as status and the PolicyFits condition: the GPU's verdict where it does not
    fit, else the host's where that does not."""
    gpu_fit = _decide_gpu_fit(server, policy, nodes, config=config, gpu=gpu)
    host, condition, term, shortfall = host_fit(server, policy, nodes)
    status = gpu_fit.status.model_copy(update={"host": host})
    if condition is None or gpu_fit.status.state == "DoesNotFit":
        return FitOutcome(status, gpu_fit.condition, gpu_fit.plan)
    message = condition[2].removesuffix(f"; {HELD}")
    status = status.model_copy(
        update={"state": "DoesNotFit", "message": message, "term": term, "shortfall": shortfall}
    )
    return FitOutcome(status, condition, gpu_fit.plan)


def _decide_gpu_fit(
    server: LLMServer,
    policy: MemoryPolicy,
    nodes: Sequence[Mapping[str, Any]] | None,
    *,
    config: Mapping[str, Any] | None,
    gpu: tuple[GpuModel, str] | None,
) -> FitOutcome:
    """The GPU plan's outcome (the module docstring's two facts)."""
    if server.spec.num_gpus == 0:
        return _unknown("RunsOnCPU", "the server runs on the CPU: no GPU memory to plan")
    try:
        shape, model_source = model_shape(server, config)
    except ShapeError as exc:
        return _unknown("ModelShapeInvalid", str(exc))
    if shape is None:
        return _unknown("ModelShapeUnknown", model_source)
    assumed, gpu_source = gpu if gpu is not None else candidate_gpu(server, nodes)
    if assumed is None:
        return _unknown("GPUUnknown", gpu_source)
    plan = plan_memory(shape, plan_inputs(server, policy), assumed)
    verdict = plan.verdict
    terms = plan.terms
    status = MemoryPlanStatus(
        state="Fits" if verdict.fits else "DoesNotFit",
        message=verdict.message,
        term=verdict.term,
        shortfall=verdict.shortfall if not verdict.fits else None,
        gpu=assumed.name,
        gpu_memory=assumed.memory_bytes,
        gpu_source=gpu_source,
        model=model_source,
        tensor=plan.tp,
        per_rank=PlanTerms(
            weights=terms["weights"],
            activations=terms["activations"],
            cuda_graphs=terms["cudaGraphs"],
            non_torch=terms["nonTorch"],
            fragmentation_buffer=terms["fragmentationBuffer"],
            kv_cache=terms["kvCache"],
        ),
        allowed=plan.allowed,
        estimated_terms=list(ESTIMATED_TERMS),
        num_kv_blocks=plan.num_blocks,
        kv_tokens=plan.kv_tokens,
        max_concurrent_sequences=plan.max_concurrent_sequences,
    )
    if verdict.fits:
        return FitOutcome(status, ("True", verdict.reason, verdict.message), plan)
    return FitOutcome(status, ("False", verdict.reason, f"{verdict.message}; {HELD}"), plan)


def hold_rollout(
    desired: list[dict[str, Any]], running: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """The objects to apply while the spec does not fit: the Deployment keeps the running pod
    template (so nothing rolls), or is left out when none runs yet."""
    held: list[dict[str, Any]] = []
    for manifest in desired:
        if manifest.get("kind") != "Deployment" or manifest.get("apiVersion") != "apps/v1":
            held.append(manifest)
        elif running is not None:
            spec = {**manifest["spec"], "template": running["spec"]["template"]}
            held.append({**manifest, "spec": spec})
    return held
