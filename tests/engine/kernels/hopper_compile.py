"""Compiles kernels for sm_90 (Hopper) without running them, in a process where
TRITON_INTERPRET is unset (the interpreter accepts what the compiler refuses): `python -m
tests.engine.kernels.hopper_compile pick` (the token pick: one rank's one launch, with the
schemas' bitmask and without, the two launches around the ranks' gather, and the seeded rows'
draws) or `... peer_reduce` (the one-shot all-reduce, both ways, with and without the norm).
Prints "compiled" and each rank count done.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagekeeper_engine.kernels import (
    NOISE_FLOOR,
    next_power_of_2,
    peer_reduce,
    pick_kernels,
    seeded_noise,
)
from pagekeeper_engine.kernels.pick_scratch import BLOCK_V

VOCAB = 128256  # Llama 3's

PARTIALS = {
    "scores_ptr": "*bf16",
    "raw_ptr": "*bf16",
    "noise_ptr": "*fp32",
    "parts_ptr": "*fp32",
    "index_ptr": "*i32",
    "scores_row_stride": "i32",
    "raw_row_stride": "i32",
    "noise_row_stride": "i32",
    "plane_stride": "i32",
    "scale": "fp32",
}
COMBINE = {
    "parts_ptr": "*fp32",
    "index_ptr": "*i32",
    "token_ids_ptr": "*i64",
    "packed_ptr": "*fp64",
    "plane_stride": "i32",
    "rank_stride": "i32",
    "packed_row_stride": "i32",
}
PICK = {
    "scores_ptr": "*bf16",
    "raw_ptr": "*bf16",
    "noise_ptr": "*fp32",
    "bitmask_ptr": "*i32",
    "parts_ptr": "*fp32",
    "index_ptr": "*i32",
    "counters_ptr": "*i32",
    "token_ids_ptr": "*i64",
    "packed_ptr": "*fp64",
    "scores_row_stride": "i32",
    "raw_row_stride": "i32",
    "noise_row_stride": "i32",
    "bitmask_row_stride": "i32",
    "plane_stride": "i32",
    "packed_row_stride": "i32",
    "scale": "fp32",
    "key": "i64",
}


SEEDED_NOISE = {
    "noise_ptr": "*fp32",
    "rows_keys_ptr": "*i64",
    "num_seeded": "i32",
    "noise_row_stride": "i32",
    "col_offset": "i32",
    "width": "i32",
}


def compile_pick(ranks: int) -> None:
    """Both launches as the last rank of `ranks` runs them over its vocabulary shard, and at one
    rank the one-launch pick; the seeded rows' draws."""
    _compile(seeded_noise._seeded_noise_kernel, SEEDED_NOISE, {"BLOCK": seeded_noise.BLOCK})
    shard = -(-VOCAB // ranks)
    chunks = -(-shard // BLOCK_V)
    partial_constants: dict[str, object] = {
        "VOCAB": VOCAB - (ranks - 1) * shard,
        "INDEX_OFFSET": (ranks - 1) * shard,
        "NO_INDEX": VOCAB,
        "NUM_CHUNKS": chunks,
        "BLOCK_V": BLOCK_V,
        "RULE": pick_kernels.RACE,
        "NOISE_FLOOR": NOISE_FLOOR,
    }
    combine_constants: dict[str, object] = {
        "VOCAB": VOCAB,
        "NUM_CHUNKS": chunks,
        "CHUNKS_PAD": next_power_of_2(chunks),
        "RANKS": ranks,
        "RANKS_PAD": next_power_of_2(ranks),
    }
    _compile(pick_kernels.chunk_partials_kernel, PARTIALS, partial_constants)
    _compile(pick_kernels.combine_chunks_kernel, COMBINE, combine_constants)
    if ranks == 1:  # the whole vocabulary: a race and a CDF's inverse, with a bitmask or not
        rules = (pick_kernels.RACE, pick_kernels.INVERSE_CDF)
        for rule, masked in itertools.product(rules, (False, True)):
            pick_constants: dict[str, object] = {
                "VOCAB": VOCAB,
                "NUM_CHUNKS": chunks,
                "CHUNKS_PAD": next_power_of_2(chunks),
                "BLOCK_V": BLOCK_V,
                "RULE": rule,
                "NOISE_FLOOR": NOISE_FLOOR,
                "MASKED": masked,
            }
            _compile(pick_kernels.pick_kernel, PICK, pick_constants)


PEER_REDUCE = {
    "buffers_ptr": "*i64",
    "pads_ptr": "*i64",
    "counts_ptr": "*i32",
    "residual_ptr": "*bf16",
    "weight_ptr": "*bf16",
    "out_ptr": "*bf16",
    "num_rows": "i32",
    "staging": "i32",
    "region": "i32",
    "residual_row_stride": "i32",
    "out_row_stride": "i32",
    "eps": "fp32",
}


def compile_peer_reduce(ranks: int) -> None:
    """The one-shot all-reduce of bf16 rows of 4,096 as the last rank of `ranks` runs it, each
    way, with the norm and without."""
    bits_dtype, sentinel = peer_reduce.sentinel_bits(torch.bfloat16)
    for norm, push in itertools.product((False, True), (False, True)):
        constants: dict[str, object] = {
            "RANK": ranks - 1,
            "WORLD": ranks,
            "DIM": 4096,
            "BLOCK": 4096,
            "NORM": norm,
            "PUSH": push,
            "BITS": peer_reduce._TRITON_BITS[bits_dtype],
            "SENTINEL": sentinel,
        }
        _compile(peer_reduce._peer_reduce_kernel, PEER_REDUCE, constants)


def _compile(kernel: object, arguments: dict[str, str], constants: dict[str, object]) -> None:
    target = GPUTarget("cuda", 90, 32)
    signature = {**arguments, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    assert triton.compile(source, target=target).asm["cubin"], f"{kernel} gave no cubin"


def compile_for_hopper(kernels: str) -> list[str]:
    """Run this module on `kernels` in a subprocess without the interpreter; its words."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.engine.kernels.hopper_compile", kernels],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


if __name__ == "__main__":
    compile_one = {"pick": compile_pick, "peer_reduce": compile_peer_reduce}[sys.argv[1]]
    print("compiled", end="")
    for ranks in (1, 2, 4):
        compile_one(ranks)
        print(f" {ranks}", end="", flush=True)
    print()
