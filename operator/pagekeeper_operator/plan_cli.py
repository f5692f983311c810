"""`pagekeeper-plan`: the memory plan the operator would compute for a manifest, with no cluster.

    pagekeeper-plan -f llmserver.yaml [--gpu H100-80GB | --gpu-memory 80Gi]
                    [--model-config config.json] [--output text|json]

Every LLMServer in the file is validated as the API server would (schema and the same
cross-field rules) and planned by `fit.decide_fit`, the operator's own code: the GPU is the one
given, else the one `spec.resources.gpuMemory` or `spec.resources.gpuType` names; the model's
shape comes from `--model-config`, `spec.model.architecture` or the catalogue. The pod's host
memory is printed beside one rank's GPU terms (with no nodes, only the memory limit judges it).

Exit status: 0 when every server fits, 1 when one does not, 2 for bad input or a plan that is
unknown (no GPU or no model shape), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pagekeeper_memplan.gpus import GpuModel, parse_product
from pagekeeper_memplan.host import ESTIMATED_HOST_TERMS
from pagekeeper_memplan.plan import ESTIMATED_TERMS
from pagekeeper_operator.api.llmserver import KIND, LLMServer
from pagekeeper_operator.api.memory_plan import MemoryPlanStatus
from pagekeeper_operator.api.types import quantity_value
from pagekeeper_operator.policy import effective
from pagekeeper_operator.policy.fit import FitOutcome, decide_fit

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_UNKNOWN = 0, 1, 2
GiB = 1 << 30
TERM_NAMES = {
    "weights": "weights",
    "activations": "activations",
    "cuda_graphs": "cudaGraphs",
    "non_torch": "nonTorch",
    "fragmentation_buffer": "fragmentationBuffer",
    "kv_cache": "kvCache",
}


class InputError(Exception):
    """The command line or the manifest is unusable; the message says how."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagekeeper-plan",
        description="Print the memory plan of each LLMServer in a manifest and whether it fits.",
    )
    parser.add_argument("-f", "--filename", required=True, help="LLMServer manifest (YAML)")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", help="GPU product, e.g. H100-80GB or NVIDIA-H100-80GB-HBM3")
    gpu.add_argument("--gpu-memory", help="memory of one GPU as a quantity, e.g. 80Gi")
    parser.add_argument("--model-config", help="the model's config.json")
    parser.add_argument("--output", choices=("text", "json"), default="text")
    return parser


def load_servers(path: Path) -> list[LLMServer]:
    """The LLMServers of a manifest, validated as `kubectl apply` would have them validated."""
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: {exc}") from exc
    servers = []
    for document in documents:
        if not isinstance(document, dict) or document.get("kind") != KIND:
            continue
        try:
            servers.append(LLMServer.model_validate(document))
        except ValidationError as exc:
            raise InputError(f"{path}: {exc}") from exc
    if not servers:
        raise InputError(f"{path}: no {KIND} in the file")
    return servers


def given_gpu(args: argparse.Namespace) -> tuple[GpuModel, str] | None:
    if args.gpu:
        gpu = parse_product(args.gpu)
        if gpu is None:
            raise InputError(
                f"--gpu {args.gpu}: not a GPU product the plan knows; give --gpu-memory"
            )
        return gpu, f"--gpu {args.gpu}"
    if args.gpu_memory:
        try:
            memory = int(quantity_value(args.gpu_memory))
        except ValueError as exc:
            raise InputError(f"--gpu-memory {args.gpu_memory}: not a quantity") from exc
        return GpuModel(f"a GPU of {args.gpu_memory}", memory, None), "--gpu-memory"
    return None


def model_config(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"--model-config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise InputError(f"--model-config {path}: not a JSON object")
    return data


def plan_server(
    server: LLMServer, gpu: tuple[GpuModel, str] | None, config: dict[str, Any] | None
) -> FitOutcome:
    """The operator's plan of one server, with no nodes to read labels from."""
    return decide_fit(server, effective.compose(server).policy, None, config=config, gpu=gpu)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:9.2f} GiB"


