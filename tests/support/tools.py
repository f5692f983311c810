"""`harness.tools` under the path that tests/operator/alerts/ imports."""

from harness.tools import BIN, CACHE, REPO, is_ci, missing, tool

__all__ = ["BIN", "CACHE", "REPO", "is_ci", "missing", "tool"]
