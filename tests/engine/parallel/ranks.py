"""One tensor-parallel rank of a CPU test, in its own spawned process (gloo).

Each rank joins the parent's rendezvous, loads its shard of every checkpoint it is given, and
runs the same steps: a packed step of two prefills, a mixed decode-and-chunk step, then
generation through `execute` (rank 0) and `follow` (the others), as the engine core and the
workers do, for each of `SAMPLINGS`: a rank > 0 packs the step as rank 0 does, sends it through
the workers' MessagePack encoding and back, and runs what arrives. Rank 0 puts the gathered
logits (numpy arrays: a tensor on a queue travels as a handle that dies with its process) and
the generated ids on the queue.
"""

from __future__ import annotations

import datetime
import multiprocessing
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pagekeeper_engine.config import EngineConfig
from pagekeeper_engine.core.outputs import ScheduledSeq, SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.sequence import PLACEHOLDER_TOKEN_ID
from pagekeeper_engine.distributed.group import (
    TensorParallelGroup,
    join_rendezvous,
    serve_rendezvous,
)
from pagekeeper_engine.executor.protocol import step_decoder, step_encoder
from pagekeeper_engine.runner.follower_step import follower_step
from pagekeeper_engine.runner.runner import ModelRunner
from tests.engine.checkpoints import BLOCK_SIZE, seq, tokens

# The GPU tests' rank counts, each skipped on a host with fewer GPUs.
GPU_RANK_COUNTS = [
    pytest.param(
        size,
        marks=pytest.mark.skipif(
            torch.cuda.device_count() < size, reason=f"needs {size} CUDA GPUs"
        ),
    )
    for size in (2, 4)
]

NUM_GENERATED = 6
# Greedy and seeded random batches are picked across the vocabulary shards (`shard_pick`); a
# top-k cut gathers the whole logits to rank 0. Seeded rows draw the same noise at any size.
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded": SamplingParams(temperature=0.8, seed=11),
    "top-k": SamplingParams(temperature=0.8, top_k=5, seed=12),
}
LEAVE_TIMEOUT = datetime.timedelta(seconds=60)  # for the last rank to finish its work
RESULT_POLL_S = 1.0  # how often a wait for results looks for a rank that died


def runner_config(
    path: Path, size: int, load_format: str = "safetensors", device: str = "cpu"
) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        load_format=load_format,
        device=device,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=64,
        max_num_seqs=4,
        num_gpu_blocks_override=24,
        num_cpu_blocks_override=4,
        tensor_parallel_size=size,
    )


def packed_steps() -> list[list[ScheduledSeq]]:
    """Two prefills in one step, then a decode beside the next chunk of another prompt."""
    first = [
        seq("a", tokens(10), 0, [1, 2]),
        seq("b", tokens(5, offset=11), 0, [3], needs_sample=False),
    ]
    second = [
        seq("a", [42], 10, [1, 2]),
        seq("b", tokens(9, offset=11)[5:], 5, [3, 4]),
    ]
    return [first, second]


def step_logits(runner: ModelRunner, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
    """fp32 logits of every token row of the step (None on ranks > 0). On a GPU the packing
    pads the step to a captured graph's rows; those come after the tokens, and no attention
    writes their output, so their logits are whatever the buffers held: not compared."""
    with torch.inference_mode():
        inputs = runner.prepare_inputs(seqs)
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = runner.model.gather_logits(runner.model.compute_logits(hidden))
        num_rows = sum(s.num_tokens for s in seqs)
        return None if logits is None else logits[:num_rows].float()


def generate(
    runner: ModelRunner, is_first: bool, sampling: SamplingParams = SAMPLINGS["greedy"]
) -> list[list[int]]:
    """The tokens of two requests, stepped together; every rank runs every step. Decode
    inputs are placeholders, as under asynchronous scheduling: each rank takes the token the
    ranks picked together across their vocabulary shards."""
    prompts = {"x": tokens(7, offset=5), "y": tokens(12, offset=29)}
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}
    blocks = {"x": [5, 6], "y": [7, 8, 9]}
    lengths = dict.fromkeys(prompts, 0)
    for step in range(NUM_GENERATED):  # every request has `step` output tokens before it
        seqs = []
        for rid, prompt in prompts.items():
            new = prompt if step == 0 else [PLACEHOLDER_TOKEN_ID]
            seqs.append(
                seq(rid, new, lengths[rid], blocks[rid], sampling=sampling, num_output_tokens=step)
            )
            lengths[rid] += len(new)
        out = SchedulerOutput(seqs, sum(s.num_tokens for s in seqs))
        if is_first:
            sampled = runner.execute(out).sampled_token_ids
            for rid, token in zip(prompts, sampled, strict=True):
                assert token is not None
                generated[rid].append(token)
        else:
            follow_as_a_worker(runner, out)
    return list(generated.values())