HOST_TERM_NAMES = {
    "kv_offload": "kvOffload",
    "swap_space": "swapSpace",
    "cpu_offload": "cpuOffload",
    "shared_memory": "sharedMemory",
    "processes": "processes",
}


def host_lines(plan: MemoryPlanStatus) -> list[str]:
    """The pod's host memory: its terms, the memory request and limit, the node."""
    host = plan.host
    if host is None:
        return []
    lines = ["  host memory per pod"]
    for field, term in HOST_TERM_NAMES.items():
        mark = " *" if term in ESTIMATED_HOST_TERMS else ""
        value = getattr(host.per_pod, field)
        lines.append(f"    {term + mark:<22}{_gib(value)}  {value:>16,d} B")
    lines.append(f"    {'total':<22}{_gib(host.total)}")
    for what, value in (("request", host.memory_request), ("limit", host.memory_limit)):
        lines.append(f"    {'memory ' + what:<22}" + ("none" if value is None else _gib(value)))
    if host.node_allocatable is not None:
        lines.append(f"    {'node allocatable':<22}{_gib(host.node_allocatable)}  ({host.node})")
    lines.append("    * estimate (per process: docs/memory-policy.md, 'The host KV tier')")
    return lines


def render_text(server: LLMServer, fit: FitOutcome) -> str:
    """The plan as a table of one rank's terms and the pod's host memory, and the verdict."""
    name = f"{server.metadata.namespace}/{server.metadata.name}"
    plan: MemoryPlanStatus = fit.status
    if plan.per_rank is None or plan.gpu_memory is None:
        head = f"{name}: {plan.state}: {plan.message}"
        return "\n".join([head, *host_lines(plan)]) + "\n"
    lines = [
        f"{name}: {plan.model}, tensor {plan.tensor}, on {plan.gpu} "
        f"({plan.gpu_memory / GiB:.2f} GiB, from {plan.gpu_source})",
        "  per rank",
    ]
    for field, term in TERM_NAMES.items():
        mark = " *" if term in ESTIMATED_TERMS else ""
        value = getattr(plan.per_rank, field)
        lines.append(f"    {term + mark:<22}{_gib(value)}  {value:>16,d} B")
    lines.append(f"    {'budget (allowed)':<22}{_gib(plan.allowed or 0)}")
    lines.append("    * estimate (calibrated against the engine's start-up profile)")
    lines.append(
        f"  KV cache: {plan.num_kv_blocks} blocks, {plan.kv_tokens} tokens, "
        f"{plan.max_concurrent_sequences} maxModelLen sequences at once"
    )
    lines += host_lines(plan)
    verdict: str = plan.state
    if plan.term is not None:
        verdict += f" ({plan.term}, short by {(plan.shortfall or 0) / GiB:.2f} GiB)"
    lines.append(f"  {verdict}: {plan.message}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        servers = load_servers(Path(args.filename))
        gpu = given_gpu(args)
        config = model_config(args.model_config)
    except InputError as exc:
        print(f"pagekeeper-plan: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN
    code = EXIT_FITS
    results = []
    for server in servers:
        fit = plan_server(server, gpu, config)
        results.append(fit.status.to_api())
        if args.output == "text":
            sys.stdout.write(render_text(server, fit))
        if fit.status.state == "Unknown":
            hint = "; give --gpu or --gpu-memory" if fit.condition[1] == "GPUUnknown" else ""
            print(
                f"pagekeeper-plan: {server.metadata.name}: {fit.status.message}{hint}",
                file=sys.stderr,
            )
            code = max(code, EXIT_UNKNOWN)
        elif fit.status.state == "DoesNotFit":
            code = max(code, EXIT_DOES_NOT_FIT)
    if args.output == "json":
        print(json.dumps(results, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
