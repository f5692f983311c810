"""The pod's host memory, and whether a node can hold it: pure arithmetic.

Terms, per pod, in bytes:

- kvOffload (exact): the host KV tier, `--kv-offloading-size`, total over the tensor-parallel
  ranks (each rank holds its shard of every block). The paged engine stages the tier's copies
  on the GPU (out of the KV cache's budget), so the tier has no pinned staging on the host.
- swapSpace (exact): `--swap-space` GiB per rank (each rank's swap pool holds its shard of
  the swapped blocks, as vLLM's flag was per GPU), pinned.
- cpuOffload (exact): `--cpu-offload-gb` GiB per GPU, pinned.
- sharedMemory (a bound): the pod's memory-backed /dev/shm (NCCL's buffers between the ranks),
  which counts against the pod's memory limit as it fills.
- processes (an estimate): each process's own memory. A GPU process (the engine core, which is
  rank 0, and one worker per further rank; vLLM's engine core and workers alike) holds Python,
  torch and the CUDA libraries it maps (cuBLAS, NCCL, Triton's kernels: over 1 GiB resident),
  the CUDA context's host side, the pinned step buffers (a few MiB) and the pages of the
  checkpoint it reads while loading: `GPU_PROCESS_ESTIMATE`. A front end (HTTP, tokenizer,
  detokenizer, no torch) holds Python, aiohttp and the tokenizer's vocabulary and merges:
  `FRONT_END_ESTIMATE`. Both round up, since an estimate too low is an OOMKilled pod.

The pinned terms (kvOffload, swapSpace, cpuOffload) cannot be paged out or reclaimed: a pod
that sets them gets a memory request and limit of at least the plan's total, and the plan is
judged against that limit and the nodes' allocatable memory (`judge_host`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagekeeper_memplan.budget import GiB

GPU_PROCESS_ESTIMATE = 3 * GiB
FRONT_END_ESTIMATE = 1 * GiB
HOST_TERMS = ("kvOffload", "swapSpace", "cpuOffload", "sharedMemory", "processes")
PINNED_TERMS = ("kvOffload", "swapSpace", "cpuOffload")
ESTIMATED_HOST_TERMS = ("processes",)


@dataclass(frozen=True)
class HostInputs:
    """What the host plan reads from a server and its policy."""

    tp: int = 1
    num_front_ends: int = 1
    kv_offload_bytes: int = 0  # the tier, total over the ranks
    swap_bytes_per_rank: int = 0
    cpu_offload_bytes_per_gpu: int = 0
    shared_memory_bytes: int = 0


@dataclass(frozen=True)
class HostPlan:
    """The pod's host memory by term (`HOST_TERMS`)."""

    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())

    @property
    def pinned(self) -> int:
        return sum(self.terms[term] for term in PINNED_TERMS)

    def describe(self) -> str:
        """The terms that hold memory, largest first: `kvOffload 32.00 GiB, processes ...`."""
        held = sorted(((v, t) for t, v in self.terms.items() if v > 0), reverse=True)
        return ", ".join(f"{term} {gib(value)}" for value, term in held)

    @property
    def largest_pinned(self) -> str | None:
        """The pinned term holding the most (the one to shrink first), if any."""
        value, term = max((self.terms[t], t) for t in PINNED_TERMS)
        return term if value > 0 else None


@dataclass(frozen=True)
class HostVerdict:
    """Whether the pod's host memory fits its limit and a node; when not, why and by how much."""

    fits: bool
    reason: str  # CamelCase, for the PolicyFits condition
    message: str
    term: str | None = None
    shortfall: int = 0


def gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def plan_host(inputs: HostInputs) -> HostPlan:
    """The pod's host memory (module docstring)."""
    processes = inputs.tp * GPU_PROCESS_ESTIMATE + inputs.num_front_ends * FRONT_END_ESTIMATE
    return HostPlan(
        {
            "kvOffload": inputs.kv_offload_bytes,
            "swapSpace": inputs.swap_bytes_per_rank * inputs.tp,
            "cpuOffload": inputs.cpu_offload_bytes_per_gpu * inputs.tp,
            "sharedMemory": inputs.shared_memory_bytes,
            "processes": processes,
        }
    )


def judge_host(
    plan: HostPlan,
    *,
    request: int,
    limit: int | None,
    allocatable: tuple[int, str] | None,
) -> HostVerdict:
    """Whether `plan` fits the pod's memory `limit` (None: unlimited) and the candidate node
    with the most allocatable memory (`allocatable`: its bytes and name; None: none known),
    which must hold the pod's `request` too. Judged only where the policy pins host memory: the
    rest is an estimate of the processes' own, which alone should not hold a rollout."""
    total = plan.total
    if plan.pinned == 0:
        return HostVerdict(True, "NothingPinned", f"no pinned host memory; {plan.describe()}")
    term = plan.largest_pinned or max(plan.terms, key=lambda t: plan.terms[t])
    if limit is not None and limit < total:
        return HostVerdict(
            False,
            "MemoryLimitBelowHostPlan",
            f"the pod's memory limit of {gib(limit)} is below its host memory of {gib(total)} "
            f"({plan.describe()}); the kernel would kill it (OOMKilled) as the pinned terms "
            "fill: raise spec.resources.limits.memory or shrink the largest term",
            term,
            total - limit,
        )
    needed = max(total, request)
    if allocatable is not None and allocatable[0] < needed:
        memory, node = allocatable
        return HostVerdict(
            False,
            "HostMemoryExceedsNodes",
            f"the pod needs {gib(needed)} of host memory ({plan.describe()}), more than the "
            f"{gib(memory)} allocatable on any candidate node (the most: node {node})",
            term,
            needed - memory,
        )
    return HostVerdict(True, "Fits", f"host memory {gib(total)} a pod ({plan.describe()})")
