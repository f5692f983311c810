from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagekeeper_engine.config import EngineConfig, parse_args
from pagekeeper_engine.core.limits import SchedulerConfig, resolve_limits
from pagekeeper_engine.core.outputs import SchedulerOutput
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.core.scheduler import Scheduler
from pagekeeper_engine.model.hf_config import load_model_config
from pagekeeper_engine.runner.kv_cache import kv_bytes_per_block, resolve_kv_cache_dtype
from pagekeeper_engine.runner.runner import ModelRunner
from pagekeeper_memplan.defaults import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    resolve_max_num_batched_tokens,
)
from tests.engine.checkpoints import make_runner, seq, tokens, write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, "llama")
    return path


@pytest.fixture
def runner(checkpoint: Path) -> ModelRunner:
    return make_runner(checkpoint, num_blocks=24)


def test_one_pool_with_per_layer_views(runner: ModelRunner) -> None:
    # 2 layers, k and v, 24 blocks of 8 tokens, 2 kv heads of 16.
    assert runner.pools.device_pool.shape == (2, 2, 24, 8, 2, 16)
    assert (runner.num_gpu_blocks, runner.num_cpu_blocks) == (24, 4)
    assert (
        runner.pools.host_pool.shape == (2, 2, 4, 8, 2, 16)
        and not runner.pools.host_pool.is_pinned()
    )
    assert runner.bytes_per_block == 2 * 2 * 8 * 2 * 16 * 4
    attn = runner.model.model.layers[1].self_attn
    assert attn.k_cache is not None and attn.v_cache is not None
    assert attn.k_cache.data_ptr() == runner.pools.device_pool[1, 0].data_ptr()
    assert attn.v_cache.data_ptr() == runner.pools.device_pool[1, 1].data_ptr()
    assert runner.dtype == torch.float32 and runner.eos_token_ids == frozenset({2})
    assert runner.memory_budget_bytes is None  # the block count was given


def test_swap_space_sets_cpu_blocks(checkpoint: Path) -> None:
    per_block = 2 * 2 * 8 * 2 * 16 * 4
    runner = make_runner(
        checkpoint, swap_space=5.5 * per_block / 2**30, num_cpu_blocks_override=None
    )
    assert runner.num_cpu_blocks == 5


def test_limits_resolved_from_config_and_flags(checkpoint: Path) -> None:
    model_config = load_model_config(checkpoint)
    assert kv_bytes_per_block(model_config, 16, torch.bfloat16) == 2 * 2 * 32 * 2 * 16
    config = EngineConfig(model=str(checkpoint), device="cpu")
    limits = resolve_limits(config, model_config.max_position_embeddings)
    assert (limits.max_model_len, limits.max_num_batched_tokens) == (64, 8192)
    assert resolve_max_num_batched_tokens(None, True, 64) == DEFAULT_MAX_NUM_BATCHED_TOKENS == 8192
    assert resolve_max_num_batched_tokens(None, False, 16_384) == 16_384
    assert resolve_max_num_batched_tokens(None, False, 64) == 8192
    assert resolve_max_num_batched_tokens(512, True, 4096) == 512
    with pytest.raises(ValueError, match=r"--max-model-len 65 exceeds .* 64"):
        resolve_limits(EngineConfig(model="m", max_model_len=65), 64)


def test_limits_are_resolved_once_for_every_side() -> None:
    """A model that allows 16,384 tokens, no chunked prefill and no length flags: one step
    holds a whole 16,384-token prompt, for the runner and the scheduler alike."""
    config = EngineConfig(model="m", enable_chunked_prefill=False)
    limits = resolve_limits(config, 16_384)
    assert (limits.max_model_len, limits.max_num_batched_tokens) == (16_384, 16_384)
    sched_config = SchedulerConfig.from_engine_config(config, limits)
    assert (sched_config.max_model_len, sched_config.max_num_batched_tokens) == (16_384, 16_384)
    scheduler = Scheduler(sched_config, 2048, 0)
    scheduler.check_request(10_000)  # refused before: an 8,192-token step nothing asked for