def follow_as_a_worker(runner: ModelRunner, out: SchedulerOutput) -> None:
    """What a worker runs of `out`: the step rank 0 packs of it (this rank packs the same
    sequences the same way), after its trip over the wire."""
    inputs = runner.steps.prepare(out.seqs, keep_packed=True) if out.seqs else None
    wire = step_encoder().encode(follower_step(out, inputs))
    step = step_decoder().decode(wire)
    assert step is not None
    runner.follow(step)


def run_rank(rank: int, size: int, port: int, paths: list[Path], device: str, results: Any) -> None:
    torch.set_num_threads(1)
    where = torch.device("cpu")
    if device == "cuda":
        where = torch.device("cuda", rank)
        torch.cuda.set_device(where)
    group = TensorParallelGroup.initialize(rank, size, join_rendezvous(port, size), where)
    try:
        found: dict[str, Any] = {}
        for path in paths:
            config = runner_config(path, size, device=device)
            runner = ModelRunner(config, progress=False, tp=group)
            logits = [step_logits(runner, steps) for steps in packed_steps()]
            runner = ModelRunner(config, progress=False, tp=group)
            tokens_out = {
                name: generate(runner, group.is_first, params) for name, params in SAMPLINGS.items()
            }
            logits = [None if x is None else x.cpu().numpy() for x in logits]
            found[path.name] = (logits, tokens_out, runner.num_gpu_blocks)
        # random weights drawn whole and cut per rank: the same model at every size
        config = runner_config(paths[0], size, "dummy", device)
        runner = ModelRunner(config, progress=False, tp=group)
        dummy = step_logits(runner, packed_steps()[0])
        found["dummy"] = None if dummy is None else dummy.cpu().numpy()
        # which all-reduces went one-shot and which way, to read a failure by
        choice = group.one_shot_choice
        found["one_shot"] = "not set up" if choice is None else choice.describe()
        if group.is_first:
            results.put(found)
        # The ranks leave together: a rank that tore its gloo connections down while a peer
        # still used them aborted that peer's process at exit, now and then at 4 ranks.
        dist.monitored_barrier(group=group.cpu_group, timeout=LEAVE_TIMEOUT)
    finally:
        group.destroy()


def spawn_ranks(
    target: Callable[..., None], size: int, args: tuple[Any, ...], num_results: int, timeout: float
) -> list[Any]:
    """Start `size` processes of `target(rank, size, port, *args, results)` around one
    rendezvous, take `num_results` items off their queue, and check that every rank exited 0.
    A rank that exits non-zero fails the call as soon as it does (its peers would otherwise
    wait on it, and the caller on them, until `timeout`); a rank still running at the end is
    killed."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    store = serve_rendezvous(size)
    processes = [
        context.Process(target=target, args=(rank, size, store.port, *args, results))
        for rank in range(size)
    ]
    for process in processes:
        process.start()
    try:
        found = _take_results(results, processes, num_results, timeout)
        for process in processes:
            process.join(timeout)
            assert process.exitcode == 0, f"{process.name} exited with {process.exitcode}"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
    return found


def _take_results(
    results: Any, processes: list[Any], num_results: int, timeout: float
) -> list[Any]:
    deadline = time.monotonic() + timeout
    found: list[Any] = []
    while len(found) < num_results:
        try:
            found.append(results.get(timeout=RESULT_POLL_S))
        except queue.Empty:
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            assert not failed, (
                f"{failed[0].name} exited with {failed[0].exitcode} before the ranks' results "
                f"({len(found)} of {num_results} in)"
            )
            assert time.monotonic() < deadline, f"no result from the ranks within {timeout} s"
    return found
