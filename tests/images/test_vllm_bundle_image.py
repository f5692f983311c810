"""The engine image as the init container of a vLLM pod: it writes the bundle vLLM loads.

The init container runs from its rendered spec (command, user, read-only root) with the shared
volume as a directory of this host; real vLLM 0.11.0 (`hack/provision.sh vllm`) then finds and
runs the plugin from that directory, as the vLLM container does with the volume on PYTHONPATH.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagekeeper_operator.render import render_deployment
from tests.images.podman import podman
from tests.operator.servers import make_server
from tests.vllm.conftest import clean_env, run_probe

pytestmark = pytest.mark.timeout(3600)  # a cold `images` fixture builds the bases


def test_the_engine_image_writes_a_bundle_vllm_loads(
    images: dict[str, str], tmp_path: Path
) -> None:
    server = make_server({"runtime": "vllm"})
    pod: dict[str, Any] = render_deployment(
        server, {"pagekeeper": images["engine"], "vllm": "unused"}
    )["spec"]["template"]["spec"]
    [init] = pod["initContainers"]
    security = init["securityContext"]
    [mount] = init["volumeMounts"]
    volume = tmp_path / "volume"
    volume.mkdir(mode=0o777)
    volume.chmod(0o777)  # an emptyDir is world-writable
    assert security["readOnlyRootFilesystem"] is True
    podman(
        "run",
        "--rm",
        "--read-only",
        "--read-only-tmpfs=false",
        f"--user={security['runAsUser']}:{security['runAsGroup']}",
        "--cap-drop=ALL",
        "--security-opt=no-new-privileges",
        f"--volume={volume}:{mount['mountPath']}:rw",
        f"--entrypoint={init['command'][0]}",
        init["image"],
        *init["command"][1:],
        timeout=300,
    )
    assert (volume / "pagekeeper_vllm" / "plugin.py").is_file()
    [info] = volume.glob("pagekeeper_vllm-*.dist-info")
    assert "pagekeeper = pagekeeper_vllm.plugin:register" in (info / "entry_points.txt").read_text()

    metrics = tmp_path / "metrics"
    metrics.mkdir()
    env = clean_env(PYTHONPATH=str(volume), PAGEKEEPER_VLLM_METRICS_DIR=str(metrics))
    result = run_probe("0.11.0", "probe_plugins.py", [], env)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] is True and report["written"] == []
