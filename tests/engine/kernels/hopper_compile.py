"""Compiles the token pick's two launches for sm_90 (Hopper) without running them: `python -m
tests.engine.kernels.hopper_compile`, in a process where TRITON_INTERPRET is unset (the
interpreter accepts what the compiler refuses). Prints "compiled" and each rank count done.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagekeeper_engine.kernels import NOISE_FLOOR, next_power_of_2, sampling
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


def compile_pick(ranks: int) -> None:
    """Both launches as the last rank of `ranks` runs them over its vocabulary shard."""
    target = GPUTarget("cuda", 90, 32)
    shard = -(-VOCAB // ranks)
    chunks = -(-shard // BLOCK_V)
    partial_constants: dict[str, object] = {
        "VOCAB": VOCAB - (ranks - 1) * shard,
        "INDEX_OFFSET": (ranks - 1) * shard,
        "NO_INDEX": VOCAB,
        "NUM_CHUNKS": chunks,
        "BLOCK_V": BLOCK_V,
        "HAS_NOISE": True,
        "NOISE_FLOOR": NOISE_FLOOR,
    }
    combine_constants: dict[str, object] = {
        "VOCAB": VOCAB,
        "NUM_CHUNKS": chunks,
        "CHUNKS_PAD": next_power_of_2(chunks),
        "RANKS": ranks,
        "RANKS_PAD": next_power_of_2(ranks),
    }
    for kernel, arguments, constants in (
        (sampling._chunk_partials_kernel, PARTIALS, partial_constants),
        (sampling._combine_chunks_kernel, COMBINE, combine_constants),
    ):
        signature = {**arguments, **dict.fromkeys(constants, "constexpr")}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
        assert triton.compile(source, target=target).asm["cubin"], f"{kernel} gave no cubin"


if __name__ == "__main__":
    print("compiled", end="")
    for ranks in (1, 2, 4):
        compile_pick(ranks)
        print(f" {ranks}", end="", flush=True)
    print()
