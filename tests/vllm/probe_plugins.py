"""Run inside a vLLM environment: vLLM's own plugin loader, then what pagekeeper's plugin did.

Prints one JSON object: the general plugins vLLM discovered and loaded, whether pagekeeper's
registered, whether CUDA got initialized, and what the exporter wrote.
"""

import json
import os
import sys
from importlib.metadata import entry_points

import torch
import vllm.plugins

vllm.plugins.load_general_plugins()
discovered = sorted(e.name for e in entry_points(group="vllm.general_plugins"))
plugin = sys.modules.get("pagekeeper_vllm.plugin")
try:  # what a worker does first on a GPU machine; on a CPU-only one it fails
    torch.cuda.init()
    cuda_error = ""
except Exception as exc:
    cuda_error = type(exc).__name__
directory = os.environ.get("PAGEKEEPER_VLLM_METRICS_DIR", "")
# vLLM goes on: its engine arguments still import and parse after the plugin ran.
from vllm.engine.arg_utils import EngineArgs  # noqa: E402  (after the plugin ran)

print(
    json.dumps(
        {
            "discovered": discovered,
            "loaded": plugin is not None and plugin._state.registered_pid == os.getpid(),
            "exporting": plugin is not None and plugin._state.exporting_pid is not None,
            "cuda_initialized": torch.cuda.is_initialized(),
            "cuda_error": cuda_error,
            "written": sorted(os.listdir(directory)) if directory else None,
            "engine_args": EngineArgs.__name__,
        }
    )
)
