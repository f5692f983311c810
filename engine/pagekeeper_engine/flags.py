"""The engine's flag table: each `pagekeeper-engine serve` flag's name, type, bounds, default
and help, and the value types that check them.

Flag names follow vLLM's so one memory policy can drive either engine. This module imports
neither torch nor anything heavy: the operator's contract test parses rendered args with it.
`config.parse_args` adds the rules that span flags and builds an `EngineConfig`.
"""

from __future__ import annotations

import argparse
import re
from typing import Literal

from pagekeeper_engine.kv_events_config import (
    KV_EVENTS_ENCODINGS,
    KVEventsConfig,
    parse_kv_events_config,
)
from pagekeeper_memplan.defaults import (
    BLOCK_SIZES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFIX_CACHE_MAX_FRACTION,
    MAX_GPU_MEMORY_UTILIZATION,
)

# --kv-cache-dtype: "auto" stores keys and values in the model's dtype; "fp8" (e4m3, also spelled
# fp8_e4m3, as vLLM does) in one byte each.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
# --quantization: the linear projections' weights; "fp8" (e4m3, per-output-channel scales),
# quantized at load from a bf16 checkpoint or read from an FP8 one (vLLM's flag and names).
QUANTIZATIONS = ("none", "fp8")
# --kv-offloading-backend: vLLM's names; this engine has only its own (native) host tier.
KV_OFFLOADING_BACKENDS = ("native",)
# Sequences that may wait beyond the running ones, per running slot, unless
# --max-waiting-requests says otherwise. Larger than the queue backlog alert's ratio
# (waiting > 3 x running), so the alert can fire before 429s start.
WAITING_PER_RUNNING_SLOT = 8
# --stuck-timeout: seconds the step loop may go without completing a turn before the engine is
# declared stuck. The longest legitimate step is a whole --max-num-batched-tokens prefill on a
# slow GPU: 8192 tokens take about 2 s for an 8B model on one L4 (some 60 TFLOP/s achieved) or
# a 70B model over four L40S, and a whole 32k-token prompt without chunked prefill (attention's
# quadratic term included) about 15-20 s. 60 s leaves three times that, and matches the front
# end's bound on a silent core (`CoreClient.heartbeat_timeout_s`), past which /health fails.
DEFAULT_STUCK_TIMEOUT_S = 60.0
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|K|M|G|T|k)?B?$")
_UNITS = {
    None: 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def parse_bytes(text: str) -> int:
    """Parse a byte quantity in Kubernetes notation ("512Mi", "2Gi", "1000000")."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise ValueError(f"not a byte quantity: {text!r} (use e.g. 512Mi, 2Gi or a byte count)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _fragmentation_buffer(text: str) -> int | Literal["auto"]:
    if text == "auto":
        return "auto"
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive_bytes(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive byte count")
    return value


def _bounded(kind: type[int] | type[float], lo: float, hi: float | None, *, lo_open: bool = False):  # type: ignore[no-untyped-def]
    def check(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from exc
        too_low = value <= lo if lo_open else value < lo
        if too_low or (hi is not None and value > hi):
            bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi if hi is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{value} is outside {bound}")
        return value

    return check


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return parse_kv_events_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagekeeper-engine serve",
        description="Serve a model over an OpenAI-compatible HTTP API with a paged KV cache.",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("model", help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer)")
    add("--served-model-name", default=None, help="name clients use; defaults to MODEL")
    add("--host", default="0.0.0.0")
    add("--port", type=_bounded(int, 0, 65535), default=8000)
    add("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default="auto")
    add("--device", choices=["cuda", "cpu"], default="cuda")
    add(
        "--load-format",
        choices=["auto", "safetensors", "dummy"],
        default="auto",
        help="dummy: random weights at the config's real shape",
    )
    add("--seed", type=int, default=0)
    add(
        "--gpu-memory-utilization",
        type=_bounded(float, 0.0, MAX_GPU_MEMORY_UTILIZATION, lo_open=True),
        default=None,
        help="fraction of the GPU's total memory this instance may use, in "
        f"(0, {MAX_GPU_MEMORY_UTILIZATION}]; default {DEFAULT_GPU_MEMORY_UTILIZATION} unless "
        "--kv-cache-memory-bytes is given",
    )
    add(
        "--kv-cache-memory-bytes",
        type=_positive_bytes,
        default=None,
        help="the KV cache's bytes per GPU (a byte count or a quantity such as 20Gi), instead of "
        "what --gpu-memory-utilization leaves; the engine still refuses to start when the "
        "weights, activations, non-torch memory, fragmentation buffer and these bytes exceed "
        "the GPU's free memory. On the CPU: the KV cache's bytes in host memory",
    )
    add(
        "--block-size",
        type=int,
        choices=BLOCK_SIZES,
        default=DEFAULT_BLOCK_SIZE,
        help="tokens per KV block",
    )
    add(
        "--max-num-batched-tokens",
        type=_bounded(int, 1, None),
        default=None,
        help="tokens per forward step (the prefill chunk budget)",
    )
    add(
        "--max-num-seqs",
        type=_bounded(int, 1, None),
        default=DEFAULT_MAX_NUM_SEQS,
        help="running sequences",
    )
    add("--max-model-len", type=_bounded(int, 1, None), default=None)
    add(
        "--swap-space",
        type=_bounded(float, 0.0, None),
        default=4.0,
        help="GiB of pinned CPU memory for swapped-out KV blocks",
    )
    add("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add(
        "--prefix-cache-max-fraction",
        type=_bounded(float, 0.0, 1.0),
        default=DEFAULT_PREFIX_CACHE_MAX_FRACTION,
        help="bound on the share of KV blocks held only by the prefix cache",
    )
    add(
        "--fragmentation-buffer",
        type=_fragmentation_buffer,
        default="auto",
        help="'auto' (measured at start-up) or a byte quantity such as 512Mi",
    )
    add(
        "--num-gpu-blocks-override",
        type=_bounded(int, 1, None),
        default=None,
        help="use exactly this many KV blocks instead of the measured budget (testing)",
    )
    add("--num-cpu-blocks-override", type=_bounded(int, 0, None), default=None)
    add("--enforce-eager", action="store_true", help="disable CUDA graphs")
    add(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and pack the next step while the device runs the current one; "
        "default on for --device cuda, off for cpu",
    )
    add(
        "--shutdown-timeout",
        type=_bounded(float, 0.0, None),
        default=30.0,
        help="seconds running requests may take to finish after SIGTERM",
    )
    add(
        "--api-key",
        default=None,
        help="a bearer token every /v1/* request must carry (Authorization: Bearer <key>), as "
        "vLLM's flag; /health, /ready and /metrics stay open for probes and Prometheus",
    )
    add(
        "--admin-token-env",
        default="PAGEKEEPER_ADMIN_TOKEN",
        help="environment variable holding the bearer token for /admin endpoints",
    )
    add(
        "--max-waiting-requests",
        type=_bounded(int, 0, None),
        default=None,
        help="sequences that may queue beyond the --max-num-seqs running ones before new "
        f"requests get 429; default {WAITING_PER_RUNNING_SLOT} x --max-num-seqs",
    )
    add(
        "--max-consecutive-ooms",
        type=_bounded(int, 0, None),
        default=8,
        help="device out-of-memory errors in a row (each halving the step) before the engine "
        "gives up and exits",
    )
    add(
        "--stuck-timeout",
        type=_bounded(float, 0.0, None),
        default=DEFAULT_STUCK_TIMEOUT_S,
        help="seconds the step loop may go without completing a step (or an idle turn) before "
        "the engine is declared stuck: readiness fails, the termination message says "
        f"pagekeeper-stuck and the process exits 1; 0 disables (default "
        f"{DEFAULT_STUCK_TIMEOUT_S:g})",
    )
    add(
        "--termination-log-path",
        default="/dev/termination-log",
        help="where an out-of-memory exit writes its reason for the operator",
    )
    add(
        "--tensor-parallel-size",
        type=int,
        choices=TENSOR_PARALLEL_SIZES,
        default=1,
        help="GPUs one model is split over, one engine process each",
    )
    add(
        "--disable-custom-all-reduce",
        action="store_true",
        help="all-reduce between the GPUs through NCCL alone; by default small ones go one-shot "
        "over peer-mapped memory where start-up timing finds it faster on every rank",
    )
    add(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="auto: the model's dtype; fp8 (= fp8_e4m3): one byte per value, twice the tokens in "
        "the same memory (CUDA GPUs of compute capability 8.9 or newer)",
    )
    add(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8: the linear projections' weights in FP8 (e4m3) with a scale per output "
        "channel, quantized at load from a bf16 checkpoint; half their memory, FP8 GEMMs on "
        "CUDA GPUs of compute capability 8.9 or newer (the CPU runs a dequantizing reference). "
        "Default: the checkpoint's quantization_config, else none",
    )
    add(
        "--cpu-offload-gb",
        type=_bounded(float, 0.0, None),
        default=0.0,
        help="GiB of the linear projections' weights per GPU (whole decoder layers, spread "
        "evenly over the depth) kept in pinned host memory and copied to the GPU ahead of use "
        "in every forward pass, overlapped with the layers before them; the steps then run "
        "without CUDA graphs. A no-op on the CPU",
    )
    add(
        "--kv-offloading-size",
        type=_bounded(float, 0.0, None),
        default=0.0,
        help="GiB of pinned host memory for a second tier of the prefix cache, total over the "
        "tensor-parallel ranks (each rank holds its shard of every block): full blocks are "
        "copied there as they are computed, on a side stream, and a prefix found there is "
        "loaded back instead of recomputed. 0 (default): no host tier. Needs prefix caching",
    )
    add(
        "--kv-offloading-backend",
        choices=KV_OFFLOADING_BACKENDS,
        default="native",
        help="the host tier's implementation: native (the engine's own; vLLM's name for its "
        "built-in one). vLLM also offers lmcache, which this engine does not have",
    )
    add(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help="JSON with vLLM's KVEventsConfig fields (enable_kv_cache_events, publisher null|zmq, "
        "endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic): publish "
        "BlockStored / BlockRemoved / AllBlocksCleared in vLLM's wire format for KV-aware "
        'routers, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
    )
    add(
        "--kv-events-encoding",
        choices=KV_EVENTS_ENCODINGS,
        default="array",
        help="how each KV event is encoded: array (tagged arrays, as vLLM 0.11 sends and llm-d's "
        "KV-cache indexer reads) or map (tagged maps, as vLLM 0.33 sends)",
    )
    add(
        "--api-server-count",
        type=_bounded(int, 1, 64),
        default=1,
        help="front-end processes (HTTP, tokenization, detokenization) sharing the port; the "
        "engine core runs in a process of its own either way",
    )
    return parser