def test_prepare_inputs_packs_exactly(runner: ModelRunner) -> None:
    seqs = [
        seq("d", [50], 9, [4, 7]),
        seq("p", [1, 2, 3, 4, 5, 6], 6, [2, 0, 9], needs_sample=False),
        seq("q", [7, 8, 9], 0, [5]),
    ]
    step = runner.prepare_inputs(seqs)
    assert step.input_ids.tolist() == [50, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert step.positions.tolist() == [9, 6, 7, 8, 9, 10, 11, 0, 1, 2]
    assert step.meta.slot_mapping.tolist() == [57, 22, 23, 0, 1, 2, 3, 40, 41, 42]
    assert step.meta.query_start_loc.tolist() == [0, 1, 7, 10]
    assert step.meta.seq_lens.tolist() == [10, 12, 3]
    assert step.meta.block_tables.tolist() == [[4, 7, 0], [2, 0, 9], [5, 0, 0]]
    assert (step.meta.max_query_len, step.meta.max_seq_len, step.meta.num_decode_seqs) == (6, 12, 1)
    assert step.sample_indices.tolist() == [0, 9] and step.sampled_seqs == [0, 2]


def test_execute_returns_none_where_nothing_is_sampled(runner: ModelRunner) -> None:
    assert runner.execute(SchedulerOutput(seqs=[], num_batched_tokens=0)).sampled_token_ids == []
    out = runner.execute(
        SchedulerOutput(
            seqs=[seq("a", tokens(5), 0, [0], needs_sample=False), seq("b", tokens(3), 0, [1])],
            num_batched_tokens=8,
        )
    )
    assert out.sampled_token_ids[0] is None and out.logprobs[0] is None
    assert isinstance(out.sampled_token_ids[1], int) and isinstance(out.logprobs[1], float)


def generate(
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    blocks: dict[str, list[int]],
    steps: int,
    params: SamplingParams | None = None,
) -> dict[str, list[int]]:
    """Greedy decode of several requests batched together: prefill in one step, then decodes."""
    kw = {} if params is None else {"sampling": params}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    scheduled = [seq(rid, p, 0, blocks[rid], **kw) for rid, p in prompts.items()]
    for step in range(steps):
        out = runner.execute(SchedulerOutput(seqs=scheduled, num_batched_tokens=0))
        for s, token in zip(scheduled, out.sampled_token_ids, strict=True):
            assert token is not None
            outputs[s.request_id].append(token)
        scheduled = [
            seq(
                rid,
                [outputs[rid][-1]],
                len(p) + step,
                blocks[rid],
                num_output_tokens=step + 1,
                **kw,
            )
            for rid, p in prompts.items()
        ]
    return outputs


def test_batch_generation_equals_each_alone(runner: ModelRunner) -> None:
    prompts = {"a": tokens(3), "b": tokens(11, offset=9), "c": tokens(17, offset=20)}
    blocks = {"a": [0, 1], "b": [2, 3, 4], "c": [5, 6, 7, 8]}
    together = generate(runner, prompts, blocks, steps=6)
    for rid in prompts:
        assert (
            together[rid] == generate(runner, {rid: prompts[rid]}, {rid: [20, 21, 22, 23]}, 6)[rid]
        )


def test_seeded_sampling_reproducible_through_execute(runner: ModelRunner) -> None:
    params = SamplingParams(temperature=1.5, top_p=0.9, seed=42)
    prompts = {"a": tokens(5), "b": tokens(7, offset=2)}
    blocks = {"a": [0, 1], "b": [2, 3]}
    first = generate(runner, prompts, blocks, steps=5, params=params)
    alone = generate(runner, {"b": prompts["b"]}, {"b": [9, 10]}, steps=5, params=params)
    assert first["b"] == alone["b"]
    assert first == generate(runner, prompts, blocks, steps=5, params=params)


def test_swap_out_and_in_round_trip(runner: ModelRunner) -> None:
    prompt = tokens(12, offset=6)
    reference = generate(runner, {"r": prompt}, {"r": [0, 1, 2]}, steps=4)["r"]
    first = runner.execute(
        SchedulerOutput(seqs=[seq("s", prompt, 0, [3, 4])], num_batched_tokens=12)
    )
    token = first.sampled_token_ids[0]
    assert token == reference[0]
    runner.execute(
        SchedulerOutput(seqs=[], num_batched_tokens=0, blocks_to_swap_out=[(3, 1), (4, 0)])
    )
    assert torch.equal(runner.pools.host_pool[:, :, 1], runner.pools.device_pool[:, :, 3])
    runner.pools.device_pool[:, :, [3, 4]] = 0.0  # the device blocks go to someone else meanwhile
    generated = [token]
    block_table = [10, 11, 12]
    swap_in = [(1, 10), (0, 11)]
    for step in range(3):
        assert generated[-1] is not None
        out = runner.execute(
            SchedulerOutput(
                seqs=[
                    seq("s", [generated[-1]], 12 + step, block_table, num_output_tokens=step + 1)
                ],
                num_batched_tokens=1,
                blocks_to_swap_in=swap_in if step == 0 else [],
            )
        )
        generated.append(out.sampled_token_ids[0])
    assert generated == reference


def test_an_fp8_kv_cache_is_refused_where_it_cannot_run() -> None:
    """The CPU at parse time (exit 2 naming the flag); a GPU without FP8 at start-up."""
    with pytest.raises(SystemExit) as info:
        parse_args(["/m", "--device", "cpu", "--kv-cache-dtype", "fp8"])
    assert info.value.code == 2
    assert parse_args(["/m", "--kv-cache-dtype", "fp8_e4m3"]).is_fp8_kv_cache
    config = EngineConfig(model="m", device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU"):
        resolve_kv_cache_dtype(config, torch.bfloat16, torch.device("cpu"))
    auto = EngineConfig(model="m", device="cpu")
    assert resolve_kv_cache_dtype(auto, torch.float32, torch.device("cpu")) == torch.float32
