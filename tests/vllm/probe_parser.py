"""Run inside a vLLM environment: parse `vllm serve` arguments with vLLM's own parser.

Usage: probe_parser.py MODEL [vLLM flags]. Prints the engine arguments pagekeeper's memory
policy sets, as vLLM parsed them. vLLM picks its platform when it builds the parser; on a
machine without a GPU that is its CPU platform, set here the way its own CLI does for `bench`.
"""

import dataclasses
import json
import sys

import vllm.platforms
from vllm.platforms.cpu import CpuPlatform

vllm.platforms._current_platform = CpuPlatform()
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:  # vLLM before 0.12
    from vllm.utils import FlexibleArgumentParser
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402

parser = FlexibleArgumentParser(prog="vllm")
subcommand = ServeSubcommand()
subcommand.subparser_init(parser.add_subparsers(dest="subparser"))
args = parser.parse_args(["serve", *sys.argv[1:]])
subcommand.validate(args)
fields = [
    "model_tag",
    "served_model_name",
    "host",
    "port",
    "dtype",
    "load_format",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "quantization",
    "cpu_offload_gb",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "disable_custom_all_reduce",
    "api_key",
    # vLLM 0.11.1 and later: the host KV tier
    "kv_offloading_size",
    "kv_offloading_backend",
    "prefix_caching_hash_algo",
    "kv_events_config",  # a KVEventsConfig dataclass, printed as its fields
]
values = {name: getattr(args, name) for name in fields if hasattr(args, name)}
if dataclasses.is_dataclass(values["kv_events_config"]):
    values["kv_events_config"] = dataclasses.asdict(values["kv_events_config"])
print(json.dumps(values))
