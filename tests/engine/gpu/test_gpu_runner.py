"""The CUDA path (Triton attention, fused kernels, CUDA graphs) against the CPU reference path
on tiny random checkpoints: the same greedy tokens, logits within the dtype's tolerance, and
graph replays equal to eager steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.kernels import supports_pdl
from pagekeeper_engine.model.layers import Linear
from pagekeeper_engine.model.row_fusion import RowFusion
from pagekeeper_engine.runner.runner import ModelRunner
from pagekeeper_engine.runner.step_inputs import GraphPadding
from tests.engine.checkpoints import (
    GREEDY,
    make_runner,
    seq,
    step_logits,
    tokens,
    write_checkpoint,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT_LENS = [5, 13, 21]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(path, request.param)
    return path


def gpu_runner(path: Path, **overrides: object) -> ModelRunner:
    return make_runner(path, device="cuda", **overrides)


def block_tables(prompt_lens: list[int], num_steps: int, block_size: int = 8) -> list[list[int]]:
    """Disjoint, scattered tables from block 1 up; block 0 stays the padding block."""
    tables, next_block = [], 1
    for length in prompt_lens:
        num_blocks = -(-(length + num_steps) // block_size)
        tables.append(list(range(next_block + num_blocks - 1, next_block - 1, -1)))
        next_block += num_blocks
    return tables


def generate(runner: ModelRunner, prompt_lens: list[int], num_steps: int) -> list[list[int]]:
    """Greedy tokens of the prompts batched together: one prefill step, then decode steps."""
    tables = block_tables(prompt_lens, num_steps)
    prompts = [tokens(n, offset=i) for i, n in enumerate(prompt_lens)]
    outputs: list[list[int]] = [[] for _ in prompt_lens]
    scheduled = [seq(f"r{i}", p, 0, tables[i]) for i, p in enumerate(prompts)]
    for step in range(num_steps):
        out = runner.execute(SchedulerOutput(seqs=scheduled, num_batched_tokens=0))
        for i, token in enumerate(out.sampled_token_ids):
            assert token is not None
            outputs[i].append(token)
        scheduled = [
            seq(f"r{i}", [outputs[i][-1]], len(p) + step, tables[i], num_output_tokens=step + 1)
            for i, p in enumerate(prompts)
        ]
    return outputs


def test_greedy_tokens_equal_the_cpu_reference(checkpoint: Path) -> None:
    reference = generate(make_runner(checkpoint), PROMPT_LENS, num_steps=12)
    runner = gpu_runner(checkpoint)
    assert runner.graphs is not None and runner.graphs.batch_sizes == [1, 2, 4]
    # Capturing and first replays ran on padding rows only: nothing reached the KV cache.
    assert runner.pools.device_pool.count_nonzero() == 0
    assert generate(runner, PROMPT_LENS, num_steps=12) == reference


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_logits_within_dtype_tolerance(checkpoint: Path, dtype: str, tolerance: float) -> None:
    tables = block_tables(PROMPT_LENS, 1)
    prompts = [tokens(n, offset=i) for i, n in enumerate(PROMPT_LENS)]
    prefill = [seq(f"r{i}", p, 0, tables[i]) for i, p in enumerate(prompts)]
    decode = [seq(f"r{i}", [7], len(p), tables[i]) for i, p in enumerate(prompts)]
    cpu, gpu = make_runner(checkpoint), gpu_runner(checkpoint, dtype=dtype)
    for step in (prefill, decode):  # the decode step attends to the prefill's cached keys
        expected = torch.cat(step_logits(cpu, step))
        got = torch.cat(step_logits(gpu, step)).float().cpu()
        error = (got - expected).norm() / expected.norm()
        assert error < tolerance, f"{dtype}: relative error {error:.2e}"
        if dtype == "float32":  # bf16 rounding may flip near ties; fp32 must not
            assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_graph_replay_equals_eager(checkpoint: Path) -> None:
    # 11 sequences of different lengths: decode steps pad to the 16-row graph.
    prompt_lens = [1, 3, 8, 9, 15, 17, 24, 30, 33, 40, 47]
    fields = {"max_num_seqs": 20, "num_gpu_blocks_override": 80}
    graphed = gpu_runner(checkpoint, **fields)
    eager = gpu_runner(checkpoint, enforce_eager=True, **fields)
    assert eager.graphs is None and graphed.graphs is not None
    assert graphed.graphs.padding_for([seq("x", [1], 3, [1])] * 11) == GraphPadding(16, decode=True)

    assert generate(graphed, prompt_lens, num_steps=8) == generate(eager, prompt_lens, 8)
    # The same KV was written (splits differ, so not bit for bit), and the padding rows of the
    # graph wrote nothing: block 0 is still zero.
    torch.testing.assert_close(
        graphed.pools.device_pool, eager.pools.device_pool, rtol=1e-5, atol=1e-5
    )
    assert graphed.pools.device_pool[:, :, 0].count_nonzero() == 0


def generate_staggered(runner: ModelRunner, prompt_lens: list[int], num_steps: int) -> list[int]:
    """Greedy tokens when request i arrives at step i: from the second step on, every step
    mixes the earlier requests' decodes with one prompt's prefill. All sampled tokens, in order."""
    tables = block_tables(prompt_lens, num_steps)
    prompts = [tokens(n, offset=i) for i, n in enumerate(prompt_lens)]
    outputs: list[list[int]] = [[] for _ in prompt_lens]
    sampled = []
    for step in range(num_steps):
        scheduled = [
            seq(f"r{i}", [outputs[i][-1]], prompt_lens[i] + len(outputs[i]) - 1, tables[i],
                num_output_tokens=len(outputs[i]))
            for i in range(min(step, len(prompts)))
        ]  # fmt: skip
        if step < len(prompts):
            scheduled.append(seq(f"r{step}", prompts[step], 0, tables[step]))
        padding = None if runner.graphs is None else runner.graphs.padding_for(scheduled)
        if runner.graphs is not None and step < len(prompts):
            total = sum(s.num_tokens for s in scheduled)
            assert padding == GraphPadding(max(16, 1 << (total - 1).bit_length()), decode=False)
        out = runner.execute(SchedulerOutput(seqs=scheduled, num_batched_tokens=0))
        for s, token in zip(scheduled, out.sampled_token_ids, strict=True):
            assert token is not None
            outputs[int(s.request_id[1:])].append(token)
            sampled.append(token)
    return sampled


def test_mixed_steps_replayed_in_pieces_equal_eager(checkpoint: Path) -> None:
    # Prompts of 5..47 tokens join one a step beside the earlier ones' decodes: 6..53 rows a
    # step, padded to the 16-, 32- and 64-row piecewise graphs.
    prompt_lens = [5, 13, 21, 9, 30, 47]
    fields = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_gpu_blocks_override": 80}
    graphed = gpu_runner(checkpoint, **fields)
    eager = gpu_runner(checkpoint, enforce_eager=True, **fields)
    assert graphed.graphs is not None and graphed.graphs.piecewise.token_sizes == [16, 32, 64]
    # Capturing and first replays ran on padding rows only: nothing reached the KV cache.
    assert graphed.pools.device_pool.count_nonzero() == 0

    expected = generate_staggered(eager, prompt_lens, num_steps=10)
    assert generate_staggered(graphed, prompt_lens, num_steps=10) == expected
    torch.testing.assert_close(
        graphed.pools.device_pool, eager.pools.device_pool, rtol=1e-5, atol=1e-5
    )
    assert graphed.pools.device_pool[:, :, 0].count_nonzero() == 0  # padding rows stored nothing


def test_graph_is_valid_past_the_lengths_it_was_captured_at(checkpoint: Path) -> None:
    # One sequence decoding from position 2 to 60 through the 1-row graph, against eager.
    graphed = gpu_runner(checkpoint)
    eager = gpu_runner(checkpoint, enforce_eager=True)
    assert generate(graphed, [2], num_steps=58) == generate(eager, [2], num_steps=58)


def test_start_up_times_every_projection_shape(checkpoint: Path) -> None:
    runner = gpu_runner(checkpoint)
    choices = {choice.name: choice for choice in runner.gemv_choices}
    assert set(choices) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    fusion = runner.fusion_choice
    assert fusion is not None
    for choice in choices.values():
        assert choice.num_layers == runner.model_config.num_layers
        assert choice.cublas_step_us > 0 and choice.gemv_step_us > 0
        # What was decided is what every layer runs: the tiles timed in the fused layer where
        # it was chosen, the unfused layer's choice otherwise.
        runs = choice.config if fusion.chosen is None else fusion.fused_tiles[choice.name]
        assert all(
            linear.gemv_config == runs
            for name, linear in runner.model.named_modules()
            if name.endswith(f".{choice.name}")
        )


def test_batch1_gemv_tokens_equal_the_cpu_reference(checkpoint: Path) -> None:
    # Whatever the timing chose on this GPU, run every projection's single rows through the
    # GEMV (replayed from the 1-row graph) and compare with the CPU path.
    from pagekeeper_engine.kernels.gemv import CANDIDATES  # noqa: PLC0415 (fixes Triton's mode)

    runner = gpu_runner(checkpoint)
    expected = generate(make_runner(checkpoint), [9], num_steps=20)
    # Each tile the start-up may choose, in the layer as the projections' GEMVs alone, then
    # fused (norms, residual adds and SwiGLU inside them), then fused with programmatic
    # dependent launch where the GPU has it.
    for config in CANDIDATES:
        for name, module in runner.model.named_modules():
            if isinstance(module, Linear) and ".layers." in name:
                module.gemv_config = config
        for fusion in (None, RowFusion(), RowFusion(pdl=supports_pdl(runner.device))):
            runner.model.set_row_fusion(fusion)
            runner.capture_graphs()
            assert generate(runner, [9], num_steps=20) == expected, (config, fusion)


def test_start_up_chooses_the_one_token_layer(checkpoint: Path) -> None:
    runner = gpu_runner(checkpoint)
    choice = runner.fusion_choice
    assert choice is not None and runner.model.model.row_fusion == choice.chosen
    assert None in choice.step_us and RowFusion() in choice.step_us
    assert (RowFusion(pdl=True) in choice.step_us) == supports_pdl(runner.device)
    assert all(us > 0 for us in choice.step_us.values())
    # The fused layer's tiles were timed in it, one for each projection.
    assert set(choice.fused_tiles) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


def staircase(runner: ModelRunner, prompt_lens: list[int], sampling: SamplingParams) -> None:
    """Mixed steps: every running sequence decodes while the next prompt is prefilled."""
    running: list[tuple[str, list[int], list[int]]] = []  # id, tokens so far, blocks
    next_block = 1
    for i, length in enumerate([*prompt_lens, 0]):
        step = [
            seq(rid, toks[-1:], len(toks) - 1, blocks, sampling=sampling, num_output_tokens=1)
            for rid, toks, blocks in running
        ]
        if length:
            blocks = list(range(next_block, next_block + 4))  # 32 tokens of 8
            next_block += 4
            prompt = tokens(length, offset=i)
            step.append(seq(f"s{i}", prompt, 0, blocks, sampling=sampling))
            running.append((f"s{i}", prompt, blocks))
        out = runner.execute(SchedulerOutput(seqs=step, num_batched_tokens=0))
        for (_, toks, _), token in zip(running, out.sampled_token_ids, strict=True):
            assert token is not None
            toks.append(token)


def test_new_batch_shapes_compile_no_new_kernel_variants(checkpoint: Path) -> None:
    # Triton compiles a variant per alignment of each pointer argument; the step metadata is
    # sliced at batch-dependent offsets. After a warm-up, steps of other batch shapes must
    # reuse what was compiled instead of compiling for seconds in the middle of serving.
    from triton import knobs  # noqa: PLC0415

    runner = gpu_runner(checkpoint, enforce_eager=True, max_num_seqs=8, num_gpu_blocks_override=40)
    hot = SamplingParams(temperature=0.8)
    for sampling in (GREEDY, hot):
        staircase(runner, [5, 9], sampling)
    compiled: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        for sampling in (GREEDY, hot):
            staircase(runner, [3, 17, 1, 8, 12, 2, 6], sampling)
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == []


def test_a_started_runner_compiles_nothing_for_its_first_requests(checkpoint: Path) -> None:
    # The start-up warm-up runs each sampler path (greedy, plain temperature, a mix, top-k/top-p)
    # and the batch-1 choice runs the one-token layer: the first requests of every kind, mixed
    # steps and lone decodes, find their kernels compiled.
    from triton import knobs  # noqa: PLC0415

    runner = gpu_runner(
        checkpoint, max_num_seqs=8, num_gpu_blocks_override=None, gpu_memory_utilization=0.3
    )
    compiled: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["fn"].name)
    try:
        for sampling in (
            GREEDY,
            SamplingParams(temperature=0.8),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20),
        ):
            staircase(runner, [3, 17, 1, 8], sampling)
        generate(runner, [5], num_steps=6)
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
