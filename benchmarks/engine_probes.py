"""Probes of a built engine (`offline_engine.build_engine`) beside W-nano: where a decode step's
host and device time goes, where the loop's thread spends a W-nano pass by function, what a
mixed prefill + decode step costs against a decode-only one, and greedy tokens with their
log-probabilities, compared across two engines (an FP8 cache or tensor parallelism against the
reference)."""

from __future__ import annotations

import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.loop.engine import LLMEngine


def profile_decode(engine: LLMEngine, batch: int, path: str | None) -> None:
    """Print where a decode step of `batch` running requests spends host and device time."""
    for i in range(batch):
        prompt = [(7 * i + j) % 10000 for j in range(512)]
        engine.add_request(f"prof-{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(8):  # past the prefills: every request decodes from here on
        engine.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    print(averages.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))
    if path:
        prof.export_chrome_trace(path)
    while engine.has_work():
        engine.step()


def host_profile(run: Callable[[], Any], top: int = 30) -> dict[str, Any]:
    """`run()` (a W-nano pass) under cProfile: the `top` functions by their own time and by
    their time with callees, each as (function, calls, own s, with callees s). cProfile costs
    each Python call about a microsecond, so Python-heavy parts read ~2-3x their unprofiled
    time: read the shares, not the seconds, and the pass's host waits as smaller than they are."""
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    seconds = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    rows = [
        (f"{path.rsplit('/', 1)[-1]}:{line}({name})", calls, own, total)
        for (path, line, name), (_, calls, own, total, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    by_own = sorted(rows, key=lambda r: -r[2])[:top]
    by_total = sorted(rows, key=lambda r: -r[3])[:top]
    return {"seconds": seconds, "by_own_time": by_own, "by_total_time": by_total}


def print_host_profile(profile: dict[str, Any], rows: int = 20) -> None:
    print(f"  under cProfile the pass took {profile['seconds']:.2f} s; by own time:")
    for name, calls, own, total in profile["by_own_time"][:rows]:
        print(f"    {own:8.3f} s own {total:8.3f} s with callees {calls:>9} calls  {name}")
    print("  by time with callees:")
    for name, calls, own, total in profile["by_total_time"][:rows]:
        print(f"    {total:8.3f} s with callees {own:8.3f} s own {calls:>9} calls  {name}")


def mixed_step_cost(engine: LLMEngine, batch: int, prompt_len: int) -> dict[str, float]:
    """Host and wall time of one mixed step (a `prompt_len`-token prefill beside `batch`
    decodes) against a decode-only step of the same batch, and the kernels each launches.

    Times are medians of 5 steps timed without a profiler (host: until `step` returns with the
    step enqueued; wall: until the device has run it); a sixth step of each kind runs under
    torch.profiler for its kernel count only, since the profiler's own host overhead is several
    times a step's."""
    for i in range(batch):
        prompt = [(7 * i + j) % 10000 for j in range(512)]
        engine.add_request(f"mix-{i}", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(8):  # past the prefills: every request decodes from here on
        engine.step()
    costs: dict[str, float] = {}
    for kind in ("decode", "mixed"):
        host, wall = [], []
        for round_ in range(6):
            if kind == "mixed":
                prompt = [(11 * j + round_) % 10000 for j in range(prompt_len)]
                engine.add_request(f"mix-prefill-{round_}", prompt, SamplingParams(max_tokens=1))
            torch.cuda.synchronize()
            if round_ == 5:
                activities = [
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
                with torch.profiler.profile(activities=activities) as prof:
                    engine.step()
                    torch.cuda.synchronize()
                kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
                costs[f"{kind}_kernels"] = len(kernels)
            else:
                started = time.perf_counter()
                engine.step()
                host.append(time.perf_counter() - started)
                torch.cuda.synchronize()
                wall.append(time.perf_counter() - started)
            engine.step()  # the step's tokens come back; a prefill request ends here
        costs[f"{kind}_host_ms"] = statistics.median(host) * 1e3
        costs[f"{kind}_wall_ms"] = statistics.median(wall) * 1e3
    print(
        f"  mixed step ({prompt_len}-token prefill + {batch} decodes): "
        f"{costs['mixed_kernels']:.0f} kernels, host {costs['mixed_host_ms']:.2f} ms, "
        f"wall {costs['mixed_wall_ms']:.2f} ms; decode-only: {costs['decode_kernels']:.0f} "
        f"kernels, host {costs['decode_host_ms']:.2f} ms, wall {costs['decode_wall_ms']:.2f} ms"
    )
    while engine.has_work():
        engine.step()
    return costs


def greedy_logprobs(
    engine: LLMEngine, num_prompts: int, num_steps: int, prompt_len: int = 512
) -> dict[str, list[tuple[int, float]]]:
    """(token, log-probability) of `num_steps` greedy tokens for each of `num_prompts` seeded
    prompts of `prompt_len` random ids."""
    rng = random.Random(1)
    params = SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True, logprobs=True)
    for i in range(num_prompts):
        prompt = [rng.randrange(1000, 30000) for _ in range(prompt_len)]
        engine.add_request(f"acc-{i}", prompt, params)
    picked: dict[str, list[tuple[int, float]]] = {}
    while engine.has_work():
        for out in engine.step():
            for token, logprob in zip(out.new_token_ids, out.logprobs, strict=True):
                assert logprob is not None
                picked.setdefault(out.request_id, []).append((token, logprob))
    return picked


def compare_greedy(
    reference: dict[str, list[tuple[int, float]]], other: dict[str, list[tuple[int, float]]]
) -> dict[str, float]:
    """Share of identical greedy tokens over every position, and the absolute difference of the
    chosen token's log-probability over the positions up to each prompt's first divergence
    (after it the two runs continue different texts)."""
    num_same = num_all = 0
    diffs: list[float] = []
    for request_id, ref in reference.items():
        mine = other[request_id]
        diverged = False
        for (ref_token, ref_lp), (token, lp) in zip(ref, mine, strict=True):
            num_all += 1
            num_same += token == ref_token
            if not diverged:
                diffs.append(abs(lp - ref_lp))
                diverged = token != ref_token
    return {
        "identical_token_share": num_same / num_all,
        "logprob_abs_diff_mean": sum(diffs) / len(diffs),
        "logprob_abs_diff_max": max(diffs),
        "num_positions": num_all,
        "num_compared_logprobs": len(diffs),
    }
