"""Waiting for a background job of `make test` (`hack/jobs.sh`): a slow one-off build (the test
images, Argo CD's Lua test binary) that overlaps the run until a test needs what it builds.

Without `PAGEKEEPER_JOBS`, or with no such job started (pytest run by hand), there is nothing
to wait for and the caller finds (or builds) what it needs itself.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from harness.tools import REPO

# A cold build of Argo CD's test binary takes about 10 minutes on a loaded 2-core machine.
JOB_TIMEOUT_S = 45 * 60


def wait_job(name: str, timeout: float = JOB_TIMEOUT_S) -> None:
    """Until the job `name` has ended; a test failure with its log's tail if it failed."""
    if not os.environ.get("PAGEKEEPER_JOBS"):
        return
    result = subprocess.run(
        ["bash", str(REPO / "hack" / "jobs.sh"), "wait", name],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"background job {name} failed:\n{result.stderr[-6000:]}", pytrace=False)
