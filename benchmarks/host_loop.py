"""The engine loop's own host time: W-nano through `LLMEngine` with a runner that answers every
step at once, so what is timed is the scheduling, the bookkeeping and the outputs of each step,
the work the host does beside the device's (docs/benchmarks-archive.md, "the host's loop").

With asynchronous scheduling the host prepares a step while the device runs the one before, so
a loop whose host time a step exceeds the device's sets the pace: on an H200 the FP8 0.6B's
decode steps of ~256 requests take ~6 ms on the device. The runner's own host work (packing the
inputs, launching the graph and the sampler) is not in this figure; `throughput.py` measures
the whole.

    PYTHONPATH=engine:. python benchmarks/host_loop.py
    PYTHONPATH=engine:. python benchmarks/host_loop.py --requests 64 --repeats 5 --sync
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

from benchmarks.offline_engine import Workload, w_nano
from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.limits import EngineLimits
from pagekeeper_engine.core.outputs import RunnerOutput, SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.stats import GrammarTimings
from pagekeeper_engine.heap import freeze_startup_heap
from pagekeeper_engine.loop.engine import LLMEngine

MAX_MODEL_LEN = 2048  # W-nano's
TOKEN_ID = 7  # what every sampled row gets (W-nano ignores EOS)


class InstantStep:
    """A launched step whose tokens are already there."""

    def __init__(self, out: SchedulerOutput) -> None:
        self._out = out

    def result(self) -> RunnerOutput:
        seqs = self._out.seqs
        return RunnerOutput(
            sampled_token_ids=[TOKEN_ID if s.needs_sample else None for s in seqs],
            logprobs=[None] * len(seqs),
        )


class NullRunner:
    """A runner with a KV pool of `num_gpu_blocks` and no device: each step is answered on the
    spot (`AsyncModelRunnerProtocol`)."""

    num_cpu_blocks = 0
    num_host_blocks = 0
    host_block_bytes = 0
    kv_load_seconds = 0.0
    grammar_timings = GrammarTimings()
    num_swap_ooms = 0
    allocator_monitor = None
    prefers_async_scheduling = True

    def __init__(self, limits: EngineLimits, num_gpu_blocks: int) -> None:
        self.limits = limits
        self.num_gpu_blocks = num_gpu_blocks

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return InstantStep(out).result()

    def launch(self, out: SchedulerOutput) -> InstantStep:
        return InstantStep(out)


@dataclass(frozen=True)
class LoopPass:
    """One pass of the workload through the loop."""

    seconds: float
    steps: int
    output_tokens: int
    parts_ms: dict[str, float]  # the loop's thread a step, by part (`loop.step_time`)

    @property
    def ms_per_step(self) -> float:
        return self.seconds / self.steps * 1e3

    @property
    def us_per_token(self) -> float:
        """Host time per sequence-step: each decode step samples one token per sequence."""
        return self.seconds / self.output_tokens * 1e6


def build_loop(max_num_seqs: int, num_gpu_blocks: int, async_scheduling: bool) -> LLMEngine:
    """The engine loop at W-nano's settings over a `NullRunner`."""
    limits = EngineLimits(
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=16384,
        max_num_seqs=max_num_seqs,
        max_num_in_flight=2 * max_num_seqs,
    )
    config = EngineConfig(
        model="host-loop",
        device="cpu",
        max_model_len=limits.max_model_len,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    return LLMEngine(config, NullRunner(limits, num_gpu_blocks), frozenset({0}))


def run_pass(engine: LLMEngine, work: Workload, tag: str) -> LoopPass:
    """Every request of `work` through the loop, timed from the first add to the last output."""
    steps_before, spent_before = engine.num_steps, engine.host_seconds.copy()
    started = time.perf_counter()
    for i, (prompt, num_out) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        params = SamplingParams(max_tokens=num_out, temperature=0.6, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", prompt, params)
    num_output = 0
    while engine.has_work():
        num_output += sum(len(out.new_token_ids) for out in engine.step())
    seconds = time.perf_counter() - started
    steps = engine.num_steps - steps_before
    spent = engine.host_seconds.since(spent_before).as_dict()
    parts = {part: value / steps * 1e3 for part, value in spent.items()}
    return LoopPass(seconds, steps, num_output, parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256, help="W-nano's first N requests")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-gpu-blocks", type=int, default=150_000, help="the KV pool")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes, after one warm-up")
    parser.add_argument("--sync", action="store_true", help="without asynchronous scheduling")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    whole = w_nano()
    work = Workload(whole.prompts[: args.requests], whole.output_lens[: args.requests])
    engine = build_loop(args.max_num_seqs, args.num_gpu_blocks, not args.sync)
    freeze_startup_heap("the loop")  # as the engine core's process does
    run_pass(engine, work, "warm-up")
    passes = [run_pass(engine, work, f"pass-{i}") for i in range(args.repeats)]
    for p in passes:
        print(
            f"{p.seconds:.3f} s, {p.steps} steps, {p.ms_per_step:.3f} ms a step, "
            f"{p.us_per_token:.2f} us a sequence-step; "
            + ", ".join(f"{part} {ms:.3f}" for part, ms in p.parts_ms.items())
        )
    median = statistics.median(p.seconds for p in passes)
    print(f"median {median:.3f} s over {len(passes)} passes of {work.num_output_tokens} tokens")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "passes": [asdict(p) for p in passes]}, fh, indent=1)


if __name__ == "__main__":
    main()
