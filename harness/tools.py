"""Finding the external tools tests need: under CI=true a missing tool fails, never skips."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("PAGEKEEPER_CACHE", Path.home() / ".cache" / "pagekeeper"))
BIN = CACHE / "bin"
REPO = Path(__file__).resolve().parents[1]


def is_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def missing(what: str) -> None:
    """Fail under CI (a missing tool is a broken environment there), skip on a dev machine."""
    message = f"{what} is missing: run `make tools` (hack/provision.sh)"
    if is_ci():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def tool(name: str) -> str:
    """Path of an executable from the provisioned cache or PATH."""
    cached = BIN / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    found = shutil.which(name)
    if found is None:
        missing(name)
        raise AssertionError("unreachable")  # missing() always raises
    return found
