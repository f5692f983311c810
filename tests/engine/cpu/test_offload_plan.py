"""--cpu-offload-gb: which layers go to host memory (exact ids), what the GPU saves, the
refusals, and the CPU's no-op."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagekeeper_engine.config import parse_args
from pagekeeper_engine.model.offload_plan import (
    OffloadError,
    linear_params_per_layer,
    plan_offload,
)
from tests.engine.checkpoints import make_runner, seq, step_logits, tokens, write_checkpoint
from tests.engine.shapes import LLAMA_8B

# Llama-3.1-8B in bf16: 218,103,808 projection weights a layer, 436,207,616 bytes (0.406 GiB).
LAYER_BYTES = 2 * linear_params_per_layer(
    LLAMA_8B.hidden_size, LLAMA_8B.q_size, LLAMA_8B.kv_size, LLAMA_8B.intermediate_size
)


def test_a_layer_of_the_8b_shape() -> None:
    assert LAYER_BYTES == 436_207_616


def test_eight_gib_of_the_8b_are_twenty_layers_spread_over_the_depth() -> None:
    plan = plan_offload(32, LAYER_BYTES, 8.0)
    # 8 GiB / 0.406 GiB = 19.7: rounded up to 20 layers, at floor((j + 1) 32 / 20) - 1.
    assert plan.layer_ids == (
        0,
        2,
        3,
        5,
        7,
        8,
        10,
        11,
        13,
        15,
        16,
        18,
        19,
        21,
        23,
        24,
        26,
        27,
        29,
        31,
    )
    assert plan.offloaded_bytes == 20 * LAYER_BYTES
    assert plan.staging_bytes == 2 * LAYER_BYTES
    assert plan.saved_bytes == 18 * LAYER_BYTES
    assert plan.describe().startswith("20 layers [0, 2, 3, ")


@pytest.mark.parametrize(
    ("gib", "layer_ids"),
    [
        (0.0, ()),
        (0.1, (31,)),  # one layer: the last, with 31 resident layers ahead of its copy
        (0.5, (15, 31)),
        (2.0, (5, 11, 18, 24, 31)),
        (13.0, tuple(range(32))),  # 32 x 0.406 = 13.0 GiB: every layer
    ],
)
def test_layer_choice(gib: float, layer_ids: tuple[int, ...]) -> None:
    assert plan_offload(32, LAYER_BYTES, gib).layer_ids == layer_ids


def test_one_staging_buffer_for_one_layer_and_the_refusals() -> None:
    one = plan_offload(32, LAYER_BYTES, 0.1)
    assert (one.staging_bytes, one.saved_bytes) == (LAYER_BYTES, 0)
    with pytest.raises(
        OffloadError, match=r"--cpu-offload-gb 14\.0 exceeds the linear weights of all 32"
    ):
        plan_offload(32, LAYER_BYTES, 14.0)
    with pytest.raises(OffloadError, match="negative"):
        plan_offload(32, LAYER_BYTES, -1.0)


def test_the_flag() -> None:
    assert parse_args(["/m"]).cpu_offload_gb == 0.0
    assert parse_args(["/m", "--cpu-offload-gb", "8"]).cpu_offload_gb == 8.0
    with pytest.raises(SystemExit):
        parse_args(["/m", "--cpu-offload-gb", "-1"])


def test_the_cpu_runs_every_layer_resident(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama")
    plain = make_runner(tmp_path)
    offloaded = make_runner(tmp_path, cpu_offload_gb=1.0)
    assert offloaded.offload_plan.layer_ids == ()
    assert offloaded.model.model.offload is None
    prompt = tokens(11)
    (expected,) = step_logits(plain, [seq("a", prompt, 0, [0, 1])])
    (got,) = step_logits(offloaded, [seq("a", prompt, 0, [0, 1])])
    assert got.equal(expected)
