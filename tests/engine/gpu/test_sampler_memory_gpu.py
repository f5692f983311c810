"""Sampling under a burst of varied batches leaves nothing batch-sized in the caching allocator.

Before the sampler worked in its preallocated rows on every path, a batch mixing greedy and
random rows, a top-k / top-p cut or a min_tokens mask allocated several (rows x vocabulary) fp32
temporaries per step; the caching allocator kept them, so reserved - allocated grew by hundreds
of MiB after a burst of such batches and stayed there.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagekeeper_engine.core.sampling_params import SamplingParams
from pagekeeper_engine.memory.budget import MIN_FRAGMENTATION_BUFFER
from pagekeeper_engine.runner.sampler import Sampler, SamplerBuffers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB = 1 << 20
MAX_ROWS = 256
VOCAB = 151_936  # Qwen3's vocabulary: 155 MiB per 256 rows in fp32
PARAMS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(temperature=0.7, seed=7),
    SamplingParams(temperature=0.0, min_tokens=8, stop_token_ids=(5, 9)),
)


def test_a_burst_of_varied_batches_allocates_nothing_batch_sized() -> None:
    device = torch.device("cuda", 0)
    buffers = SamplerBuffers(MAX_ROWS, VOCAB, torch.bfloat16, device)
    sampler = Sampler(device, 0, frozenset({2}), buffers)
    rng = random.Random(0)

    def step(num_rows: int, params: list[SamplingParams]) -> None:
        logits = buffers.logits[:num_rows].normal_()  # (rows, V) bf16, as the model writes them
        outputs = [rng.randint(0, 16) for _ in range(num_rows)]
        sampler.sample(logits, params, outputs)[1].tolist()

    # Warm-up, as the start-up profile does: every path once at the most rows.
    for param in PARAMS:
        step(MAX_ROWS, [param] * MAX_ROWS)
    step(MAX_ROWS, [PARAMS[i % len(PARAMS)] for i in range(MAX_ROWS)])
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # as the profile leaves it: its peak measured, its cache released
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)

    # The burst: 300 steps of every size, each mixing the parameter sets at random.
    for _ in range(300):
        num_rows = rng.randint(1, MAX_ROWS)
        step(num_rows, [rng.choice(PARAMS) for _ in range(num_rows)])
    torch.cuda.synchronize(device)

    assert torch.cuda.memory_allocated(device) == allocated
    # What a step may still allocate (the sort's own keys and values, index rows) scales with
    # the cut's chunk of rows, never with the batch, and stays below the smallest fragmentation
    # buffer the start-up budget sets aside: one (rows x vocabulary) fp32 plane alone is
    # 148 MiB here, and the sampler before these buffers left 1,501 MiB cached.
    transient = torch.cuda.max_memory_allocated(device) - allocated
    assert transient < MIN_FRAGMENTATION_BUFFER / 2, transient / MiB
    grown = torch.cuda.memory_reserved(device) - reserved
    assert grown < MIN_FRAGMENTATION_BUFFER, grown / MiB
