"""The pod's host memory term by term, in exact bytes, and its verdicts."""

from __future__ import annotations

from pagekeeper_memplan.budget import GiB
from pagekeeper_memplan.host import HostInputs, HostVerdict, judge_host, plan_host

TIER = HostInputs(
    tp=2,
    kv_offload_bytes=32 * GiB,
    swap_bytes_per_rank=2 * GiB,
    cpu_offload_bytes_per_gpu=3 * GiB,
    shared_memory_bytes=2 * GiB,
)


def test_the_terms_of_a_tier_swap_and_offload_at_tensor_2() -> None:
    plan = plan_host(TIER)
    assert plan.terms == {
        "kvOffload": 32 * GiB,  # total over the ranks, as given
        "swapSpace": 4 * GiB,  # per rank
        "cpuOffload": 6 * GiB,  # per GPU
        "sharedMemory": 2 * GiB,
        "processes": 2 * 3 * GiB + 1 * GiB,  # two GPU processes and one front end
    }
    assert (plan.total, plan.pinned) == (51 * GiB, 42 * GiB)
    assert plan.largest_pinned == "kvOffload"
    assert plan.describe() == (
        "kvOffload 32.00 GiB, processes 7.00 GiB, cpuOffload 6.00 GiB, swapSpace 4.00 GiB, "
        "sharedMemory 2.00 GiB"
    )


def test_a_limit_below_the_plan_names_the_terms_and_the_bytes() -> None:
    verdict = judge_host(plan_host(TIER), request=0, limit=48 * GiB, allocatable=None)
    assert verdict == HostVerdict(
        False,
        "MemoryLimitBelowHostPlan",
        "the pod's memory limit of 48.00 GiB is below its host memory of 51.00 GiB (kvOffload "
        "32.00 GiB, processes 7.00 GiB, cpuOffload 6.00 GiB, swapSpace 4.00 GiB, sharedMemory "
        "2.00 GiB); the kernel would kill it (OOMKilled) as the pinned terms fill: raise "
        "spec.resources.limits.memory or shrink the largest term",
        "kvOffload",
        3 * GiB,
    )


def test_no_candidate_node_holds_the_pod() -> None:
    plan = plan_host(TIER)
    verdict = judge_host(plan, request=0, limit=None, allocatable=(50 * GiB, "gpu-a"))
    assert (verdict.fits, verdict.reason, verdict.term, verdict.shortfall) == (
        False,
        "HostMemoryExceedsNodes",
        "kvOffload",
        1 * GiB,
    )
    assert verdict.message.startswith("the pod needs 51.00 GiB of host memory (kvOffload 32.00")
    assert verdict.message.endswith("more than the 50.00 GiB allocatable on any candidate node "
                                    "(the most: node gpu-a)")  # fmt: skip
    # The node holds the plan but not a larger request the spec sets.
    over = judge_host(plan, request=60 * GiB, limit=None, allocatable=(56 * GiB, "gpu-a"))
    assert (over.fits, over.shortfall) == (False, 4 * GiB)
    fits = judge_host(plan, request=51 * GiB, limit=51 * GiB, allocatable=(51 * GiB, "gpu-a"))
    assert (fits.fits, fits.reason) == (True, "Fits")


def test_without_pinned_memory_the_estimate_alone_holds_nothing() -> None:
    plan = plan_host(HostInputs(shared_memory_bytes=GiB))
    assert (plan.total, plan.pinned, plan.largest_pinned) == (5 * GiB, 0, None)
    verdict = judge_host(plan, request=0, limit=2 * GiB, allocatable=(GiB, "small"))
    assert (verdict.fits, verdict.reason) == (True, "NothingPinned")
