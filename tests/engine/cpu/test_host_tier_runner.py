"""The host KV tier through the real model runner on the CPU: multi-turn sessions whose
contexts outgrow the KV pool give the same greedy tokens with the tier as without it, while
the tier serves their prefixes; and the runner sizes the tier from its flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagekeeper_engine.config import EngineConfig, parse_args
from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.loop.engine import LLMEngine
from pagekeeper_engine.messages import LoopStats
from pagekeeper_engine.runner.kv_offload import host_tier_blocks
from tests.engine.checkpoints import make_runner, tokens, write_checkpoint
from tests.engine.fakes import IdTokenizer, run_all, tokens_of

NUM_TURNS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    write_checkpoint(path, "qwen3")
    return path


def serve_sessions(
    checkpoint: Path, gib: float, device: str = "cpu"
) -> tuple[dict[str, list[int]], LoopStats]:
    """Two sessions, each turn resending its whole context plus new tokens, over a pool of 14
    blocks of 8 tokens: the sessions' contexts (up to 46 tokens each) evict each other."""
    runner = make_runner(
        checkpoint,
        num_blocks=14,
        max_model_len=64,
        kv_offloading_size=gib,
        num_cpu_blocks_override=0,
        device=device,
    )
    config = EngineConfig(
        model="tiny",
        device=device,
        block_size=8,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        async_scheduling=device == "cuda",
        kv_offloading_size=gib,
    )
    engine = LLMEngine(config, runner, IdTokenizer().eos_token_ids)
    contexts = {s: tokens(13 + 4 * s, offset=17 * s + 3) for s in range(2)}
    found = {}
    for turn in range(NUM_TURNS):
        for session, context in contexts.items():
            rid = f"s{session}t{turn}"
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            engine.add_request(rid, list(context), params)
            found[rid] = tokens_of(run_all(engine)[rid])
            context.extend(found[rid] + tokens(7, offset=31 * turn + session + 1))
    return found, engine.stats()


def test_greedy_tokens_are_the_same_with_the_tier(checkpoint: Path) -> None:
    without, plain = serve_sessions(checkpoint, 0.0)
    with_tier, tiered = serve_sessions(checkpoint, 0.001)  # ~1 MiB: every block fits
    assert with_tier == without
    assert plain.prefix_cache_host_hits == 0 and plain.num_host_blocks == 0
    assert tiered.prefix_cache_host_hits > 0
    assert tiered.num_host_blocks_loaded * 8 == tiered.prefix_cache_host_hits
    assert 0 < tiered.num_host_blocks_used <= tiered.num_host_blocks
    # fewer tokens recomputed: the host's hits are tokens the plain run computed again
    assert tiered.num_batched_tokens_total < plain.num_batched_tokens_total


def test_the_tier_is_sized_from_its_flag_over_the_ranks(checkpoint: Path) -> None:
    runner = make_runner(checkpoint, num_blocks=14, kv_offloading_size=0.001)
    expected = host_tier_blocks(0.001, 1, runner.bytes_per_block)
    assert runner.num_host_blocks == expected > 0
    assert runner.host_block_bytes == runner.bytes_per_block
    assert host_tier_blocks(1.0, 2, 1 << 20) == 512  # each of 2 ranks holds half of 1 GiB
    assert make_runner(checkpoint, num_blocks=14).num_host_blocks == 0


def test_the_flags_parse_and_a_tier_without_prefix_caching_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = parse_args(["/m", "--kv-offloading-size", "16", "--kv-offloading-backend", "native"])
    assert (config.kv_offloading_size, config.kv_offloading_backend) == (16.0, "native")
    assert parse_args(["/m"]).kv_offloading_size == 0.0
    with pytest.raises(SystemExit) as exited:
        parse_args(["/m", "--kv-offloading-size", "4", "--no-enable-prefix-caching"])
    assert exited.value.code == 2
    assert "--kv-offloading-size: the host KV tier is a tier of the prefix cache" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parse_args(["/m", "--kv-offloading-backend", "lmcache"])
    assert "invalid choice: 'lmcache'" in capsys.readouterr().err
