"""Fixtures for pagekeeper's vLLM plugin and launcher: the bundle as the init container writes
it, and real vLLM environments (`hack/provision.sh vllm`) to load it into."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.tools import CACHE, REPO, missing
from pagekeeper_vllm.bundle import write_bundle

HERE = Path(__file__).parent
# The versions hack/provision.sh installs: the operator's default image, and the newest.
VLLM_VERSIONS = ("0.11.0", "0.33.0")


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory `python -m pagekeeper_vllm.bundle` writes (the pod's /opt/pagekeeper)."""
    dest = tmp_path_factory.mktemp("bundle") / "opt-pagekeeper"
    write_bundle(dest)
    return dest


def vllm_python(version: str) -> Path:
    """The interpreter of the environment with vLLM `version`; fails under CI when missing."""
    python = CACHE / "vllm" / version / "bin" / "python"
    if not (CACHE / "vllm" / version / ".done").is_file():
        missing(f"the vLLM {version} environment ({python})")
    return python


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a vLLM process: none of this checkout on its path, no CUDA device."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VLLM_PLUGINS"}}
    env.update({"CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "WARNING", **extra})
    return env


def run_probe(
    version: str, script: str, args: list[str], env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(vllm_python(version)), str(HERE / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


@pytest.fixture(params=VLLM_VERSIONS)
def vllm_version(request: pytest.FixtureRequest) -> Iterator[str]:
    vllm_python(request.param)
    yield request.param
