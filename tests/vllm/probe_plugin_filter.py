"""Run inside a vLLM environment: which general plugins vLLM's own loader loads under each
value of VLLM_PLUGINS, in one process (vLLM reads the variable on every call).

argv[1]: a JSON list of values, null for the variable unset. Prints one JSON object: value ->
the names of the plugins loaded (imported; a general plugin's function runs only under
`load_general_plugins`, which probe_plugins.py covers).
"""

import json
import os
import sys

from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

loaded = {}
for value in json.loads(sys.argv[1]):
    if value is None:
        os.environ.pop("VLLM_PLUGINS", None)
    else:
        os.environ["VLLM_PLUGINS"] = value
    loaded[json.dumps(value)] = sorted(load_plugins_by_group(DEFAULT_PLUGINS_GROUP))
print(json.dumps(loaded))
